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
import functools
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
from clusterwire.thread_pool import serve_parking

#: What ``exchange`` did.
NOT_SENT, REPLIED, NO_REPLY_YET, RECEIVING = range(4)

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


def _import_compiled():
    """The C round trip of small calls (``_ucp.c``), bound to the loaded UCX; None without it."""
    try:
        from clusterwire.transports.verbs import _ucp
        _ucp.bind()
    except ImportError:  # built without a C compiler, or a UCX without these functions
        return None
    return _ucp


class _Expectation:
    __slots__ = ("tag", "mask", "watch", "limit", "callback", "standing")

    def __init__(self, tag: int, mask: int, limit: int, callback: ReceiveCallback,
                 standing: bool, u) -> None:
        self.tag, self.mask = u.UCXXTag(tag), u.UCXXTagMask(mask)
        self.watch = (tag, mask, limit, not standing)  # as the C helper's take and step want it
        self.limit, self.callback, self.standing = limit, callback, standing


class _CompiledRequest:
    """A send or receive the C helpers left unfinished, seen as the engine sees a ucxx request."""

    __slots__ = ("_compiled", "handle", "_outcome")

    def __init__(self, compiled, handle: int) -> None:
        self._compiled, self.handle, self._outcome = compiled, handle, None

    @property
    def completed(self) -> bool:
        if self._outcome is None:
            self._outcome = self._compiled.test(self.handle)
        return self._outcome is not None

    def check_error(self) -> None:
        if self._outcome:
            raise _transfer_error(self._outcome)


class Endpoint:
    """A UCX endpoint that knows whether it was closed (ucxx crashes on a closed one)."""

    __slots__ = ("ucx", "handle", "closed", "local")

    def __init__(self, ucx, local: bool) -> None:
        self.ucx = ucx
        self.handle = ucx.handle  # the ucp_ep_h, for the C round trip
        self.closed = False
        # To this process's own worker: UCX delivers its messages during the
        # send, without an event on the worker's descriptor.
        self.local = local


class UcxEngine:
    """A UCX context and worker, and the progress role its waiting threads share."""

    def __init__(self, tls: str | None = None, net_devices: str | None = None,
                 compiled: bool = True):
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
        self._compiled = _import_compiled() if compiled else None
        self._worker_handle = self._worker.handle
        # The descriptor to sleep on: UCX's own with the C helper (ucxx wraps it in one
        # more epoll set, and each level of nesting costs every wake-up).
        self._epoll_fd = self._worker.epoll_file_descriptor if self._compiled is None else \
            self._compiled.event_fd(self._worker_handle)
        self._all_bits = u.UCXXTagMask((1 << 64) - 1)
        # Guarded by _ucx: every UCX call, the expectations and the unfinished requests.
        self._ucx = threading.Lock()
        self._pending: list[tuple[Any, Any, SendCallback]] = []
        self._expected: dict[int, _Expectation] = {}
        # _expected's items and their watches for _ucp.step; None after any change to it.
        self._watching_for: tuple[list[tuple[int, _Expectation]], list[tuple]] | None = None
        self._asleep = False  # a caller sleeps in poll: wake it for work it cannot see
        self._stopping = False
        self._step_due = False  # a serving thread must progress the worker
        # Guarded by _state: who holds the progress role and who waits for it.
        self._state = threading.Lock()
        self._followers = threading.Condition(self._state)
        self._driver: int | None = None  # the thread id of who has it
        self._stepping_id = 0  # thread id of a serving thread in _serve_step
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

    @property
    def compiled(self):
        """The C helper module (``_ucp``) this engine uses, or None."""
        return self._compiled

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
        compiled = self._compiled
        with self._ucx:
            try:
                if endpoint.closed or self._stopping:
                    raise errors.UnavailableError("The UCX endpoint is closed.")
                if compiled is not None:
                    handle = compiled.send(endpoint, buffer, tag)
                    request = _CompiledRequest(compiled, handle) if handle else None
                else:
                    buffer = self._array(buffer)
                    request = endpoint.ucx.tag_send(buffer, self._u.UCXXTag(tag))
            except Exception as err:  # UCX refused the send
                error: BaseException | None = err
            else:
                finished = request is None or request.completed
                if not finished:
                    self._pending.append((request, buffer, on_done or _ignore))
                if endpoint.local or not finished:
                    self._nudge()
                if not finished:
                    return
                error = None if request is None else _error_of(request)
        if on_done is not None:
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
        key = next(self._ids)
        want = _Expectation(tag, mask, limit, callback, standing, self._u)
        done: list[Callable[[], None]] = []
        with self._ucx:
            self._check_running()
            self._expected[key] = want
            self._watching_for = None
            self._probe_one(key, want, done)  # it may have arrived before it was expected
            if self._asleep:
                self._nudge()  # a C round trip asleep does not probe for it: wake it
        self._deliver(done)
        return key

    def cancel(self, key: int) -> None:
        """Stop expecting the messages of ``expect``'s ``key``."""
        with self._ucx:
            self._unexpect(key)

    def exchange(self, endpoint: Endpoint, message: bytes, tag: int, reply_tag: int,
                 limit: int, on_reply: ReceiveCallback, patience: float) -> int:
        """Send ``message`` and receive the reply tagged ``reply_tag``, driving the worker here.

        The round trip of a small call, with no hand-off between threads: this
        thread progresses the worker and probes for the reply itself, and
        sleeps in ``poll`` between events. It needs the progress role and,
        with the C helper, no other thread's message or unfinished request to
        look after; otherwise nothing is sent and NOT_SENT returned (use
        ``expect``, ``send`` and ``wait``). Otherwise ``on_reply`` runs as for
        ``expect`` and REPLIED is returned; or, after ``patience`` seconds
        without the reply, NO_REPLY_YET (``expect`` it then) or, if its receive
        has begun, RECEIVING (``on_reply`` runs once it is done: ``wait`` for it).
        """
        with self._state:
            if self._driver is not None or self._stopping:
                return NOT_SENT
            self._driver = threading.get_ident()
            self._callers += 1
            if self._servers:
                self._update_watch()
        try:
            if self._compiled is None:
                return self._exchange(endpoint, message, tag, reply_tag, limit, on_reply, patience)
            watched = self._watched()
            if watched is None:  # others need the worker too: the general path, all in C
                return NOT_SENT
            return self._exchange_compiled(endpoint, message, tag, reply_tag, limit, on_reply,
                                           patience, watched)
        finally:
            with self._state:
                self._driver = None
                self._callers -= 1
                if self._following:
                    self._followers.notify()  # the role is free: the next waiter takes it
                if self._servers:
                    self._update_watch()

    def _exchange(self, endpoint: Endpoint, message: bytes, tag: int, reply_tag: int,
                  limit: int, on_reply: ReceiveCallback, patience: float) -> int:
        u, worker = self._u, self._worker
        array = self._array(message)
        with self._ucx:
            if endpoint.closed or self._stopping:
                raise errors.UnavailableError("The UCX endpoint is closed.")
            request = endpoint.ucx.tag_send(array, u.UCXXTag(tag))
            if not request.completed:
                self._pending.append((request, array, _ignore))
            elif (error := _error_of(request)) is not None:
                raise errors.UnavailableError(f"UCX send failed: {error}")
        want, deadline = u.UCXXTag(reply_tag), time.monotonic() + patience
        receiving: tuple[Any, np.ndarray, BaseException | None] | None = None
        while True:
            with self._ucx:
                if self._stopping:
                    raise errors.CancelledError("The UCX engine stopped (process exit).")
                worker.progress()
                done = self._complete()
                if receiving is None:
                    result = worker.tag_probe(want, self._all_bits, remove=True)
                    if result.matched:
                        receiving = self._receive(result, limit)
                if self._expected:
                    self._probe(done)
                replied = receiving is not None and receiving[0].completed
                armed = not replied and not done and worker.arm()
                self._asleep = armed
            if done:
                self._deliver(done)
            if replied:
                request, buffer, error = receiving
                on_reply(error or _error_of(request), reply_tag, buffer)
                return REPLIED
            if armed:
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    self._sleep(remaining)
                elif receiving is None:
                    return NO_REPLY_YET
                else:
                    self._hand_over(receiving, reply_tag, on_reply)
                    return RECEIVING

    def _watched(self) -> list[_Expectation] | None:
        """What ``_ucp.exchange`` would drive the worker for: [] or [the standing expectation].

        None when it cannot (no C helper; unfinished requests, or a thread
        waiting for a message of its own: the exchange tests and probes neither).
        """
        if self._compiled is None or self._pending or len(self._expected) > 1:
            return None
        watched = list(self._expected.values())
        return watched if not watched or watched[0].standing else None

    def _watch_list(self) -> tuple[list[tuple[int, _Expectation]], list[tuple]]:
        """``_expected``'s items and their watches (for ``_ucp.step``), kept until it changes."""
        if self._watching_for is None:
            wants = list(self._expected.items())
            self._watching_for = wants, [want.watch for _, want in wants]
        return self._watching_for

    def _unexpect(self, key: int) -> None:
        """Forget an expectation (caller holds _ucx)."""
        self._expected.pop(key, None)
        self._watching_for = None

    def _exchange_compiled(self, endpoint: Endpoint, message: bytes, tag: int, reply_tag: int,
                           limit: int, on_reply: ReceiveCallback, patience: float,
                           watched: list[_Expectation]) -> int:
        """``_exchange`` in C (``_ucp.exchange``); returns to Python only for others' work.

        ``watched``: what ``_watched`` just said.
        """
        compiled = self._compiled
        deadline = time.monotonic() + patience
        send: bytes | None = message
        while watched is not None:
            watch_tag, watch_mask = watched[0].watch[:2] if watched else (0, 0)
            self._asleep = True  # a thread posting work wakes the C loop through the pipe
            try:
                outcome, value, pending = compiled.exchange(
                    self._worker_handle, endpoint, send, tag, reply_tag, watch_tag, watch_mask,
                    limit, self._epoll_fd, self._wake_r, patience, self._ucx, self)
            except compiled.UcxError as err:
                raise errors.UnavailableError(f"UCX: {err}.") from None
            finally:
                self._asleep = False
            if pending:
                with self._ucx:
                    self._pending.append((_CompiledRequest(compiled, pending), send, _ignore))
            send, patience = None, max(deadline - time.monotonic(), 0)
            if outcome == compiled.REPLIED:
                on_reply(None, reply_tag, value)
                return REPLIED
            if outcome == compiled.TOO_LONG:
                on_reply(_too_long(value, limit), reply_tag, _NOTHING)
                return REPLIED
            if outcome == compiled.TIMED_OUT:
                return NO_REPLY_YET
            if outcome == compiled.STOPPED:
                raise errors.CancelledError("The UCX engine stopped (process exit).")
            self._step(0)  # WATCHED or WOKEN: what came for others, others' sends
            watched = self._watched()
        return NO_REPLY_YET  # others need the worker now: the reply is expected as usual

    def _hand_over(self, receiving: tuple[Any, np.ndarray, BaseException | None],
                   reply_tag: int, on_reply: ReceiveCallback) -> None:
        """Leave a receive begun by ``exchange`` to whichever thread drives the worker."""
        request, buffer, error = receiving
        done: list[Callable[[], None]] = []
        with self._ucx:
            self._finish(request, buffer,
                         functools.partial(_deliver_late, on_reply, error, reply_tag, buffer), done)
        self._deliver(done)

    # -- driving the worker ---------------------------------------------------------

    def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``ready()`` (False after ``timeout`` seconds), driving the worker meanwhile.

        ``ready`` is evaluated under the engine's state lock after every delivery.
        """
        deadline = time.monotonic() + timeout
        me = threading.get_ident()
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

    def _drive_once(self, me: int, timeout: float) -> None:
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
            if threading.get_ident() != self._stepping_id:
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

    def park(self) -> None:
        """A job waits on other requests (clusterwire.thread_pool.parked): allow one more
        job at once meanwhile, on a new serving thread if none is free."""
        with self._state:
            self._max_jobs += 1
            if not self._free:
                self._spawn()
            if self._jobs:
                _signal(self._serve_w)

    def unpark(self) -> None:
        with self._state:
            self._max_jobs -= 1

    def _serve_loop(self) -> None:
        serve_parking(self)
        me = threading.get_ident()
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

    def _serve_step(self, me: int) -> None:
        """Progress the worker without sleeping (called and returning with _state held)."""
        self._step_due = False
        self._driver = self._stepping_id = me
        if self._watching:
            self._update_watch()
        self._state.release()
        try:
            self._step(0, for_callers=True)
        finally:
            self._state.acquire()
            self._driver, self._stepping_id = None, 0
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

    def _step(self, sleep: float, for_callers: bool = False) -> None:
        """Progress and deliver until the worker is armed.

        Then, if nothing was delivered, sleep up to ``sleep`` seconds in poll
        until the worker has events. ``for_callers``: a serving thread's step, which
        ends early once a caller waits (the caller steps on until armed): one
        thread then carries a caller's transfer from end to end.
        """
        delivered = False
        while True:
            failure = None
            with self._ucx:
                if self._stopping:
                    return
                if self._compiled is not None:
                    done, failure, begun = self._step_compiled()
                    # Receives just begun are tested in the next pass, not left to an event.
                    armed = failure is None and not begun
                else:
                    self._worker.progress()
                    done = self._complete()
                    self._probe(done)
                    armed = not done and self._worker.arm()
                self._asleep = armed and sleep > 0 and not done and not delivered
            if done:
                self._deliver(done)
                delivered = True
            if failure is not None:
                raise errors.UnavailableError(f"UCX failed to progress: {failure}.")
            if armed or (for_callers and self._following):
                break
        if self._asleep:
            self._sleep(sleep)

    def _sleep(self, seconds: float) -> None:
        """Sleep in poll until the (armed) worker has events, a nudge, or ``seconds`` passed."""
        for fd, _ in self._sleeper().poll(seconds * 1000):
            if fd == self._wake_r:
                _drain(fd)
        self._asleep = False

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

    def _step_compiled(self) -> tuple[list[Callable[[], None]], str | None, bool]:
        """One ``_step`` pass in C: progress until armed, taking the expected messages and
        finishing the unfinished requests.

        Returns what to deliver, UCX's failure if any, and whether receives were begun
        that UCX has not finished.
        """
        wants, watches = self._watch_list()
        pending = self._pending
        taken, finished, failure = self._compiled.step(
            self._worker_handle, watches, [entry[0].handle for entry in pending] if pending else (),
            receive_buffers.take, _POOLED_FROM)
        done: list[Callable[[], None]] = []
        if finished:
            for index, outcome in finished:
                done.append(functools.partial(pending[index][2],
                                              _transfer_error(outcome) if outcome else None))
            ended = {index for index, _ in finished}
            self._pending = [entry for i, entry in enumerate(pending) if i not in ended]
        unfinished = len(self._pending)
        if taken:
            self._taken(wants, taken, done)
        return done, failure, len(self._pending) > unfinished

    def _taken(self, wants: list[tuple[int, _Expectation]], entries: list[tuple],
               done: list[Callable[[], None]]) -> None:
        """Deliver what ``take`` or ``step`` received (at once, or when finished)."""
        compiled = self._compiled
        for index, sender_tag, buffer, length, pending in entries:
            key, want = wants[index]
            if not want.standing:
                self._unexpect(key)
            error = None
            if buffer is None:
                error = _too_long(length, want.limit) if length > want.limit else \
                    errors.ResourceExhaustedError(f"No memory to receive a {length}-byte message.")
                buffer = _NOTHING
            if pending:
                late = functools.partial(_deliver_late, want.callback, error, sender_tag, buffer)
                self._pending.append((_CompiledRequest(compiled, pending), buffer, late))
                self._nudge()
            else:
                done.append(functools.partial(want.callback, error, sender_tag, buffer))

    def _probe_one(self, key: int, want: _Expectation, done: list[Callable[[], None]]) -> None:
        if self._compiled is not None:
            taken, failure = self._compiled.take(self._worker_handle, want.watch,
                                                 receive_buffers.take, _POOLED_FROM)
            self._taken([(key, want)], taken, done)
            if failure is not None:
                raise errors.UnavailableError(f"UCX receive failed: {failure}.")
            return
        result = self._worker.tag_probe(want.tag, want.mask, remove=True)
        if not result.matched:
            return
        if not want.standing:
            self._unexpect(key)
        sender_tag = result.sender_tag.value
        request, buffer, error = self._receive(result, want.limit)
        self._finish(request, buffer,
                     functools.partial(_deliver_late, want.callback, error, sender_tag, buffer),
                     done)

    def _receive(self, result, limit: int) -> tuple[Any, np.ndarray, BaseException | None]:
        """Start receiving a probed message: (request, buffer, error).

        A message longer than ``limit`` is consumed without being stored (a
        1-byte receive ends truncated): its buffer is empty and its error
        ResourceExhaustedError.
        """
        if result.length > limit:
            error = _too_long(result.length, limit)
            scratch = np.empty(1, np.uint8)
            request = self._worker.tag_recv_with_handle(self._array(scratch), result)
            return request, scratch[:0], error
        buffer = receive_buffers.take(result.length)
        return self._worker.tag_recv_with_handle(self._array(buffer), result), buffer, None

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
                "small_calls": "in C (_ucp)" if self._compiled is not None else
                "in Python (the C helper is off or was not built)",
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


def _transfer_error(outcome: str) -> errors.UnavailableError:
    """The error of a send or receive that UCX ended with ``outcome``."""
    return errors.UnavailableError(f"UCX transfer failed: {outcome}")


def _too_long(length: int, limit: int) -> errors.ResourceExhaustedError:
    """The error of a message consumed unstored because it exceeded ``limit``."""
    return errors.ResourceExhaustedError(
        f"A {length}-byte message exceeds the limit of {limit} bytes.")


def _ignore(_: BaseException | None) -> None:
    return None


def _deliver_late(callback: ReceiveCallback, error: BaseException | None, sender_tag: int,
                  buffer: Any, late: BaseException | None) -> None:
    callback(error or late, sender_tag, buffer)


_NOTHING = np.empty(0, np.uint8)
#: A standing expectation's messages (requests' control messages) from this size on are
#: received into the receive-buffer pool, smaller ones into bytes; every other message (a
#: bulk buffer handed to the user as a writable array, or a reply) into the pool.
_POOLED_FROM = 64 << 10
