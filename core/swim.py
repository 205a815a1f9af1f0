"""SWIM membership: failure detection by probes, dissemination piggybacked on them.

A pure state machine (no threads, sockets or clock): a ``Swim`` is given ``now`` and the
messages that arrive, and returns the messages to send as ``(member, Message)`` pairs, so
the same code runs in a runtime and in a discrete-event simulator (bench/sim_swim.py).
The protocol is SWIM's (Das, Gupta, Motivala, DSN 2002) with Lifeguard's refinements
(Dadgar et al. 2018), as memberlist runs them:

* **Probe rounds.** Each round (``probe_interval``) a member probes one peer, the next of a
  shuffled round-robin of its peers (reshuffled each pass: every live peer is probed within
  n rounds). The target has ``probe_timeout`` to acknowledge the ping; otherwise
  ``indirect_checks`` other live members are asked to ping it (ping-req) and relay its
  acknowledgement, or answer with a nack if they got none. An acknowledgement, direct or
  relayed, that arrives before the round ends is a success; else the target is suspected.
* **Suspicion before dead.** A member that suspects another (or hears that another does)
  starts a timer: ``min = suspicion_mult * max(1, log10(n)) * probe_interval`` and
  ``max = suspicion_max_mult * min`` for n known live members. It starts at ``max`` and
  falls towards ``min`` as independent suspicions arrive: after c of the expected
  ``K = suspicion_mult - 2`` confirmations it is ``max - (max - min) * log(c+1) / log(K+1)``
  (never under ``min``). When it expires the member is dead. A suspected member that hears
  of it refutes with a higher incarnation, which overrides the suspicion everywhere.
* **Local health (Lifeguard).** A member counts signs that it, not its peers, is slow: a
  probe that failed while nacks that should have come did not (+1 each), and being
  suspected (+1); a successful probe counts -1. The count a (0 to ``max_awareness - 1``)
  stretches its probe interval and timeouts by a+1, so a starved member probes more
  patiently instead of suspecting healthy peers.
* **Dissemination.** Changes (joins, refutations, suspicions, deaths, leaves) are updates
  queued for piggybacking on every ping, ping-req, ack and nack, fewest-sent first, each
  sent at most ``retransmit_mult * ceil(ln(n + 1))`` times, at most ``piggyback_bytes``
  of them a message. A message to a member also tells it what the sender thinks of it when
  that is not "alive", so it can refute at once. Every ``dead_probe_rounds`` rounds a
  member also pings one member it holds dead, so two sides of a healed partition find
  each other again.

Messages per member per round: one ping and its ack, plus k ping-reqs, their pings, acks
and nacks when a probe is not answered in time, plus the occasional ping of a dead member:
O(1) whatever n, against the O(n) of ``clusterwire.membership``'s heartbeats.

What a member accepts (a token holder may be hostile or buggy): a message of at most
``MAX_MESSAGE_BYTES`` encoded, at most ``MAX_UPDATES`` updates, names and addresses of at
most ``MAX_NAME_CHARS``, incarnations and sequence numbers in ``[0, MAX_INCARNATION]``
(errors raised: ``InvalidArgumentError``, ``ResourceExhaustedError``). A message from a
member it does not know is refused (``PermissionDeniedError``) unless joins are allowed and
it carries the sender's own "alive" (its join); an update about an unknown member is taken
only if it is an "alive" (a join) while joins are allowed and fewer than ``max_members``
are known. Within a well-formed message these updates are dropped, and counted in
``stats.refused`` by reason, while the rest is taken: an incarnation more than
``MAX_INCARNATION_STEP`` above the known one unless the message comes from that member
itself; a new address for a known member (a task moves through the versioned views of
``clusterwire.membership``, which check the new address); an "alive" about the receiver
itself (only a member raises its own incarnation: a member refutes only for itself).
A member serves at most ``MAX_FORWARDS`` ping-reqs at once (``ResourceExhaustedError``
beyond). What the bounds do not stop: a token holder can relay false news about other
members (a forged death is refuted by its subject; a forged refutation delays a death by
a suspicion period), since updates relayed by third parties carry no per-member proof.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

from clusterwire import errors
from clusterwire.membership import MAX_TASKS

#: The most bytes an encoded message may have, and updates a message may carry.
MAX_MESSAGE_BYTES = 16384
MAX_UPDATES = 64
#: The longest member name or address.
MAX_NAME_CHARS = 256
#: The highest incarnation or sequence number.
MAX_INCARNATION = 2**63 - 1
#: How far above the known incarnation a relayed update may be.
MAX_INCARNATION_STEP = 64
#: Ping-reqs a member serves at once.
MAX_FORWARDS = 64
#: The most members a ``Config`` may allow.
MAX_MEMBERS_LIMIT = 65536


class State(IntEnum):
    """A member's state in a view."""

    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


class Kind(IntEnum):
    """A message's kind."""

    PING = 1
    ACK = 2
    PING_REQ = 3
    NACK = 4


class Update(NamedTuple):
    """What one member's state is: ``address`` is set in "alive" updates (a join's),
    ``origin`` in "suspect" ones (who suspects, for Lifeguard's confirmations)."""

    member: str
    state: State
    incarnation: int
    address: str = ""
    origin: str = ""


@dataclass(frozen=True)
class Message:
    """A message between members: ``target`` is the member pinged (ping, ping-req)."""

    kind: Kind
    seq: int
    sender: str
    target: str
    updates: tuple[Update, ...] = ()

    def validate(self) -> None:
        """InvalidArgumentError or ResourceExhaustedError unless within the module's bounds."""
        if not isinstance(self.kind, int) or self.kind not in _KINDS:
            raise errors.InvalidArgumentError(
                f"SWIM message kind {self.kind!r} is not one of {sorted(_KINDS)}")
        _check_int("sequence number", self.seq)
        _check_name("sender", self.sender, empty=False)
        _check_name("target", self.target, empty=self.kind in (Kind.ACK, Kind.NACK))
        if not isinstance(self.updates, tuple):
            raise errors.InvalidArgumentError(
                f"SWIM message updates must be a tuple, not {type(self.updates).__name__}")
        if len(self.updates) > MAX_UPDATES:
            raise errors.ResourceExhaustedError(
                f"SWIM message from {self.sender!r} carries {len(self.updates)} updates, "
                f"more than MAX_UPDATES={MAX_UPDATES}: send the rest in later messages")
        for update in self.updates:
            if not isinstance(update, Update):
                raise errors.InvalidArgumentError(
                    f"SWIM update {update!r} is not a swim.Update")
            _check_name("update member", update.member, empty=False)
            if not isinstance(update.state, int) or update.state not in _STATES:
                raise errors.InvalidArgumentError(
                    f"SWIM update state {update.state!r} is not one of {sorted(_STATES)}")
            _check_int("incarnation", update.incarnation)
            _check_name("update address", update.address, empty=True)
            _check_name("update origin", update.origin, empty=True)

    def to_bytes(self) -> bytes:
        """The message encoded (compact JSON)."""
        return json.dumps([int(self.kind), self.seq, self.sender, self.target,
                           [_update_fields(u) for u in self.updates]],
                          separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Message:
        """The message ``data`` encodes, checked against the module's bounds."""
        if len(data) > MAX_MESSAGE_BYTES:
            raise errors.ResourceExhaustedError(
                f"SWIM message of {len(data)} bytes is over MAX_MESSAGE_BYTES="
                f"{MAX_MESSAGE_BYTES}: lower piggyback_bytes on the sender")
        try:
            fields = json.loads(data)
            kind, seq, sender, target, updates = fields
            if len(updates) > MAX_UPDATES:
                raise errors.ResourceExhaustedError(
                    f"SWIM message carries {len(updates)} updates, more than "
                    f"MAX_UPDATES={MAX_UPDATES}: send the rest in later messages")
            message = cls(_enum(Kind, kind), seq, sender, target,
                          tuple(Update(m, _enum(State, s), i, a, o)
                                for m, s, i, a, o in updates))
        except (ValueError, TypeError, RecursionError) as error:
            raise errors.InvalidArgumentError(
                f"not a SWIM message ({error}): expected JSON "
                "[kind, seq, sender, target, [[member, state, incarnation, address, "
                "origin], ...]]") from None
        message.validate()
        return message


_KINDS = frozenset(int(k) for k in Kind)
_STATES = frozenset(int(s) for s in State)


def _enum(kind: type[IntEnum], value: Any) -> Any:
    """``value`` as a member of ``kind`` when it is one, else unchanged (validate says)."""
    if type(value) is int and value in kind._value2member_map_:
        return kind(value)
    return value


def _update_fields(update: Update) -> list:
    return [update.member, int(update.state), update.incarnation, update.address, update.origin]


def _encoded_size(update: Update) -> int:
    """The bytes ``update`` takes in an encoded message (with its separator)."""
    return len(json.dumps(_update_fields(update), separators=(",", ":"))) + 1


def _check_int(what: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not (
            0 <= value <= MAX_INCARNATION):
        raise errors.InvalidArgumentError(
            f"SWIM {what} {value!r} is not an integer in [0, {MAX_INCARNATION}]")


def _check_name(what: str, value: Any, *, empty: bool) -> None:
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS or (not empty and not value):
        raise errors.InvalidArgumentError(
            f"SWIM {what} {str(value)[:80]!r} is not a "
            + ("" if empty else "non-empty ") + f"string of at most {MAX_NAME_CHARS} characters")


@dataclass(frozen=True)
class Config:
    """The protocol's constants (seconds, counts); the defaults are memberlist's LAN ones."""

    probe_interval: float = 1.0
    probe_timeout: float = 0.5
    indirect_checks: int = 3
    suspicion_mult: int = 4
    suspicion_max_mult: int = 6
    retransmit_mult: int = 3
    max_awareness: int = 8
    piggyback_bytes: int = 1024
    dead_probe_rounds: int = 8
    allow_joins: bool = False
    max_members: int = MAX_TASKS

    def __post_init__(self) -> None:
        if not 0 < self.probe_timeout < self.probe_interval < math.inf:
            raise errors.InvalidArgumentError(
                f"SWIM probe_timeout={self.probe_timeout} and probe_interval="
                f"{self.probe_interval} must be finite with 0 < probe_timeout < "
                "probe_interval: the indirect probes need the rest of the round")
        for name, low, high in (("indirect_checks", 0, 16), ("suspicion_mult", 1, 64),
                                ("suspicion_max_mult", 1, 64), ("retransmit_mult", 1, 64),
                                ("max_awareness", 1, 64), ("dead_probe_rounds", 0, 1 << 20),
                                ("piggyback_bytes", 0, MAX_MESSAGE_BYTES - 2048),
                                ("max_members", 2, MAX_MEMBERS_LIMIT)):
            value = getattr(self, name)
            if not isinstance(value, int) or not low <= value <= high:
                raise errors.InvalidArgumentError(
                    f"SWIM {name}={value!r} must be an integer in [{low}, {high}]")

    def suspicion_bounds(self, live: int) -> tuple[float, float]:
        """The suspicion timeout's floor and ceiling, in seconds, for ``live`` members."""
        low = self.suspicion_mult * max(1.0, math.log10(max(live, 1))) * self.probe_interval
        return low, low * self.suspicion_max_mult

    def retransmits(self, members: int) -> int:
        """How many times an update is piggybacked by each member that queues it."""
        return self.retransmit_mult * math.ceil(math.log(members + 1))


@dataclass
class Stats:
    """Messages sent by kind, updates refused by reason."""

    sent: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)


class _Member:
    __slots__ = ("address", "state", "incarnation")

    def __init__(self, address: str, state: State, incarnation: int):
        self.address = address
        self.state = state
        self.incarnation = incarnation


class _Suspicion:
    __slots__ = ("start", "low", "high", "expected", "confirmers", "deadline")

    def __init__(self, start: float, low: float, high: float, expected: int, origin: str):
        self.start, self.low, self.high, self.expected = start, low, high, expected
        self.confirmers = {origin}
        self.deadline = start + self.timeout()

    def timeout(self) -> float:
        if self.expected < 1:
            return self.low
        fraction = math.log(len(self.confirmers)) / math.log(self.expected + 1)
        return max(self.low, self.high - (self.high - self.low) * fraction)

    def confirm(self, origin: str) -> bool:
        if origin in self.confirmers:
            return False
        self.confirmers.add(origin)
        self.deadline = self.start + self.timeout()
        return True


class _Probe:
    __slots__ = ("target", "seq", "indirect_at", "end_at", "acked", "helpers", "nackers")

    def __init__(self, target: str, seq: int, indirect_at: float, end_at: float):
        self.target, self.seq = target, seq
        self.indirect_at, self.end_at = indirect_at, end_at
        self.acked = False
        self.helpers: tuple[str, ...] | None = None  # None: no ping-req sent yet
        self.nackers: set[str] = set()


class _Forward:
    __slots__ = ("requester", "seq", "target", "nack_at", "expire_at", "nacked")

    def __init__(self, requester: str, seq: int, target: str, nack_at: float,
                 expire_at: float):
        self.requester, self.seq, self.target = requester, seq, target
        self.nack_at, self.expire_at = nack_at, expire_at
        self.nacked = False


class _Broadcasts:
    """Updates to piggyback, one per member (a newer one replaces it), fewest-sent first."""

    def __init__(self) -> None:
        self._entries: dict[str, list] = {}  # member -> [update, times sent, encoded size]

    def __len__(self) -> int:
        return len(self._entries)

    def queue(self, update: Update) -> None:
        self._entries[update.member] = [update, 0, _encoded_size(update)]

    def take(self, budget: int, count: int, limit: int, skip: str) -> list[Update]:
        chosen: list[Update] = []
        for member, entry in sorted(self._entries.items(), key=lambda item: item[1][1]):
            if len(chosen) >= count:
                break
            if member == skip or entry[2] > budget:
                continue
            budget -= entry[2]
            chosen.append(entry[0])
            entry[1] += 1
            if entry[1] >= limit:
                del self._entries[member]
        return chosen


Outgoing = list[tuple[str, Message]]


class Swim:
    """One member's SWIM state machine.

    ``peers`` maps the members' names to their addresses (all alive at incarnation 0; this
    member's own name may be among them). It is kept, not copied, so members simulated
    together share one (it must not change); a member's record is made when its state
    first changes, so besides its probe order (one list of the n names) a member's
    memory grows with the changes it saw, not with n.
    ``rng`` makes it deterministic. Call ``tick(now)`` at ``next_wakeup()`` (or later)
    and ``receive(now, message)`` for each message, and send what they return;
    ``take_changes()`` says which members changed state since it was last called.
    """

    def __init__(self, name: str, address: str, peers: Mapping[str, str], *, now: float,
                 config: Config | None = None, rng: random.Random | None = None,
                 incarnation: int = 0):
        _check_name("member name", name, empty=False)
        _check_int("incarnation", incarnation)
        self.name, self.address = name, address
        self.config = config or Config()
        self._base = peers
        self._records: dict[str, _Member] = {}  # members added or changed since the start
        self._size = len(peers) - (name in peers)  # members known, besides this one
        if self._size + 1 > self.config.max_members:
            raise errors.InvalidArgumentError(
                f"SWIM member {name!r} was given {self._size + 1} members, more than "
                f"max_members={self.config.max_members}: raise Config.max_members")
        self.incarnation = incarnation
        self.stats = Stats()
        self._rng = rng or random.Random()
        self._order = [peer for peer in peers if peer != name]
        self._rng.shuffle(self._order)
        self._next = 0
        self._gone: dict[str, State] = {}  # members dead or left
        self._suspicions: dict[str, _Suspicion] = {}
        self._broadcasts = _Broadcasts()
        self._probe: _Probe | None = None
        self._forwards: dict[int, _Forward] = {}
        self._seq = 0
        self._awareness = 0
        self._rounds = 0
        self._left = False
        self._changes: list[tuple[str, State]] = []
        self._heard: set[str] = set()  # members a message came from: they know this one
        # Members started together do not probe in lockstep.
        self._next_round = now + self._rng.uniform(0, self.config.probe_interval)

    # -- what the runtime asks ------------------------------------------------------------

    def state(self, member: str) -> State | None:
        """``member``'s state in this view (None if unknown)."""
        if member == self.name:
            return State.LEFT if self._left else State.ALIVE
        return self._state(member)

    def members(self) -> dict[str, tuple[State, int]]:
        """Every other known member's state and incarnation."""
        view = {peer: (State.ALIVE, 0) for peer in self._base if peer != self.name}
        view.update((peer, (m.state, m.incarnation)) for peer, m in self._records.items())
        return view

    def awareness(self) -> int:
        """The local health count (0: healthy), which stretches this member's timeouts."""
        return self._awareness

    def take_changes(self) -> list[tuple[str, State]]:
        """The state changes of members since the last call, oldest first."""
        changes, self._changes = self._changes, []
        return changes

    def next_wakeup(self) -> float:
        """The earliest time at which ``tick`` has something to do."""
        if self._left:
            return math.inf
        times = [self._next_round]
        if self._probe is not None:
            times.append(self._probe.end_at)
            if not self._probe.acked and self._probe.helpers is None:
                times.append(self._probe.indirect_at)
        for forward in self._forwards.values():
            times.append(forward.expire_at if forward.nacked else forward.nack_at)
        for suspicion in self._suspicions.values():
            times.append(suspicion.deadline)
        return min(times)

    # -- driving it -----------------------------------------------------------------------

    def join(self) -> None:
        """Announce this member (alive at its incarnation, with its address) to the others."""
        self._broadcasts.queue(Update(self.name, State.ALIVE, self.incarnation, self.address))

    def leave(self) -> Outgoing:
        """Leave for good: the leave goes to ``indirect_checks`` live members at once (and
        spreads from them); from then on this member sends and takes nothing."""
        out: Outgoing = []
        if self._left:
            return out
        self.incarnation = min(self.incarnation + 1, MAX_INCARNATION)
        self._broadcasts.queue(Update(self.name, State.LEFT, self.incarnation))
        for peer in self._live_sample(max(1, self.config.indirect_checks), exclude=""):
            out.append((peer, self._message(Kind.PING, self._next_seq(), peer, peer)))
        self._left = True
        self._probe = None
        self._forwards.clear()
        self._count(out)
        return out

    def tick(self, now: float) -> Outgoing:
        """Advance the timers to ``now``: probes, ping-reqs, nacks, suspicions, rounds."""
        out: Outgoing = []
        if self._left:
            return out
        probe = self._probe
        if probe is not None and not probe.acked and probe.helpers is None and (
                now >= probe.indirect_at):
            probe.helpers = tuple(self._live_sample(self.config.indirect_checks,
                                                    exclude=probe.target))
            for helper in probe.helpers:
                out.append((helper, self._message(Kind.PING_REQ, probe.seq, helper,
                                                  probe.target)))
        if probe is not None and now >= probe.end_at:
            out.extend(self._finish_probe(now, probe))
        for seq, forward in list(self._forwards.items()):
            if not forward.nacked and now >= forward.nack_at:
                forward.nacked = True
                out.append((forward.requester, self._message(
                    Kind.NACK, forward.seq, forward.requester, "")))
            if now >= forward.expire_at:
                del self._forwards[seq]
        for member, suspicion in list(self._suspicions.items()):
            if now >= suspicion.deadline:
                known = self._lookup(member)
                self._set_state(member, known, State.DEAD, known.incarnation)
                self._broadcasts.queue(Update(member, State.DEAD, known.incarnation))
        if now >= self._next_round:
            out.extend(self._start_round(now))
        self._count(out)
        return out

    def receive(self, now: float, message: Message) -> Outgoing:
        """Take ``message``; raises InvalidArgumentError, ResourceExhaustedError or
        PermissionDeniedError (nothing of the message taken) when it is refused."""
        message.validate()
        out: Outgoing = []
        if self._left:
            return out
        sender = message.sender
        if sender == self.name:
            raise errors.InvalidArgumentError(
                f"SWIM member {self.name!r} got a message that says it is from itself")
        if self._state(sender) is None and not (self.config.allow_joins and any(
                u.member == sender and u.state == State.ALIVE for u in message.updates)):
            raise errors.PermissionDeniedError(
                f"SWIM member {self.name!r} does not know {sender!r}: a new member joins "
                "with its own alive update, where every member has Config.allow_joins")
        kind = message.kind
        if kind == Kind.PING and message.target != self.name:
            raise errors.InvalidArgumentError(
                f"SWIM ping for {message.target!r} reached {self.name!r}: its sender has "
                "an old address for it")
        if kind == Kind.PING_REQ:
            if message.target in (self.name, sender):
                raise errors.InvalidArgumentError(
                    f"SWIM ping-req from {sender!r} to {self.name!r} names "
                    f"{message.target!r}: it must name a third member")
            if len(self._forwards) >= MAX_FORWARDS:
                raise errors.ResourceExhaustedError(
                    f"SWIM member {self.name!r} already serves MAX_FORWARDS={MAX_FORWARDS} "
                    f"ping-reqs: {sender!r} should ask other members")
        for update in message.updates:
            self._apply(now, update, sender)
        self._heard.add(sender)
        if kind == Kind.PING:
            out.append((sender, self._message(Kind.ACK, message.seq, sender, "")))
        elif kind == Kind.PING_REQ:
            if self._state(message.target) is not None:
                seq = self._next_seq()
                window = self._scaled(self.config.probe_interval - self.config.probe_timeout)
                self._forwards[seq] = _Forward(sender, message.seq, message.target,
                                               now + 0.8 * window, now + window)
                out.append((message.target, self._message(Kind.PING, seq, message.target,
                                                          message.target)))
            else:
                self.stats.refused["ping-req for an unknown member"] += 1
        elif kind == Kind.ACK:
            probe = self._probe
            forward = self._forwards.get(message.seq)
            if probe is not None and message.seq == probe.seq and (
                    sender == probe.target or sender in (probe.helpers or ())):
                probe.acked = True
            elif forward is not None and sender == forward.target:
                del self._forwards[message.seq]
                out.append((forward.requester, self._message(
                    Kind.ACK, forward.seq, forward.requester, "")))
        elif kind == Kind.NACK:
            probe = self._probe
            if probe is not None and message.seq == probe.seq and (
                    sender in (probe.helpers or ())):
                probe.nackers.add(sender)
        self._count(out)
        return out

    # -- the protocol ---------------------------------------------------------------------

    def _start_round(self, now: float) -> Outgoing:
        out: Outgoing = []
        self._rounds += 1
        interval = self._scaled(self.config.probe_interval)
        self._next_round = now + interval
        target = self._next_target()
        if target is not None:
            seq = self._next_seq()
            self._probe = _Probe(target, seq,
                                 now + self._scaled(self.config.probe_timeout), now + interval)
            out.append((target, self._message(Kind.PING, seq, target, target)))
        every = self.config.dead_probe_rounds
        dead = [m for m, state in self._gone.items() if state == State.DEAD]
        if every and dead and self._rounds % every == 0:
            peer = self._rng.choice(dead)
            out.append((peer, self._message(Kind.PING, self._next_seq(), peer, peer)))
        return out

    def _next_target(self) -> str | None:
        for _ in range(len(self._order) + 1):
            if self._next >= len(self._order):
                self._rng.shuffle(self._order)
                self._next = 0
                if not self._order:
                    return None
            member = self._order[self._next]
            self._next += 1
            if self._state(member) in (State.ALIVE, State.SUSPECT):
                return member
        return None

    def _finish_probe(self, now: float, probe: _Probe) -> Outgoing:
        self._probe = None
        if probe.acked:
            self._awareness = max(0, self._awareness - 1)
            return []
        # Nacks that did not come point at this member's own slowness (Lifeguard).
        missed = len(probe.helpers) - len(probe.nackers) if probe.helpers else 1
        self._awareness = min(self.config.max_awareness - 1, self._awareness + missed)
        known = self._lookup(probe.target)
        if known is None or known.state not in (State.ALIVE, State.SUSPECT):
            return []
        # Of a member already suspect, this confirms the suspicion (Lifeguard).
        self._apply(now, Update(probe.target, State.SUSPECT, known.incarnation,
                                origin=self.name), self.name)
        # One more ping tells the suspect itself (it refutes in its ack if it is alive but
        # slow or its messages were lost) instead of waiting for the rumour to reach it.
        return [(probe.target, self._message(Kind.PING, self._next_seq(), probe.target,
                                             probe.target))]

    def _apply(self, now: float, update: Update, sender: str) -> None:
        member, state, incarnation = update.member, update.state, update.incarnation
        if member == self.name:
            self._about_self(update)
            return
        known = self._lookup(member)
        if known is None:
            self._join(update, sender)
            return
        if incarnation > known.incarnation + MAX_INCARNATION_STEP and sender != member:
            self.stats.refused["incarnation jump"] += 1
            return
        if update.address and update.address != known.address:
            self.stats.refused["address change"] += 1
            return
        if state == State.ALIVE:
            if incarnation > known.incarnation:
                self._set_state(member, known, State.ALIVE, incarnation)
                self._broadcasts.queue(Update(member, State.ALIVE, incarnation, known.address))
        elif state == State.SUSPECT:
            if known.state in (State.ALIVE, State.SUSPECT) and (
                    incarnation > known.incarnation or (
                        known.state == State.ALIVE and incarnation == known.incarnation)):
                # A suspicion of a newer incarnation starts afresh: the member refuted
                # the older one.
                self._set_state(member, known, State.SUSPECT, incarnation)
                live = self._size + 1 - len(self._gone)
                low, high = self.config.suspicion_bounds(live)
                expected = self.config.suspicion_mult - 2
                if live - 2 < expected:
                    expected = 0
                self._suspicions[member] = _Suspicion(now, low, high, expected,
                                                      update.origin or sender)
                self._broadcasts.queue(update)
            elif known.state == State.SUSPECT and incarnation == known.incarnation:
                suspicion = self._suspicions.get(member)
                if suspicion is not None and suspicion.confirm(update.origin or sender):
                    self._broadcasts.queue(update)
        elif state == State.DEAD:
            if known.state in (State.ALIVE, State.SUSPECT) and (
                    incarnation >= known.incarnation):
                self._set_state(member, known, State.DEAD, incarnation)
                self._broadcasts.queue(Update(member, State.DEAD, incarnation))
        elif known.state != State.LEFT and incarnation >= known.incarnation:
            self._set_state(member, known, State.LEFT, incarnation)
            self._broadcasts.queue(Update(member, State.LEFT, incarnation))

    def _about_self(self, update: Update) -> None:
        if update.state == State.ALIVE:
            if update.incarnation > self.incarnation:
                self.stats.refused["alive about the receiver"] += 1
            return
        if update.incarnation < self.incarnation:
            # A stale rumour: its holder missed the refutation, so it is sent again.
            self._broadcasts.queue(Update(self.name, State.ALIVE, self.incarnation,
                                          self.address))
            return
        if update.incarnation > self.incarnation + MAX_INCARNATION_STEP:
            self.stats.refused["incarnation jump"] += 1
            return
        if update.incarnation >= MAX_INCARNATION:
            self.stats.refused["incarnation at its maximum"] += 1
            return
        self.incarnation = update.incarnation + 1
        self._awareness = min(self.config.max_awareness - 1, self._awareness + 1)
        self._broadcasts.queue(Update(self.name, State.ALIVE, self.incarnation, self.address))

    def _join(self, update: Update, sender: str) -> None:
        if update.state != State.ALIVE:
            self.stats.refused["news of an unknown member"] += 1
        elif not self.config.allow_joins:
            self.stats.refused["join while joins are off"] += 1
        elif self._size + 1 >= self.config.max_members:
            self.stats.refused["join past max_members"] += 1
        elif update.incarnation > MAX_INCARNATION_STEP and sender != update.member:
            self.stats.refused["incarnation jump"] += 1
        else:
            known = _Member(update.address, State.ALIVE, update.incarnation)
            self._records[update.member] = known
            self._size += 1
            self._order.insert(self._rng.randint(self._next, len(self._order)), update.member)
            self._changes.append((update.member, State.ALIVE))
            self._broadcasts.queue(update)

    def _set_state(self, member: str, known: _Member, state: State, incarnation: int) -> None:
        if state != State.SUSPECT:
            self._suspicions.pop(member, None)
        if state in (State.DEAD, State.LEFT):
            self._gone[member] = state
        else:
            self._gone.pop(member, None)
        if known.state != state:
            self._changes.append((member, state))
        known.state, known.incarnation = state, incarnation

    # -- helpers --------------------------------------------------------------------------

    def _message(self, kind: Kind, seq: int, destination: str, target: str) -> Message:
        updates: list[Update] = []
        budget = self.config.piggyback_bytes
        known = self._records.get(destination)
        if known is not None and known.state != State.ALIVE:
            # Tell the destination what this member thinks of it, so it can refute.
            updates.append(Update(destination, known.state, known.incarnation))
        if self.config.allow_joins and destination not in self._heard:
            # A member that may not know this one yet refuses its messages without this.
            updates.append(Update(self.name, State.ALIVE, self.incarnation, self.address))
        budget -= sum(_encoded_size(update) for update in updates)
        if self._broadcasts:
            updates += self._broadcasts.take(
                budget, MAX_UPDATES - len(updates),
                self.config.retransmits(self._size + 1), skip=destination)
        return Message(kind, seq, self.name, target, tuple(updates))

    def _live_sample(self, count: int, exclude: str) -> list[str]:
        chosen: list[str] = []
        order = self._order
        for _ in range(4 * count + 4):
            if len(chosen) >= count or not order:
                break
            member = order[self._rng.randrange(len(order))]
            if member != exclude and member not in chosen and (
                    self._state(member) == State.ALIVE):
                chosen.append(member)
        return chosen

    def _state(self, member: str) -> State | None:
        known = self._records.get(member)
        if known is not None:
            return known.state
        return State.ALIVE if member in self._base and member != self.name else None

    def _lookup(self, member: str) -> _Member | None:
        """``member``'s record, made from ``peers`` when it is first needed."""
        known = self._records.get(member)
        if known is None and member in self._base and member != self.name:
            known = self._records[member] = _Member(self._base[member], State.ALIVE, 0)
        return known

    def _scaled(self, seconds: float) -> float:
        return seconds * (self._awareness + 1)

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) % MAX_INCARNATION
        return self._seq

    def _count(self, out: Iterable[tuple[str, Message]]) -> None:
        for _, message in out:
            self.stats.sent[message.kind.name] += 1
