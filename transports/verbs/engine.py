"""One UCX worker per process, driven by the threads that wait for its messages.

Every UCX call (endpoint creation, sends, probes, receives, progress, arm)
runs under one lock, so no UCX object is ever touched by two threads at once;
sends are posted directly by the calling thread. A thread waiting for
messages (``wait``) drives the worker itself when no other thread does
(leader/follower): it progresses the worker, probes for expected messages,
delivers them and, when idle, sleeps in ``poll`` on the worker's event
descriptor (UCX "blocking" progress). Other waiters sleep until a delivery or
until the role is free.

Once a listener asks for it (``serve``), serving threads receive requests
while no caller waits and run the jobs handed to ``submit``. Idle serving
threads all sleep in one epoll set holding the worker's descriptor as
EPOLLONESHOT, so a UCX event wakes exactly one of them; it progresses the
worker, re-arms it, re-enables the descriptor for the others and then serves
the request it received itself: no hand-off to another thread, and a job that
blocks never stops the worker's progress (the next event wakes another idle
thread). One serving thread beyond the jobs' limit is kept free for that.
While a caller waits, the descriptor is disabled in that set and the caller
drives the worker alone.

Receives use tag probing: a message is received only once it has arrived,
into a buffer of exactly its size, so no receive is ever left posted for a
peer that died.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import select
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from clusterwire import errors
from clusterwire.buffers import receive_buffers

ReceiveCallback = Callable[[BaseException | None, int, np.ndarray], None]
SendCallback = Callable[[BaseException | None], None]


def _import_ucxx():
    # UCX prints unused-variable warnings on stdout unless told not to; 512k TCP
    # segments were the fast setting on small hosts.
    for key, value in (("UCX_WARN_UNUSED_ENV_VARS", "n"), ("UCX_TCP_RX_SEG_SIZE", "512k"),
                       ("UCX_TCP_TX_SEG_SIZE", "512k")):
        os.environ.setdefault(key, value)
    try:
        import ucxx  # noqa: F401  (loads libucx, sets ucxx's UCX defaults)
        import ucxx._lib.libucxx as libucxx
        from ucxx._lib.arr import Array
    except ImportError as err:
        raise errors.NotFoundError(
            "The grpc+verbs transport needs UCX through the ucxx package, which is not "
            f"installed ({err}). Install it with: pip install 'clusterwire[verbs]'.") from None
    return libucxx, Array


class _Expectation:
    __slots__ = ("tag", "mask", "limit", "callback", "standing")

    def __init__(self, tag: Any, mask: Any, limit: int, callback: ReceiveCallback,
                 standing: bool):
        self.tag, self.mask, self.limit = tag, mask, limit
        self.callback, self.standing = callback, standing


class Endpoint:
    """A UCX endpoint that knows whether it was closed (ucxx crashes on a closed one)."""

    __slots__ = ("ucx", "closed", "local")

    def __init__(self, ucx, local: bool) -> None:
        self.ucx = ucx
        self.closed = False
        # To this process's own worker: UCX delivers its messages during the
        # send, without an event on the worker's descriptor.
        self.local = local


class UcxEngine:
    """A UCX context and worker, and the progress role its waiting threads share."""

    def __init__(self, tls: str | None = None, net_devices: str | None = None):
        self._u, self._array = _import_ucxx()
        config = {}
        if tls:
            config["TLS"] = tls
        if net_devices:
            config["NET_DEVICES"] = net_devices
        u = self._u
        try:
            self._context = u.UCXContext(config_dict=config,
                                         feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
            self._worker = u.UCXWorker(self._context)
            self._worker.init_blocking_progress_mode()
        except u.UCXError as err:
            raise errors.UnavailableError(
                f"UCX could not initialise (TLS={tls or 'all'}, "
                f"NET_DEVICES={net_devices or 'all'}): {err}") from None
        self.address = self._worker.address.tobytes()
        self.tls = tls or os.environ.get("UCX_TLS", "all")
        self._epoll_fd = self._worker.epoll_file_descriptor
        # Guarded by _ucx: every UCX call, the expectations and the unfinished requests.
        self._ucx = threading.Lock()
        self._pending: list[tuple[Any, Any, SendCallback]] = []
        self._expected: dict[int, _Expectation] = {}
        self._asleep = False  # a caller sleeps in poll: wake it for work it cannot see
        self._stopping = False
        self._step_due = False  # a serving thread must progress the worker
        # Guarded by _state: who holds the progress role and who waits for it.
        self._state = threading.Lock()
        self._followers = threading.Condition(self._state)
        self._driver: threading.Thread | None = None
        self._stepping: threading.Thread | None = None  # a serving thread in _serve_step
        self._callers = 0  # threads inside wait()
        self._following = 0  # callers waiting for a delivery or for the role
        self._servers: set[threading.Thread] = set()
        self._max_jobs = 0  # jobs run at once, at most
        self._free = 0  # serving threads not running a job
        self._jobs: deque[Callable[[], None]] = deque()
        self._ids = itertools.count(1)
        self._transfers = itertools.count(1)
        self._wake_r, self._wake_w = _pipe()  # wakes a caller asleep in poll
        self._threads = threading.local()
        self._serve_r, self._serve_w = _pipe()  # wakes one idle serving thread
        # Idle serving threads sleep here; the worker's descriptor is enabled
        # (one-shot) only while nobody drives and no caller waits.
        self._watch = select.epoll()
        self._watch.register(self._serve_r, select.EPOLLIN)
        self._watch.register(self._epoll_fd, 0)
        self._watching = False
        # UCX must not be progressed while the interpreter tears its objects down.
        atexit.register(self.stop)

    # -- posting work (any thread) --------------------------------------------------

    def next_transfer(self) -> int:
        """A transfer id, unique among this process's calls in flight."""
        return next(self._transfers) % ((1 << 24) - 1) + 1

    def connect(self, address: bytes) -> Endpoint:
        """An endpoint to the worker at ``address`` (error handling off, so shared memory works)."""
        u = self._u
        with self._ucx:
            self._check_running()
            try:
                remote = u.UCXAddress.create_from_buffer(address)
                return Endpoint(u.UCXEndpoint.create_from_worker_address(
                    self._worker, remote, False), address == self.address)
            except u.UCXError as err:
                raise errors.UnavailableError(f"UCX cannot reach the peer: {err}") from None

    def close_endpoint(self, endpoint: Endpoint) -> None:
        """Close an endpoint; its unfinished sends complete with an error."""
        with self._ucx:
            if not endpoint.closed and not self._stopping:
                endpoint.closed = True
                endpoint.ucx.close()
                self._nudge()

    def send(self, endpoint: Endpoint, buffer: Any, tag: int,
             on_done: SendCallback | None = None) -> None:
        """Send ``buffer`` (kept alive until sent) as one tagged message.

        ``on_done(error)`` runs once the send finished: at once on this thread
        when UCX completed it immediately, else on the thread driving the worker.
        """
        array = self._array(buffer)
        on_done = on_done or _ignore
        with self._ucx:
            try:
                if endpoint.closed or self._stopping:
                    raise errors.UnavailableError("The UCX endpoint is closed.")
                request = endpoint.ucx.tag_send(array, self._u.UCXXTag(tag))
            except Exception as err:  # UCX refused the send
                error: BaseException | None = err
            else:
                finished = request.completed
                if not finished:
                    self._pending.append((request, array, on_done))
                if endpoint.local or not finished:
                    self._nudge()
                if not finished:
                    return
                error = _error_of(request)
        on_done(error)

    def expect(self, tag: int, mask: int, limit: int, callback: ReceiveCallback,
               standing: bool = False) -> int:
        """Receive messages matching ``tag``/``mask`` (once, or always if ``standing``).

        ``callback(error, sender_tag, buffer)`` runs on whichever thread drives
        the worker (possibly this one, before ``expect`` returns): keep it short.
        Messages longer than ``limit`` are consumed without being stored and
        reported as ResourceExhaustedError. Messages arrive only while a thread
        ``wait``s or serving threads run (see ``serve``).
        """
        u = self._u
        key = next(self._ids)
        want = _Expectation(u.UCXXTag(tag), u.UCXXTagMask(mask), limit, callback, standing)
        done: list[Callable[[], None]] = []
        with self._ucx:
            self._check_running()
            self._expected[key] = want
            self._probe_one(key, want, done)  # it may have arrived before it was expected
        self._deliver(done)
        return key

    def cancel(self, key: int) -> None:
        """Stop expecting the messages of ``expect``'s ``key``."""
        with self._ucx:
            self._expected.pop(key, None)

    # -- driving the worker ---------------------------------------------------------

    def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``ready()`` (False after ``timeout`` seconds), driving the worker meanwhile.

        ``ready`` is evaluated under the engine's state lock after every delivery.
        """
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        with self._state:
            self._callers += 1
            self._update_watch()
            try:
                while not ready():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    if self._stopping:
                        raise errors.CancelledError("The UCX engine stopped (process exit).")
                    if self._driver is None:
                        self._drive_once(me, remaining)
                        continue
                    self._following += 1
                    try:
                        self._followers.wait(remaining)
                    finally:
                        self._following -= 1
                return True
            finally:
                self._callers -= 1
                if self._driver is None:
                    self._followers.notify()  # the role is free: the next waiter takes it
                self._update_watch()

    def _drive_once(self, me: threading.Thread, timeout: float) -> None:
        """Take the role for one step of a caller (called and returning with _state held)."""
        self._driver = me
        self._state.release()
        try:
            self._step(timeout)
        finally:
            self._state.acquire()
            self._driver = None

    def serve(self, max_jobs: int) -> None:
        """Receive requests while no caller waits, and allow ``max_jobs`` more jobs at once.

        A listener calls it before it ``submit``s requests.
        """
        with self._state:
            self._max_jobs += max_jobs
            if not self._servers and not self._stopping:
                self._spawn()
                self._update_watch()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on a serving thread; it may block (other threads keep the worker going)."""
        with self._state:
            self._jobs.append(job)
            if threading.current_thread() is not self._stepping:
                _signal(self._serve_w)  # a stepping serving thread picks its jobs up itself

    def _spawn(self) -> bool:
        """Start one more serving thread, if the limit allows (caller holds _state)."""
        if len(self._servers) > self._max_jobs:
            return False
        thread = threading.Thread(target=self._serve_loop, daemon=True,
                                  name=f"clusterwire-ucx-{len(self._servers)}")
        self._servers.add(thread)
        self._free += 1
        thread.start()
        return True

    def _serve_loop(self) -> None:
        me = threading.current_thread()
        with self._state:
            while not self._stopping:
                if self._step_due and self._driver is None and not self._callers:
                    self._serve_step(me)
                elif self._jobs and (self._free > 1 or self._spawn()):
                    self._run_job()
                else:
                    self._state.release()
                    try:
                        events = self._watch.poll()
                    finally:
                        self._state.acquire()
                    for fd, _ in events:
                        if fd == self._epoll_fd:  # the one-shot fired: it is disabled now
                            self._watching = False
                            self._step_due = True
                        else:
                            _drain(self._serve_r)

    def _run_job(self) -> None:
        """Run the next job (called and returning with _state held)."""
        job = self._jobs.popleft()
        self._free -= 1
        if self._jobs:
            _signal(self._serve_w)  # another serving thread takes the next one
        self._state.release()
        try:
            job()
        except Exception:  # a bug in a job must not end the serving thread
            traceback.print_exc()
        finally:
            self._state.acquire()
            self._free += 1

    def _serve_step(self, me: threading.Thread) -> None:
        """Progress the worker without sleeping (called and returning with _state held)."""
        self._step_due = False
        self._driver = self._stepping = me
        self._update_watch()
        self._state.release()
        try:
            self._step(0)
        finally:
            self._state.acquire()
            self._driver = self._stepping = None
        if self._callers:
            self._followers.notify()
        self._update_watch()

    def _update_watch(self) -> None:
        """Enable the worker's descriptor for idle serving threads iff nobody drives or waits.

        Every step ends with the worker armed, so whenever nobody drives the
        worker is armed or its descriptor readable.
        """
        want = bool(self._servers) and self._driver is None and not self._callers \
            and not self._stopping
        if want != self._watching:
            self._watch.modify(self._epoll_fd, select.EPOLLIN | select.EPOLLONESHOT if want else 0)
            self._watching = want
        if want and self._step_due:
            _signal(self._serve_w)  # work posted while the role was taken

    def _step(self, sleep: float) -> None:
        """Progress and deliver until the worker is armed.

        Then, if nothing was delivered, sleep up to ``sleep`` seconds in poll
        until the worker has events.
        """
        delivered = False
        while True:
            with self._ucx:
                if self._stopping:
                    return
                self._worker.progress()
                done = self._complete()
                self._probe(done)
                armed = not done and self._worker.arm()
                self._asleep = armed and sleep > 0 and not delivered
            if done:
                self._deliver(done)
                delivered = True
            elif armed:
                break
        if self._asleep:
            ready = self._sleeper().poll(sleep * 1000)
            self._asleep = False
            if any(fd == self._wake_r for fd, _ in ready):
                _drain(self._wake_r)

    def _sleeper(self) -> select.poll:
        """This thread's poll set of the worker's and the wake pipe's descriptors (poll,
        not select: descriptors may be over 1023; one per thread: a poll object must not
        be polled by two threads at once)."""
        sleeper = getattr(self._threads, "sleeper", None)
        if sleeper is None:
            sleeper = self._threads.sleeper = select.poll()
            sleeper.register(self._epoll_fd, select.POLLIN)
            sleeper.register(self._wake_r, select.POLLIN)
        return sleeper

    def _deliver(self, done: list[Callable[[], None]]) -> None:
        if done:
            for callback in done:
                callback()
            with self._state:
                if self._following:
                    self._followers.notify_all()

    def _nudge(self) -> None:
        """Make a thread progress work posted after the worker was armed (caller holds _ucx)."""
        if self._asleep:
            self._asleep = False
            _signal(self._wake_w)
        elif self._servers:
            self._step_due = True
            if not self._callers:  # else the last caller to leave signals (_update_watch)
                _signal(self._serve_w)

    # -- with the _ucx lock held -----------------------------------------------------

    def _check_running(self) -> None:
        if self._stopping:
            raise errors.CancelledError("The UCX engine stopped (process exit).")

    def _complete(self) -> list[Callable[[], None]]:
        if not self._pending:
            return []
        done, pending = [], []
        for entry in self._pending:
            if entry[0].completed:
                error, callback = _error_of(entry[0]), entry[2]
                done.append(lambda callback=callback, error=error: callback(error))
            else:
                pending.append(entry)
        self._pending = pending
        return done

    def _probe(self, done: list[Callable[[], None]]) -> None:
        for key, want in list(self._expected.items()):
            self._probe_one(key, want, done)

    def _probe_one(self, key: int, want: _Expectation, done: list[Callable[[], None]]) -> None:
        result = self._worker.tag_probe(want.tag, want.mask, remove=True)
        if not result.matched:
            return
        if not want.standing:
            del self._expected[key]
        sender_tag = result.sender_tag.value
        if result.length > want.limit:
            # Consume it without storing it: a 1-byte receive ends truncated.
            error = errors.ResourceExhaustedError(
                f"A {result.length}-byte message exceeds the limit of {want.limit} bytes.")
            scratch = self._array(np.empty(1, np.uint8))
            request = self._worker.tag_recv_with_handle(scratch, result)
            self._finish(request, scratch, lambda _: want.callback(
                error, sender_tag, np.empty(0, np.uint8)), done)
            return
        buffer = receive_buffers.take(result.length)
        request = self._worker.tag_recv_with_handle(self._array(buffer), result)
        self._finish(request, buffer, lambda err: want.callback(err, sender_tag, buffer), done)

    def _finish(self, request, keep: Any, callback: SendCallback,
                done: list[Callable[[], None]]) -> None:
        if request.completed:
            error = _error_of(request)
            done.append(lambda: callback(error))
        else:
            self._pending.append((request, keep, callback))
            self._nudge()

    # -- facts and shutdown ----------------------------------------------------------

    def info(self) -> dict[str, str]:
        """UCX version, configured TLS and the transports UCX may use here."""
        resources = re.findall(r"resource.*flags.*?(\S+/\S+)\s*$", self._context.info,
                               re.MULTILINE)
        rdma = [r for r in resources if r.split("/")[0] in ("rc", "rc_mlx5", "ud", "ud_mlx5",
                                                             "dc", "dc_mlx5", "rc_verbs",
                                                             "ud_verbs")]
        version = ".".join(str(v) for v in self._u.get_ucx_version())
        return {"ucx_version": version, "ucx_tls": self.tls,
                "ucx_transports": ",".join(resources),
                "rdma": ",".join(rdma) if rdma else "none (no verbs device or UCX without verbs)"}

    def stop(self) -> None:
        """Stop driving the worker for good (the process is exiting); waiters get CancelledError."""
        with self._ucx:  # waits for a UCX call in progress; no thread makes one after this
            self._stopping = True
        with self._state:
            self._followers.notify_all()
            self._update_watch()
            for _ in self._servers:
                _signal(self._serve_w)
        _signal(self._wake_w)


def _pipe() -> tuple[int, int]:
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    return read, write


def _signal(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # a full pipe wakes its reader anyway
        os.write(fd, b"x")


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


def _error_of(request) -> BaseException | None:
    try:
        request.check_error()
    except Exception as err:
        return err
    return None


def _ignore(_: BaseException | None) -> None:
    return None
