"""Membership that changes while a job runs: versioned views, heartbeats, tasks down.

Every task holds a ``View``: the cluster and a version (0: the cluster it started with). A
change enters at any task (``Server.update_cluster``, or its resolver watch) as the next
version, and spreads by push-pull: the task sends its view to every peer at once, every
heartbeat carries the sender's view, and every answer the receiver's. A task adopts a view
that is newer: a higher version, or the same version with the greater digest of its cluster
(two tasks that change at once agree on one of the two changes). There is no coordinator
whose loss stops changes: any task takes a change, any live task spreads it.

Heartbeats are opt-in (``membership_heartbeat_seconds``). With them, a task sends one small
request to each peer every interval (O(n) requests a task per interval, O(n^2) in the job;
each is answered at once and holds no thread), and a peer not heard from (no request or
answer) within ``membership_timeout_seconds`` is down in ``status()``. A task restarted on a
new address is reached there once a view with that address spreads.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from clusterwire import errors
from clusterwire.cluster_spec import ClusterSpec, with_address
from clusterwire.security import security_fields

Task = tuple[str, int]
_LOG = logging.getLogger("clusterwire")
#: Heartbeats a task sends at once.
_SENDERS = 16


def digest(cluster: ClusterSpec) -> bytes:
    """A digest of ``cluster`` that equal clusters share (tasks and addresses)."""
    text = repr(sorted((job, index, address)
                       for (job, index), address in cluster.task_addresses().items()))
    return hashlib.sha256(text.encode()).digest()


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


#: Sends a heartbeat carrying a view to a task's address; returns the receiver's view.
SendHeartbeat = Callable[[str, View, float], View]


class Membership:
    """One task's view of the cluster, kept in step with its peers'."""

    def __init__(self, me: Task, cluster: ClusterSpec,
                 on_change: Callable[[View, View], None],
                 send: SendHeartbeat | None = None, heartbeat_seconds: float = 0.0,
                 timeout_seconds: float = 0.0):
        """``on_change(old, new)`` runs (under no lock of this object) for every adopted
        view. After ``start()``, with ``heartbeat_seconds`` > 0, ``send`` heartbeats the
        peers that often and a peer unheard for ``timeout_seconds`` (default: 3 intervals)
        is down."""
        if heartbeat_seconds < 0 or timeout_seconds < 0:
            raise errors.InvalidArgumentError(
                f"membership_heartbeat_seconds ({heartbeat_seconds}) and "
                f"membership_timeout_seconds ({timeout_seconds}) must be >= 0.")
        self.me = me
        self._view = View.of(0, cluster)
        self._on_change = on_change
        self._send = send
        self.heartbeat_seconds = heartbeat_seconds
        self.timeout_seconds = timeout_seconds or 3 * heartbeat_seconds
        self._lock = threading.Lock()
        self._changes = threading.Lock()  # on_change calls run one at a time, in order
        self._heard: dict[Task, tuple[float, float]] = {}  # task -> (monotonic, time.time())
        self._since = time.monotonic()  # a task never heard from counts from here
        self._entered: dict[Task, float] = {}  # or from when a view brought it in
        self._in_flight: set[Task] = set()  # peers whose heartbeat is not answered yet
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        if heartbeat_seconds > 0 and send is not None:
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
        next version, unless it is the current cluster; spread to the peers at once."""
        with self._lock:
            current = self._view
            if digest(cluster) == current.digest:
                return current
        return self._adopt(View.of(current.version + 1, cluster))

    def receive(self, view: View, sender: Task | None) -> View:
        """A peer's view (a heartbeat, or an answer to one): adopt it if newer; the sender
        was heard from. Returns this task's view after.

        A newer view with another address for this task (it restarted elsewhere, or the
        view was made before its port was bound) is adopted with this task's own address,
        as the next version, so the peers learn where it is."""
        if sender is not None:
            with self._lock:
                self._heard[sender] = (time.monotonic(), time.time())
        if not view.newer_than(self._view):
            return self._view
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
                now, known = time.monotonic(), old.tasks()
                self._entered.update((task, now) for task in view.tasks() if task not in known)
            self._on_change(old, view)
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
        """Stop heartbeating."""
        self._stopped.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _beat(self) -> None:
        with ThreadPoolExecutor(_SENDERS, thread_name_prefix="clusterwire-heartbeat") as pool:
            while not self._stopped.is_set():
                self._wake.clear()
                view = self._view
                peers = [(task, address) for task, address in view.tasks().items()
                         if task != self.me]
                with self._lock:
                    peers = [peer for peer in peers if peer[0] not in self._in_flight]
                    self._in_flight.update(task for task, _ in peers)
                for task, address in peers:
                    pool.submit(self._beat_one, task, address, view)
                self._wake.wait(self.heartbeat_seconds)

    def _beat_one(self, task: Task, address: str, view: View) -> None:
        try:
            if self._stopped.is_set():
                return
            answer = self._send(address, view, self.heartbeat_seconds)
        except errors.OpError:
            return  # unheard: down once the timeout passes
        except Exception:  # a heartbeat must not end the loop
            _LOG.exception("clusterwire: heartbeat to /job:%s/task:%d failed", *task)
            return
        finally:
            with self._lock:
                self._in_flight.discard(task)
        self.receive(answer, task)


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

    def _poll(self) -> None:
        while not self._stopped.wait(self._interval):
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


#: A task that joins a running cluster heartbeats this often unless its config says.
JOIN_HEARTBEAT_SECONDS = 1.0


def join(target: str, job: str, address: str, protocol: str | None = None,
         config: Mapping[str, Any] | None = None, rank: int = 0) -> Any:
    """Start a task that joins the running cluster of ``target`` (a task's
    ``protocol://host:port``) as the next task of ``job`` (plus ``rank``: the tasks of one
    launch, e.g. a Slurm step's, take consecutive indices), at ``address`` (port 0: a free
    one); the grown cluster becomes the next membership version through ``target``. Returns
    the started ``Server``. Tasks of one launch join at once; launches join one after
    another (two launches racing for one index would both claim it)."""
    from clusterwire.server import Server
    from clusterwire.session import Session

    config = dict(config or {})
    config.setdefault("membership_heartbeat_seconds", JOIN_HEARTBEAT_SECONDS)
    with Session(target, config={k: v for k, v in config.items()
                                 if k in security_fields()}) as session:
        status = session.status()
        cluster: ClusterSpec = status["cluster"]
        taken = cluster.task_indices(job) if job in cluster.jobs else []
        index = (max(taken) + 1 if taken else 0) + rank
        server = Server(with_address(cluster, job, index, address), job_name=job,
                        task_index=index,
                        protocol=protocol or status["protocol"], config=config)
        try:
            session.update_cluster(server.cluster_spec)
        except BaseException:
            server.stop()
            raise
    return server
