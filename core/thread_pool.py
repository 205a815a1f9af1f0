"""A server's handler threads: at most ``max_workers`` working, waits parked outside that count.

A handler that waits on other requests (a barrier arrival waiting for the rest of its job,
a forwarded request waiting for its peer) must not take a worker from the requests that
would end its wait: with a fixed pool, as many waiters as workers deadlock the server.
``ElasticPool`` is an ``Executor`` (gRPC's sync server and the transports run their
handlers on it) whose limit counts *working* threads only: a handler that enters
``parked()`` stops counting, and the pool starts (or wakes) another thread for the queued
work, as Java's ``ForkJoinPool`` does for a ``ManagedBlocker``. A parked wait still sits on
its own thread, because gRPC's sync server answers a call from the thread that took it; what
the pool guarantees is that waits never starve work. How many calls may wait at once is the
server's admission limit (``max_concurrent_calls``), not the pool's size. Threads beyond
``max_workers`` end once they found no work for ``keep_alive`` seconds (so a job's next
barrier round finds them waiting instead of starting them again).

A transport with workers of its own (grpc+verbs' UCX engine, the zmq plugin's listener)
makes its threads honour ``parked()`` the same way: each worker calls
``serve_parking(host)`` once, with a host whose ``park()``/``unpark()`` let it run another
worker meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, Protocol

_current = threading.local()  # .host: what this thread's parked() waits tell (a pool)


class ParkingHost(Protocol):
    """Threads whose waits can be parked: ``park`` before a wait, ``unpark`` after it."""

    def park(self) -> None: ...

    def unpark(self) -> None: ...


def serve_parking(host: ParkingHost) -> None:
    """Make the calling thread a worker of ``host``: its ``parked()`` waits tell ``host``."""
    _current.host = host


@contextlib.contextmanager
def parked() -> Iterator[None]:
    """Mark the enclosed wait as parked: on a worker of an ``ElasticPool`` (or of another
    ``ParkingHost``), another thread may work meanwhile; elsewhere it changes nothing."""
    host: ParkingHost | None = getattr(_current, "host", None)
    if host is None:
        yield
        return
    host.park()
    try:
        yield
    finally:
        host.unpark()


class _Idle:
    """A thread waiting for work; woken alone, through a condition of its own."""

    def __init__(self, lock: threading.Lock):
        self.wakeup = threading.Condition(lock)
        self.woken = False


class ElasticPool(futures.Executor):
    """Runs submitted calls on at most ``max_workers`` working (not parked) threads."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "clusterwire",
                 keep_alive: float = 60.0):
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._max_workers = max_workers
        self._keep_alive = keep_alive
        self._name = thread_name_prefix
        self._lock = threading.Lock()
        self._exited = threading.Condition(self._lock)  # shutdown(wait=True) waits here
        self._queue: collections.deque[tuple[futures.Future, Callable, tuple, dict]] = \
            collections.deque()
        self._idle: collections.deque[_Idle] = collections.deque()  # most recent last
        self._threads = 0  # alive
        self._working = 0  # running a call and not parked
        self._signalled = 0  # started or woken for work, not yet looking for it
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future:
        future: futures.Future = futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.append((future, fn, args, kwargs))
            self._signal()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft()[0].cancel()
            while self._idle:
                self._wake(self._idle.pop())
            if wait:
                self._exited.wait_for(lambda: self._threads == 0)

    @property
    def threads(self) -> int:
        """Threads alive (working, parked or idle)."""
        return self._threads

    def park(self) -> None:
        """The calling worker stops counting against ``max_workers`` (see ``parked()``)."""
        with self._lock:
            self._working -= 1
            self._signal()

    def unpark(self) -> None:
        """The calling worker, back from a parked wait, counts again."""
        with self._lock:
            self._working += 1

    def _signal(self) -> None:
        """Under the lock: wake or start threads for queued work the working count allows."""
        while (len(self._queue) > self._signalled
               and self._working + self._signalled < self._max_workers):
            if self._idle:
                self._wake(self._idle.pop())  # the most recent: the others may time out
            else:
                self._threads += 1
                self._signalled += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._threads}",
                                 daemon=True).start()

    def _wake(self, idle: _Idle) -> None:
        idle.woken = True
        self._signalled += 1
        idle.wakeup.notify()

    def _work(self) -> None:
        serve_parking(self)
        idle = _Idle(self._lock)
        with self._lock:
            self._signalled -= 1  # started
            while True:
                while self._queue and self._working < self._max_workers:
                    future, fn, args, kwargs = self._queue.popleft()
                    self._working += 1
                    self._lock.release()
                    try:
                        if future.set_running_or_notify_cancel():
                            try:
                                future.set_result(fn(*args, **kwargs))
                            except BaseException as err:  # the submitter's to see, as
                                future.set_exception(err)  # in ThreadPoolExecutor
                    finally:
                        del future, fn, args, kwargs
                        self._lock.acquire()
                        self._working -= 1
                if self._shutdown and not self._queue:
                    break
                surplus = self._threads > self._max_workers
                idle.woken = False
                self._idle.append(idle)
                idle.wakeup.wait_for(lambda: idle.woken,
                                     self._keep_alive if surplus else None)
                if idle.woken:
                    self._signalled -= 1
                    continue
                self._idle.remove(idle)  # keep_alive seconds without work
                if self._threads > self._max_workers:
                    break
            self._threads -= 1
            self._exited.notify_all()


class WorkSlots:
    """At most ``limit`` threads of one's own working at once; a ``ParkingHost``.

    For a transport whose connections have a thread each (grpc+local's Unix call
    connections): such a thread calls ``serve_parking(slots)`` once, then holds a slot
    (``acquire``/``release``) around each request it serves. The grpc transport's streamed
    requests take one without waiting (``try_acquire``) and park it while their bytes are
    on their way. A handler's ``parked()`` wait
    gives the slot back, so waits never starve the work that would end them; after the
    wait the thread counts again at once, as an ``ElasticPool`` worker does (briefly more
    than ``limit`` may work, rather than a finished wait queueing behind new work).
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self._limit = limit
        self._working = 0
        self._waiting = 0
        self._closed = False
        self._cond = threading.Condition(threading.Lock())

    @property
    def working(self) -> int:
        """Threads holding a slot and not parked."""
        return self._working

    def acquire(self) -> bool:
        """Wait for a free slot and take it; False (nothing taken) once ``close()`` ran."""
        with self._cond:
            while self._working >= self._limit and not self._closed:
                self._waiting += 1
                try:
                    self._cond.wait()
                finally:
                    self._waiting -= 1
            if self._closed:
                return False
            self._working += 1
            return True

    def try_acquire(self) -> bool:
        """Take a free slot without waiting; False if none is free or ``close()`` ran."""
        with self._cond:
            if self._working >= self._limit or self._closed:
                return False
            self._working += 1
            return True

    def release(self) -> None:
        """Give back the calling thread's slot."""
        with self._cond:
            self._working -= 1
            if self._waiting and self._working < self._limit:
                self._cond.notify()

    def park(self) -> None:
        """The calling thread's slot is free while it waits (see ``parked()``)."""
        self.release()

    def unpark(self) -> None:
        """The calling thread, back from a parked wait, counts again."""
        with self._cond:
            self._working += 1

    def close(self) -> None:
        """Wake every thread waiting for a slot; their ``acquire`` returns False."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
