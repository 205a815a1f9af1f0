"""Membership that changes while a job runs: versioned views, heartbeats, tasks down.

Every task holds a ``View``: the cluster and a version (0: the cluster it started with). A
change enters at any task (``Server.update_cluster``, or its resolver watch) as the next
version, and spreads by push-pull: the task sends its view to every peer at once, every
heartbeat carries the sender's view, and every answer the receiver's. A task adopts a view
that is newer: a higher version, or the same version with the greater digest of its cluster
(two tasks that change at once agree on one of the two changes). There is no coordinator
whose loss stops changes: any task takes a change, any live task spreads it.

What a task adopts is bounded, so that no token holder can wedge the membership: a
version at most ``MAX_VERSION``, and at most ``MAX_VERSION_STEP`` ahead of the task's own
unless it answers the task's own heartbeat (a task that was away catches up from its
peers); at most ``MAX_TASKS`` tasks, at most ``MAX_TASKS_CHANGED`` of them joined or moved
in one change; joins and removals only with ``allow_membership_changes``. A task that joins
or moves is adopted only once its address answers as that task (``identify``: the answer
carries an HMAC, keyed by the cluster token, of a fresh challenge, the task and the
address), so a change cannot point a task's traffic at another listener.

Heartbeats are opt-in (``membership_heartbeat_seconds``). With them, a task sends one small
request to each peer every interval (O(n) requests a task per interval, O(n^2) in the job;
each is answered at once and holds no thread), and a peer not heard from (no request or
answer) within ``membership_timeout_seconds`` is down in ``status()``. A peer whose last
``FAILS_BEFORE_BACKOFF`` heartbeats failed has its channel closed and is heartbeated less
and less often (at most every ``MAX_BACKOFF_INTERVALS`` intervals); peers heard recently
have senders of their own, so dead addresses never hold up the heartbeats of live peers.
A task restarted on a new address is reached there once a view with that address spreads.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.cluster_spec import ClusterSpec, with_address

Task = tuple[str, int]
_LOG = logging.getLogger("clusterwire")
#: Heartbeats a task sends at once to peers heard recently, and to the others.
_SENDERS = 16
_OTHER_SENDERS = 8
#: Addresses a task probes at once when a change joins or moves tasks.
_PROBES = 16
#: The highest version a view may have (a pin at 2^64-1 would leave no next version).
MAX_VERSION = 2**63 - 1
#: How far ahead of a task's own version a view it did not ask for may be.
MAX_VERSION_STEP = 1024
#: The most tasks a view may have, and joined or moved in one change.
MAX_TASKS = 4096
MAX_TASKS_CHANGED = 256
#: Failed heartbeats after which a peer's channel is closed and it is backed off.
FAILS_BEFORE_BACKOFF = 3
#: A backed-off peer is heartbeated at least every this many intervals.
MAX_BACKOFF_INTERVALS = 32
#: A probe's deadline (an address where nothing listens fails at once), and how long an
#: address that did not answer as its task is not probed again.
PROBE_SECONDS = 5.0
REFUSED_SECONDS = 5.0
#: Errors with which a peer refuses a view: it is alive.
_REFUSALS = (errors.InvalidArgumentError, errors.PermissionDeniedError,
             errors.ResourceExhaustedError, errors.FailedPreconditionError)
#: How an operator enables membership changes (what a refusal says).
CHANGES_FIX = ("start every task with allow_membership_changes (server config) or "
               "`clusterwire serve --allow-membership-changes`")


def digest(cluster: ClusterSpec) -> bytes:
    """A digest of ``cluster`` that equal clusters share (tasks and addresses)."""
    text = repr(sorted((job, index, address)
                       for (job, index), address in cluster.task_addresses().items()))
    return hashlib.sha256(text.encode()).digest()


def identity_proof(token: bytes | None, nonce: bytes, task: Task, address: str) -> bytes:
    """What a task answers to the challenge ``nonce`` at ``address``: an HMAC keyed by the
    cluster token (empty without a token: the answer's task alone is checked)."""
    if token is None:
        return b""
    message = b"clusterwire-identity\0" + nonce + f"\0{task[0]}\0{task[1]}\0{address}".encode()
    return hmac.new(token, message, hashlib.sha256).digest()


def check_identity(token: bytes | None, nonce: bytes, task: Task, address: str,
                   answer: Mapping[str, Any]) -> None:
    """FailedPreconditionError unless ``answer`` (to ``identify`` with ``nonce``) is
    ``task``'s at ``address``, with a proof made with the cluster token."""
    if not isinstance(answer, Mapping):
        answer = {}
    said = (answer.get("job"), answer.get("index"), answer.get("address"))
    proof = answer.get("proof")
    if said != (*task, address) or not isinstance(proof, bytes) or not hmac.compare_digest(
            proof, identity_proof(token, nonce, task, address)):
        raise errors.FailedPreconditionError(
            f"{address} does not answer as /job:{task[0]}/task:{task[1]} (it says "
            f"/job:{said[0]}/task:{said[1]} at {said[2]}"
            + (", without a valid proof of the cluster token" if token is not None else "")
            + "): a task's address changes only to where that task serves.")


@dataclass(frozen=True)
class View:
    """A version of the cluster."""

    version: int
    cluster: ClusterSpec
    digest: bytes = field(default=b"", compare=False)

    @classmethod
    def of(cls, version: int, cluster: ClusterSpec) -> View:
        """The view ``version`` of ``cluster``."""
        return cls(version, cluster, digest(cluster))

    def newer_than(self, other: View) -> bool:
        """Whether this view replaces ``other``: a higher version, or the greater digest."""
        return (self.version, self.digest) > (other.version, other.digest)

    def tasks(self) -> dict[Task, str]:
        """Every task of the view and its address."""
        return self.cluster.task_addresses()


@dataclass(frozen=True)
class PeerLink:
    """How a task reaches its peers: ``send(address, view, timeout)`` heartbeats a view and
    returns the receiver's; ``identify(task, address, timeout)`` raises an OpError unless
    ``address`` answers as ``task``; ``forget(address)`` closes the channel to it."""

    send: Callable[[str, View, float], View]
    identify: Callable[[Task, str, float], None]
    forget: Callable[[str], None]


@dataclass
class _Lane:
    """Received views waiting for their probes: the newest, its thread, its probers."""

    solicited: bool
    pending: View | None = None
    verifier: threading.Thread | None = None
    prober: ThreadPoolExecutor | None = None


def _completes(old: str | None, new: str) -> bool:
    """Whether ``new`` is the bound port of ``old``, an address with port 0."""
    if old is None:
        return False
    host, port = split_host_port(old)
    return port == 0 and split_host_port(new)[0] == host


class Membership:
    """One task's view of the cluster, kept in step with its peers'."""

    def __init__(self, me: Task, cluster: ClusterSpec,
                 on_change: Callable[[View, View], None],
                 link: PeerLink | None = None, heartbeat_seconds: float = 0.0,
                 timeout_seconds: float = 0.0, allow_changes: bool = False):
        """``on_change(old, new)`` runs (under no lock of this object) for every adopted
        view. After ``start()``, with ``heartbeat_seconds`` > 0, the peers are heartbeated
        through ``link`` that often and a peer unheard for ``timeout_seconds`` (default: 3
        intervals) is down. ``allow_changes``: views that join or remove tasks are adopted
        (else refused with PermissionDeniedError)."""
        if heartbeat_seconds < 0 or timeout_seconds < 0:
            raise errors.InvalidArgumentError(
                f"membership_heartbeat_seconds ({heartbeat_seconds}) and "
                f"membership_timeout_seconds ({timeout_seconds}) must be >= 0.")
        self.me = me
        self._view = View.of(0, cluster)
        self._on_change = on_change
        self._link = link
        self.allow_changes = allow_changes
        self.heartbeat_seconds = heartbeat_seconds
        self.timeout_seconds = timeout_seconds or 3 * heartbeat_seconds
        self._lock = threading.Lock()
        self._changes = threading.Lock()  # on_change calls run one at a time, in order
        self._heard: dict[Task, tuple[float, float]] = {}  # task -> (monotonic, time.time())
        self._since = time.monotonic()  # a task never heard from counts from here
        self._entered: dict[Task, float] = {}  # or from when a view brought it in
        self._in_flight: dict[Task, bool] = {}  # peer heartbeated now -> in the live lane
        self._failures: dict[Task, int] = {}  # peer -> heartbeats failed in a row
        self._retry_at: dict[Task, float] = {}  # backed-off peer -> next heartbeat (monotonic)
        self._warned: dict[Task, str] = {}  # peer -> the refusal last logged
        self._refused: dict[tuple[Task, str], float] = {}  # did not answer as its task, when
        # Received views waiting for their probes: answers to this task's heartbeats (from
        # addresses it chose) in one lane, whatever anyone sent in the other, so views
        # others send cannot hold up the task's peers' changes.
        self._lanes = {solicited: _Lane(solicited) for solicited in (True, False)}
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        if heartbeat_seconds > 0 and link is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True,
                                            name="clusterwire-membership")

    def begin(self, cluster: ClusterSpec) -> None:
        """Begin at version 0 of ``cluster``: the one this task started with, its own
        address bound."""
        with self._lock:
            self._view = View.of(0, cluster)

    def start(self) -> None:
        """Start heartbeating (if configured; idempotent)."""
        with self._lock:
            if self._thread is None or self._thread.ident is not None:
                return
            self._since = time.monotonic()
            self._thread.start()

    @property
    def view(self) -> View:
        """The current view."""
        return self._view

    def update(self, cluster: ClusterSpec) -> View:
        """A change made here: ``cluster`` (which has this task: the caller checks) as the
        next version, unless it is the current cluster; spread to the peers at once. Tasks
        it joins or moves must answer as themselves first (FailedPreconditionError naming
        the first that does not); bounded as the module says (InvalidArgumentError)."""
        with self._lock:
            current = self._view
            if digest(cluster) == current.digest:
                return current
        view = View.of(current.version + 1, cluster)
        self._check(view, current, solicited=False, allow_changes=True)
        self._confirm(self._unconfirmed(view), self._lanes[False])
        return self._adopt(view)

    def receive(self, view: View, sender: Task | None, solicited: bool = False) -> View:
        """A peer's view (a heartbeat, or with ``solicited`` the answer to this task's
        own): adopt it if newer and within the bounds (else InvalidArgumentError,
        PermissionDeniedError); the sender was heard from. Returns this task's view after.

        A view that joins or moves tasks is adopted once their addresses answer as them
        (probed in the background; this returns the current view meanwhile). A newer view
        with another address for this task (it restarted elsewhere, or the view was made
        before its port was bound) is adopted with this task's own address, as the next
        version, so the peers learn where it is. A view without this task is not
        adopted."""
        if sender is not None and sender in self._view.tasks():
            with self._lock:
                self._heard[sender] = (time.monotonic(), time.time())
                self._failures.pop(sender, None)  # it is alive: heartbeat it again
                self._retry_at.pop(sender, None)
        current = self._view
        # A view without this task was made before it joined (or after it left): this
        # task keeps its own, which has it.
        if not view.newer_than(current) or self.me not in view.tasks():
            return current
        self._check(view, current, solicited, self.allow_changes)
        if self._unconfirmed(view):
            self._verify_later(view, self._lanes[solicited])
            return self._view
        return self._adopt_received(view)

    def _check(self, view: View, current: View, solicited: bool, allow_changes: bool) -> None:
        """Refuse ``view`` unless within the bounds of the module's docstring."""
        if not 0 <= view.version <= MAX_VERSION:
            raise errors.InvalidArgumentError(
                f"Membership version {view.version} is out of range: versions are 0 to "
                f"{MAX_VERSION}.")
        if not solicited and view.version > current.version + MAX_VERSION_STEP:
            raise errors.InvalidArgumentError(
                f"Membership version {view.version} is more than {MAX_VERSION_STEP} ahead of "
                f"this task's version {current.version}: refused (versions advance one a "
                "change).")
        tasks, own = view.tasks(), current.tasks()
        if len(tasks) > MAX_TASKS:
            raise errors.InvalidArgumentError(
                f"A membership of {len(tasks)} tasks is over the {MAX_TASKS} a cluster may have.")
        joined = [task for task in tasks if task not in own]
        changed = len(joined) + sum(1 for task, address in tasks.items()
                                    if own.get(task, address) != address
                                    and not _completes(own[task], address))
        if not solicited and changed > MAX_TASKS_CHANGED:
            raise errors.InvalidArgumentError(
                f"A membership change that joins or moves {changed} tasks is over the "
                f"{MAX_TASKS_CHANGED} one change may; make it in steps.")
        left = [task for task in own if task not in tasks]
        if not allow_changes and (joined or left):
            names = ", ".join(f"/job:{j}/task:{i}" for j, i in sorted(joined + left)[:4])
            raise errors.PermissionDeniedError(
                f"A membership change that joins or removes tasks ({names}) is refused: this "
                f"task takes such changes only with allow_membership_changes; {CHANGES_FIX}.")

    def _unconfirmed(self, view: View) -> list[tuple[Task, str]]:
        """The tasks ``view`` joins or moves (but this task, and ports being bound)."""
        own = self._view.tasks()
        return [(task, address) for task, address in view.tasks().items()
                if task != self.me and own.get(task) != address
                and not _completes(own.get(task), address)]

    def _confirm(self, pairs: list[tuple[Task, str]], lane: _Lane) -> None:
        """Probe that every address answers as its task (with ``lane``'s probers); raise
        the first failure."""
        if not pairs:
            return
        if self._link is None:
            raise errors.FailedPreconditionError(
                "This task cannot probe its peers: it cannot join or move tasks.")
        now = time.monotonic()
        with self._lock:
            for pair in pairs:
                if now - self._refused.get(pair, -REFUSED_SECONDS) < REFUSED_SECONDS:
                    raise errors.FailedPreconditionError(
                        f"/job:{pair[0][0]}/task:{pair[0][1]} did not answer at {pair[1]} "
                        f"{now - self._refused[pair]:.1f} s ago; start it there first.")
        with self._lock:
            if self._stopped.is_set():
                raise errors.CancelledError("This task is stopping: it probes no peer.")
            if lane.prober is None:
                lane.prober = ThreadPoolExecutor(
                    _PROBES, thread_name_prefix="clusterwire-membership-probe")
            prober = lane.prober
        try:
            probes = [prober.submit(self._probe, task, address) for task, address in pairs]
        except RuntimeError:  # shut down by stop()
            raise errors.CancelledError("This task is stopping: it probes no peer.") from None
        try:
            wait_futures(probes, return_when=FIRST_EXCEPTION)
            for probe in probes:
                if probe.done() and probe.exception() is not None:
                    raise probe.exception()
        finally:
            for probe in probes:
                probe.cancel()  # those not started yet

    def _probe(self, task: Task, address: str) -> None:
        try:
            self._link.identify(task, address, PROBE_SECONDS)
        except errors.OpError as err:
            self._link.forget(address)
            with self._lock:
                self._refused[(task, address)] = time.monotonic()
                while len(self._refused) > MAX_TASKS:
                    del self._refused[next(iter(self._refused))]
            raise errors.FailedPreconditionError(
                f"/job:{task[0]}/task:{task[1]} does not answer at {address}: {err.message}; "
                "a task joins or moves only once it serves there.") from None

    def _verify_later(self, view: View, lane: _Lane) -> None:
        """Probe ``view``'s joined and moved tasks in the background (one view of a lane
        at a time, the newest waiting), then adopt it."""
        with self._lock:
            if lane.pending is not None and not view.newer_than(lane.pending):
                return
            lane.pending = view
            if lane.verifier is None:
                lane.verifier = threading.Thread(target=self._verify, args=(lane,),
                                                 daemon=True,
                                                 name="clusterwire-membership-verify")
                lane.verifier.start()

    def _verify(self, lane: _Lane) -> None:
        while True:
            with self._lock:
                view, lane.pending = lane.pending, None
                if view is None or self._stopped.is_set():
                    lane.verifier = None
                    return
            try:
                self._confirm(self._unconfirmed(view), lane)
                self._adopt_received(view)
            except errors.OpError as err:  # said once a peer's own answer fails
                _LOG.log(logging.WARNING if lane.solicited else logging.DEBUG,
                         "clusterwire: /job:%s/task:%d: membership version %d not adopted: "
                         "%s", *self.me, view.version, err.message)

    def _adopt_received(self, view: View) -> View:
        own = self._view.tasks().get(self.me)
        theirs = view.tasks().get(self.me)
        if theirs is not None and own is not None and theirs != own:
            return self._adopt(View.of(view.version + 1, with_address(view.cluster, *self.me,
                                                                     own)))
        return self._adopt(view)

    def _adopt(self, view: View) -> View:
        with self._changes:
            with self._lock:
                old = self._view
                if not view.newer_than(old):
                    return old
                self._view = view
                now, known, tasks = time.monotonic(), old.tasks(), view.tasks()
                self._entered.update((task, now) for task in tasks if task not in known)
                for table in (self._heard, self._entered, self._failures, self._retry_at,
                              self._warned):
                    for task in [task for task in table if task not in tasks]:
                        del table[task]
            self._on_change(old, view)
        if self._link is not None:
            for address in set(known.values()) - set(tasks.values()):
                self._link.forget(address)
        self._wake.set()  # spread it now
        return view

    def peers(self) -> list[tuple[Task, str, float, bool]]:
        """With heartbeats, every other task of the view: (task, address, last heard as
        ``time.time()`` or 0, down); without, nothing."""
        if self._thread is None:
            return []
        now = time.monotonic()
        with self._lock:
            heard = dict(self._heard)
        rows = []
        for task, address in sorted(self._view.tasks().items()):
            if task == self.me:
                continue
            seen, wall = heard.get(task, (max(self._since, self._entered.get(task, 0.0)),
                                          0.0))
            rows.append((task, address, wall, now - seen > self.timeout_seconds))
        return rows

    def stop(self) -> None:
        """Stop heartbeating and probing."""
        self._stopped.set()
        self._wake.set()
        with self._lock:
            probers = [lane.prober for lane in self._lanes.values()]
        for prober in probers:
            if prober is not None:
                prober.shutdown(wait=False, cancel_futures=True)
        thread = self._thread
        # Not started: the server stops because it could not start (its port was taken).
        started = thread is not None and thread.ident is not None
        if started and thread is not threading.current_thread():
            thread.join(5)

    def _beat(self) -> None:
        lanes = {True: _SENDERS, False: _OTHER_SENDERS}
        with ThreadPoolExecutor(sum(lanes.values()),
                                thread_name_prefix="clusterwire-heartbeat") as senders:
            while not self._stopped.is_set():
                self._wake.clear()
                view = self._view
                for task, address in self._due(view, lanes):
                    senders.submit(self._beat_one, task, address, view)
                self._wake.wait(self.heartbeat_seconds)

    def _due(self, view: View, lanes: dict[bool, int]) -> list[tuple[Task, str]]:
        """The peers to heartbeat now, each in its lane: peers heard within the timeout
        have senders of their own; the others (never heard, or failing: fewest failures
        first) share the rest. A lane takes only as many as it has idle senders, so a peer
        that does not answer never queues ahead of one that does."""
        now = time.monotonic()
        with self._lock:
            due = sorted(((self._failures.get(task, 0), task, address)
                          for task, address in view.tasks().items()
                          if task != self.me and task not in self._in_flight
                          and self._retry_at.get(task, 0.0) <= now))
            idle = dict(lanes)
            for lane in self._in_flight.values():
                idle[lane] -= 1
            chosen = []
            for _, task, address in due:
                live = now - self._heard.get(task, (-1e9, 0.0))[0] <= self.timeout_seconds
                if idle[live] > 0:
                    idle[live] -= 1
                    self._in_flight[task] = live
                    chosen.append((task, address))
        return chosen

    def _beat_one(self, task: Task, address: str, view: View) -> None:
        try:
            if self._stopped.is_set():
                return
            answer = self._link.send(address, view, self.heartbeat_seconds)
            self.receive(answer, task, solicited=True)
        except _REFUSALS as err:  # it answered, or its view is refused here
            self._note_refusal(task, err.message)
        except errors.OpError:
            self._failed(task, address)  # unheard: down once the timeout passes
        except Exception:  # a heartbeat must not end the loop
            _LOG.exception("clusterwire: heartbeat to /job:%s/task:%d failed", *task)
        finally:
            with self._lock:
                self._in_flight.pop(task, None)

    def _failed(self, task: Task, address: str) -> None:
        with self._lock:
            if task not in self._view.tasks():
                return
            fails = self._failures[task] = self._failures.get(task, 0) + 1
            if fails < FAILS_BEFORE_BACKOFF:
                return
            intervals = min(2 ** (fails - FAILS_BEFORE_BACKOFF + 1), MAX_BACKOFF_INTERVALS)
            self._retry_at[task] = time.monotonic() + intervals * self.heartbeat_seconds
        self._link.forget(address)

    def _note_refusal(self, task: Task, message: str) -> None:
        with self._lock:
            if task not in self._view.tasks() or self._warned.get(task) == message:
                return
            self._warned[task] = message
        _LOG.warning("clusterwire: /job:%s/task:%d: membership heartbeat with "
                     "/job:%s/task:%d refused: %s", *self.me, *task, message)


#: How often a resolver watch waiting on its resolver's wait_for_change checks for stop().
_STOP_SLICE_SECONDS = 0.2


class ResolverWatch:
    """Polls a cluster resolver and makes each change of its cluster a new membership
    version of a server (``Server.from_resolver(..., watch=seconds)``)."""

    def __init__(self, resolver: Any, interval: float, server: Any):
        self._resolver, self._interval, self._server = resolver, interval, server
        self._last = digest(resolver.cluster_spec())
        self._failing = ""
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True,
                                        name="clusterwire-resolver-watch")
        self._thread.start()

    def _wait(self) -> bool:
        """Wait until the next poll; True once stopped. A resolver with
        ``wait_for_change(timeout)`` (one that watches its manager, as clusterwire-etcd's
        does) ends the wait as soon as the cluster changes."""
        wait_for_change = getattr(self._resolver, "wait_for_change", None)
        if wait_for_change is None:
            return self._stopped.wait(self._interval)
        deadline = time.monotonic() + self._interval
        # In slices, so that stop() does not wait for the resolver's wait to end.
        while not self._stopped.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or wait_for_change(min(left, _STOP_SLICE_SECONDS)):
                return False
        return True

    def _poll(self) -> None:
        while not self._wait():
            try:
                cluster = self._resolver.cluster_spec()
                now = digest(cluster)
                if now != self._last:
                    self._server.update_cluster(cluster)
                    self._last = now
                self._failing = ""
            except Exception as err:  # a resolver's outage must not end the watch
                if str(err) != self._failing:  # say each new failure once
                    _LOG.warning("clusterwire: resolver %s failed (%s); keeping membership "
                                 "version %d and retrying.", type(self._resolver).__name__,
                                 err, self._server.membership_version)
                self._failing = str(err)

    def stop(self) -> None:
        """Stop polling."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)

