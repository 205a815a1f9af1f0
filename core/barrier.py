"""Barriers of a job: rounds counted on the job's first task, or up a combining tree for a
job of more than ``FLAT_MAX_TASKS`` tasks; callers parked where they wait.

Flat (a job of at most ``FLAT_MAX_TASKS`` tasks). A caller waits on the task its request
reached (``Releases.wait``); that task reports the arrival to the coordinating task (the
job's lowest index), where ``Rounds.arrive`` counts it. A ``Session`` sends its arrival to
the coordinator itself when it can reach it, which saves that hop. The coordinator answers an
arrival in one of two ways:

* held: it answers when the round is released (one small call per task and round, the
  cheapest), parking the wait; at most ``MAX_HELD_ARRIVALS`` arrivals are held at once, so
  the coordinator's threads do not grow with the job;
* at once, beyond that: the arrival that completes the round gets back the tasks where such
  callers wait, and the coordinator sends each of them one release from threads of its own.

Every wait is parked (``clusterwire.thread_pool``), so it never takes a thread that work
needs; a task holds one parked wait per caller of its own.

Tree (a larger job; its shape is ``clusterwire.barrier_tree``). A caller's arrival is
counted on the task it arrives as (its request is forwarded there). Each task counts its
subtree's round in ``Subtrees``: its own arrival and one report per child. The arrival that
completes the subtree seals the round and reports it to the parent (``barrier_report``) and
waits for the answer, which the parent holds until its own round is released: the root
releases a round as soon as its subtree is complete, and each answer releases the round of
the task below, which answers its children in turn. A task thus handles at most
``barrier_tree.FAN_IN + 1`` arrivals per round and the release costs no call of its own.
A caller that gives up withdraws its arrival (a child's report is withdrawn when its held
answer times out) while its task's round is open; a sealed round keeps it. On a timeout
the caller asks the root which tasks are missing (``barrier_missing``): each task answers
for its subtree, asking the children whose report it lacks; a child that cannot be asked
counts as missing and its own children are asked in its place, so a dead task names
itself, not its subtree. Children are asked at once, the callers asking one task at once
share its answer, and each question waits what the asks below it may take
(``Tree.question_timeouts``), so a host cut off costs a few peer timeouts, not one a task.

Rounds are named by random ids, not counters: a coordinator that restarted cannot make a
new round look like one already released.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from dataclasses import dataclass, field

from clusterwire import errors
from clusterwire.thread_pool import parked

Task = tuple[str, int]
#: Arrivals a coordinator holds (answers once released, each a parked wait) at once; more
#: are answered at once and released by a call.
MAX_HELD_ARRIVALS = 64
#: Jobs of at most this many tasks use the flat protocol: every arrival held by the
#: coordinator, one hop from its client (cheaper than the tree's two hops at this size,
#: BENCHMARKS.md "Scale"); larger jobs the combining tree.
FLAT_MAX_TASKS = 64
#: Releases remembered per barrier name: a release may arrive before the answer to the
#: arrival it ends (the coordinator pushes it at once), so recent ones are kept.
_RECENT_RELEASES = 64


def _new_round_id() -> int:
    return secrets.randbits(63) + 1


@dataclass
class _Round:
    round_id: int = field(default_factory=_new_round_id)
    # Task index -> the event number of its arrival, or of its withdrawal (its caller gave
    # up): a caller that gives up counts as missing only the tasks that were not there
    # at any time since it arrived.
    arrived: dict[int, int] = field(default_factory=dict)
    withdrawn: dict[int, int] = field(default_factory=dict)
    waiters: set[Task] = field(default_factory=set)
    events: int = 0

    def event(self) -> int:
        self.events += 1
        return self.events


@dataclass
class Arrival:
    """What ``Rounds.arrive`` decided about one arrival."""

    round_id: int
    #: Set when the arrival completed the round: the tasks to send a release to (callers
    #: of those tasks were answered at once); the coordinator's held arrivals and its own
    #: callers are released locally.
    release: set[Task] | None = None
    held: bool = False  # answer when the round is released; call ``Rounds.unhold`` then


class Rounds:
    """The coordinator's view: the current round of each barrier of its job."""

    def __init__(self, max_held: int) -> None:
        self._lock = threading.Lock()
        self._rounds: dict[str, _Round] = {}
        self._max_held = max_held
        self._held = 0

    def arrive(self, name: str, index: int, expected: set[int], waiter: Task,
               hold: bool) -> Arrival:
        """Record task ``index``, whose caller waits on task ``waiter``; held if ``hold``
        and fewer than ``max_held`` arrivals are held."""
        with self._lock:
            current = self._rounds.setdefault(name, _Round())
            current.arrived.setdefault(index, current.event())
            current.withdrawn.pop(index, None)
            if current.arrived.keys() >= expected:
                self._rounds[name] = _Round()
                return Arrival(current.round_id, release=current.waiters)
            if hold and self._held < self._max_held:
                self._held += 1
                return Arrival(current.round_id, held=True)
            current.waiters.add(waiter)
            return Arrival(current.round_id)

    def reset(self) -> None:
        """Forget every round in progress (their waits were aborted)."""
        with self._lock:
            self._rounds.clear()

    def unhold(self) -> None:
        """A held arrival was answered."""
        with self._lock:
            self._held -= 1

    def withdraw(self, name: str, round_id: int, index: int,
                 expected: set[int]) -> list[int] | None:
        """Take task ``index`` out of round ``round_id`` (its caller gave up): the tasks
        that never arrived, or None if that round was released meanwhile."""
        with self._lock:
            current = self._rounds.get(name)
            if current is None or current.round_id != round_id:
                return None
            since = current.arrived.pop(index, 0)
            current.withdrawn[index] = current.event()
            return sorted(i for i in expected - current.arrived.keys()
                          if current.withdrawn.get(i, 0) < since)


@dataclass
class _Subtree:
    round_id: int = field(default_factory=_new_round_id)
    arrived: set[int] = field(default_factory=set)  # this task's index, its children's
    # Index -> when (time.monotonic) it withdrew: it was there until then.
    withdrawn: dict[int, float] = field(default_factory=dict)


class Subtrees:
    """A tree task's view: the open round of each barrier, counting its own arrival and
    its children's reports, and the round it sealed (reported upward) and awaits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, _Subtree] = {}
        self._sealed: dict[str, _Subtree] = {}

    def arrive(self, name: str, who: int, expected: frozenset[int]) -> tuple[int, bool]:
        """Count ``who`` (this task or a child) in the open round: its id, and whether this
        arrival completed it (then it is sealed: report it upward, or release it at the
        root; the next arrival opens a new round)."""
        with self._lock:
            current = self._open.setdefault(name, _Subtree())
            current.arrived.add(who)
            current.withdrawn.pop(who, None)
            if current.arrived < expected:
                return current.round_id, False
            del self._open[name]
            self._sealed[name] = current
            return current.round_id, True

    def settled(self, name: str, round_id: int, released: bool) -> None:
        """Sealed round ``round_id`` was released, or else its report withdrawn by the
        parent (its callers gave up): then its arrivals count as withdrawn now, in the open
        round, so callers that waited while they were there do not name them."""
        with self._lock:
            sealed = self._sealed.get(name)
            if sealed is None or sealed.round_id != round_id:
                return
            del self._sealed[name]
            if not released:
                current = self._open.setdefault(name, _Subtree())
                now = time.monotonic()
                for who in sealed.arrived - current.arrived:
                    current.withdrawn[who] = now

    def withdraw(self, name: str, round_id: int, who: int) -> None:
        """Take ``who`` out of round ``round_id`` (its caller or report gave up) unless that
        round was sealed meanwhile."""
        with self._lock:
            current = self._open.get(name)
            if current is not None and current.round_id == round_id and who in current.arrived:
                current.arrived.discard(who)
                current.withdrawn[who] = time.monotonic()

    def unreported(self, name: str, expected: frozenset[int], waited: float) -> list[int]:
        """Which of ``expected`` (this task and its children) a caller that has waited
        ``waited`` seconds misses: not arrived, and not there at any time since it arrived
        (withdrawn before); none while a sealed round awaits its release and no arrival of
        the next one came."""
        since = time.monotonic() - waited
        with self._lock:
            current = self._open.get(name)
            if name in self._sealed and (current is None or not current.arrived):
                return []  # reported upward, awaiting the release
            if current is None:
                return sorted(expected)
            return sorted(i for i in expected - current.arrived
                          if current.withdrawn.get(i, since) <= since)

    def reset(self) -> None:
        """Forget every round (their waits were aborted)."""
        with self._lock:
            self._open.clear()
            self._sealed.clear()


class Releases:
    """The released rounds this task's waiting callers look for."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._released: dict[str, collections.deque[int]] = {}
        self._cancelled = False
        self._aborts = 0  # waits begun before the latest abort end with it
        self._abort_reason = ""

    def release(self, name: str, round_id: int) -> None:
        """Round ``round_id`` of barrier ``name`` is complete: wake its callers."""
        with self._changed:
            recent = self._released.setdefault(name, collections.deque(maxlen=_RECENT_RELEASES))
            if round_id not in recent:
                recent.append(round_id)
            self._changed.notify_all()

    def wait(self, name: str, round_id: int, timeout: float) -> bool:
        """True once round ``round_id`` is released; False after ``timeout`` seconds;
        CancelledError if the server stops first."""
        def released() -> bool:
            return round_id in self._released.get(name, ())

        with self._changed, parked():
            aborts = self._aborts
            self._changed.wait_for(
                lambda: released() or self._cancelled or self._aborts != aborts, timeout)
            if released():
                return True  # answered even if the server began stopping meanwhile
            if self._cancelled:
                raise errors.CancelledError(f"Barrier {name!r} cancelled: the server is stopping.")
            if self._aborts != aborts:
                raise errors.AbortedError(f"Barrier {name!r} was aborted: {self._abort_reason}")
            return False

    def abort(self, reason: str) -> None:
        """Wake every waiter with AbortedError naming ``reason``."""
        with self._changed:
            self._aborts += 1
            self._abort_reason = reason
            self._changed.notify_all()

    def cancel(self) -> None:
        """Wake every waiter with CancelledError (the server is stopping)."""
        with self._changed:
            self._cancelled = True
            self._changed.notify_all()
