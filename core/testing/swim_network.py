"""A discrete-event network for ``clusterwire.swim`` state machines (virtual time, no sleeps).

``SimNetwork(n, config=..., seed=...)`` runs n ``Swim`` members named ``m0`` ... ``m{n-1}``
on one event queue: each message takes a latency drawn from ``latency`` and is lost with
probability ``loss``; a killed member neither sends nor takes anything; a partition drops
messages between its groups; a *loaded* member (``load(name, lag)``) handles each of its
events (a message, a timer) up to ``lag`` seconds late, in order, as a process starved of
CPU does. The tests (tests/test_swim.py) and the simulation bench (bench/sim_swim.py) drive
the protocol's own code through it, so their numbers are the module's behaviour, not a
model of it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable

from clusterwire import errors
from clusterwire.swim import Config, Message, State, Swim

_TICK, _DELIVER = 0, 1


class SimNetwork:
    """``count`` SWIM members on a simulated network; times are virtual seconds."""

    def __init__(self, count: int, *, config: Config | None = None, seed: int = 0,
                 latency: tuple[float, float] = (0.0005, 0.002), loss: float = 0.0):
        self.config = config or Config(max_members=max(count + 16, 2))
        self.now = 0.0
        self.loss = loss
        self.latency = latency
        self._rng = random.Random(seed)
        names = [f"m{i}" for i in range(count)]
        addresses = {name: f"sim:{name}" for name in names}
        self.nodes: dict[str, Swim] = {}
        for name in names:  # one shared map of the members: a member's memory is O(n)
            self.nodes[name] = Swim(name, addresses[name], addresses, now=0.0,
                                    config=self.config,
                                    rng=random.Random(self._rng.getrandbits(64)))
        self.killed: set[str] = set()
        self.sent: Counter = Counter()  # messages sent, by member
        self.sent_kinds: Counter = Counter()
        self.lost = 0
        self.refused: Counter = Counter()  # errors raised by receive, by class
        #: When each observer first saw each watched member in each state.
        self.seen: dict[tuple[str, State], dict[str, float]] = {}
        self.false_suspects = 0  # a live member suspected, by one observer
        self.false_dead = 0  # a live member held dead, by one observer
        self._watched: set[str] = set()
        self._groups: dict[str, int] = {}
        self._lags: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._queue: list = []
        self._order = 0
        self._wake: dict[str, float] = {}
        for name, node in self.nodes.items():
            self._schedule(name, node.next_wakeup())

    # -- what happens to the cluster --------------------------------------------------------

    def watch(self, *members: str) -> None:
        """Record when each observer first sees ``members`` in each state (``seen``)."""
        self._watched.update(members)

    def kill(self, name: str) -> None:
        """Stop ``name`` dead: it sends and takes nothing from now on."""
        self.killed.add(name)

    def load(self, name: str, lag: float) -> None:
        """Make ``name`` handle each event up to ``lag`` seconds late (0: not loaded)."""
        self._lags[name] = lag

    def partition(self, *groups: Iterable[str]) -> None:
        """Drop every message between members of different ``groups``."""
        self._groups = {name: index for index, group in enumerate(groups) for name in group}

    def heal(self) -> None:
        """End the partition."""
        self._groups = {}

    def add(self, name: str, *, seed: int = 0) -> Swim:
        """Start a new member ``name`` that knows every member started so far and joins."""
        peers = {peer: node.address for peer, node in self.nodes.items()}
        node = Swim(name, f"sim:{name}", peers, now=self.now, config=self.config,
                    rng=random.Random(seed))
        node.join()
        self.nodes[name] = node
        self._schedule(name, node.next_wakeup())
        return node

    def inject(self, name: str, outgoing: list[tuple[str, Message]]) -> None:
        """Send what a call on ``name``'s machine returned (``leave``)."""
        self._send(name, outgoing)

    # -- running ----------------------------------------------------------------------------

    def run_until(self, end: float, *, until: Callable[[], bool] | None = None,
                  check_every: float = 0.1) -> bool:
        """Run events up to virtual time ``end``; with ``until``, stop as soon as it holds
        (checked every ``check_every`` virtual seconds). Returns whether ``until`` held."""
        next_check = self.now
        while self._queue and self._queue[0][0] <= end:
            if until is not None and self._queue[0][0] >= next_check:
                self.now = max(self.now, next_check)
                if until():
                    return True
                next_check += check_every
            at, _, kind, name, payload = heapq.heappop(self._queue)
            self.now = at
            if name in self.killed:
                continue
            node = self.nodes[name]
            if kind == _TICK:
                if self._wake.get(name) != at:
                    continue  # superseded by an earlier wakeup
                del self._wake[name]
                out = node.tick(at)
            else:
                try:
                    out = node.receive(at, payload)
                except errors.OpError as error:
                    self.refused[type(error).__name__] += 1
                    out = []
            self._record(name, node)
            self._send(name, out)
            self._schedule(name, node.next_wakeup())
        self.now = max(self.now, end)
        return until() if until is not None else False

    def everyone(self, member: str, state: State) -> bool:
        """Whether every live member other than ``member`` holds it in ``state``."""
        return all(node.state(member) == state for name, node in self.nodes.items()
                   if name != member and name not in self.killed)

    # -- internals --------------------------------------------------------------------------

    def _send(self, sender: str, out: list[tuple[str, Message]]) -> None:
        for destination, message in out:
            self.sent[sender] += 1
            self.sent_kinds[message.kind.name] += 1
            if (destination in self.killed or self._rng.random() < self.loss
                    or self._groups.get(sender) != self._groups.get(destination)):
                self.lost += 1
                continue
            at = self.now + self._rng.uniform(*self.latency)
            self._push(self._delay(destination, at, in_order=True), _DELIVER, destination,
                       message)

    def _schedule(self, name: str, at: float) -> None:
        if at == math.inf or name in self.killed:
            return
        at = max(at, self.now)
        current = self._wake.get(name)
        if current is not None and current <= at:
            return
        at = self._delay(name, at)
        self._wake[name] = at
        self._push(at, _TICK, name, None)

    def _delay(self, name: str, at: float, *, in_order: bool = False) -> float:
        """When a loaded ``name`` handles an event due at ``at``: messages in the order
        they arrive, timers each late by itself."""
        lag = self._lags.get(name)
        if not lag:
            return at
        at += self._rng.uniform(0, lag)
        if in_order:
            at = max(at, self._last.get(name, 0.0))
            self._last[name] = at
        return at

    def _push(self, at: float, kind: int, name: str, payload: Message | None) -> None:
        self._order += 1
        heapq.heappush(self._queue, (at, self._order, kind, name, payload))

    def _record(self, observer: str, node: Swim) -> None:
        for member, state in node.take_changes():
            alive = member not in self.killed and member in self.nodes and (
                self.nodes[member].state(member) == State.ALIVE)
            if alive and state == State.SUSPECT:
                self.false_suspects += 1
            elif alive and state == State.DEAD:
                self.false_dead += 1
            if member in self._watched:
                self.seen.setdefault((member, state), {}).setdefault(observer, self.now)
