"""One UCX worker per process, driven by one thread.

Every UCX call (endpoint creation, sends, probes, receives, progress) runs on
the engine thread, so no UCX object is ever touched by two threads. Other
threads queue work and wait on events. Receives use tag probing: a message
is received only once it has arrived, into a buffer of exactly its size, so
no receive is ever left posted for a peer that died. Idle, the thread sleeps
in ``select`` on the worker's event descriptor (UCX "blocking" progress).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import select
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from clusterwire import errors
from clusterwire.buffers import receive_buffers

ReceiveCallback = Callable[[BaseException | None, int, np.ndarray], None]
_IDLE_WAIT = 0.5


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

    def __init__(self, tag: int, mask: int, limit: int, callback: ReceiveCallback,
                 standing: bool):
        self.tag, self.mask, self.limit = tag, mask, limit
        self.callback, self.standing = callback, standing


class Endpoint:
    """A UCX endpoint that knows whether it was closed (ucxx crashes on a closed one)."""

    __slots__ = ("ucx", "closed")

    def __init__(self, ucx) -> None:
        self.ucx = ucx
        self.closed = False


class UcxEngine:
    """A UCX context and worker plus the thread that drives them."""

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
        self._queue: deque[Callable[[], None]] = deque()
        self._pending: list[tuple[Any, Any, Callable[[BaseException | None], None]]] = []
        self._expected: dict[int, _Expectation] = {}
        self._ids = itertools.count(1)
        self._transfers = itertools.count(1)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="clusterwire-ucx")
        self._thread.start()
        # UCX must not be progressed while the interpreter tears its objects down.
        atexit.register(self.stop)

    # -- called from any thread ----------------------------------------------------

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread."""
        self._queue.append(fn)
        with contextlib.suppress(BlockingIOError):  # a full pipe: the thread is awake anyway
            os.write(self._wake_w, b"x")

    def run(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the engine thread and return its result."""
        done = threading.Event()
        box: list[Any] = []

        def task() -> None:
            try:
                box.append((True, fn()))
            except BaseException as err:  # handed back to the caller
                box.append((False, err))
            done.set()

        self.call_soon(task)
        if not done.wait(timeout):
            raise errors.DeadlineExceededError("The UCX engine did not respond.")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def next_transfer(self) -> int:
        """A transfer id, unique among this process's calls in flight."""
        return next(self._transfers) % ((1 << 24) - 1) + 1

    def connect(self, address: bytes):
        """An endpoint to the worker at ``address`` (error handling off, so shared memory works)."""
        u = self._u

        def create() -> Endpoint:
            remote = u.UCXAddress.create_from_buffer(address)
            return Endpoint(u.UCXEndpoint.create_from_worker_address(self._worker, remote, False))

        try:
            return self.run(create)
        except u.UCXError as err:
            raise errors.UnavailableError(f"UCX cannot reach the peer: {err}") from None

    def close_endpoint(self, endpoint: Endpoint) -> None:
        """Close an endpoint; its unfinished sends complete with an error."""

        def close() -> None:
            if not endpoint.closed:
                endpoint.closed = True
                endpoint.ucx.close()

        self.call_soon(close)

    def send(self, endpoint: Endpoint, buffer: Any, tag: int,
             on_done: Callable[[BaseException | None], None] | None = None) -> None:
        """Send ``buffer`` (kept alive until sent) as one tagged message."""
        array = self._array(buffer)
        u = self._u

        def post() -> None:
            if endpoint.closed:
                (on_done or _ignore)(errors.UnavailableError("The UCX endpoint is closed."))
                return
            try:
                request = endpoint.ucx.tag_send(array, u.UCXXTag(tag))
            except Exception as err:  # UCX refused the send
                (on_done or _ignore)(err)
                return
            self._pending.append((request, array, on_done or _ignore))

        self.call_soon(post)

    def expect(self, tag: int, mask: int, limit: int, callback: ReceiveCallback,
               standing: bool = False) -> int:
        """Receive messages matching ``tag``/``mask`` (once, or always if ``standing``).

        ``callback(error, sender_tag, buffer)`` runs on the engine thread: keep it short.
        Messages longer than ``limit`` are consumed without being stored and
        reported as ResourceExhaustedError.
        """
        key = next(self._ids)
        expectation = _Expectation(tag, mask, limit, callback, standing)
        self.call_soon(lambda: self._expected.__setitem__(key, expectation))
        return key

    def cancel(self, key: int) -> None:
        """Stop expecting the messages of ``expect``'s ``key``."""
        self.call_soon(lambda: self._expected.pop(key, None))

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

    # -- the engine thread ----------------------------------------------------------

    def _loop(self) -> None:
        worker = self._worker
        epoll_fd = worker.epoll_file_descriptor
        while not self._stopping:
            busy = False
            while self._queue:
                self._queue.popleft()()
                busy = True
            worker.progress()
            busy |= self._complete()
            busy |= self._probe()
            if not busy and worker.arm():
                select.select([epoll_fd, self._wake_r], [], [], _IDLE_WAIT)
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass

    def _complete(self) -> bool:
        finished = [p for p in self._pending if p[0].completed]
        if not finished:
            return False
        self._pending = [p for p in self._pending if not p[0].completed]
        for request, _, callback in finished:
            try:
                request.check_error()
                error = None
            except Exception as err:
                error = err
            callback(error)
        return True

    def _probe(self) -> bool:
        u, found = self._u, False
        for key, want in list(self._expected.items()):
            result = self._worker.tag_probe(u.UCXXTag(want.tag), u.UCXXTagMask(want.mask),
                                            remove=True)
            if not result.matched:
                continue
            found = True
            if not want.standing:
                del self._expected[key]
            self._receive(result, want)
        return found

    def _receive(self, result, want: _Expectation) -> None:
        sender_tag = result.sender_tag.value
        if result.length > want.limit:
            # Consume it without storing it: a 1-byte receive ends truncated.
            scratch = self._array(np.empty(1, np.uint8))
            request = self._worker.tag_recv_with_handle(scratch, result)
            error = errors.ResourceExhaustedError(
                f"A {result.length}-byte message exceeds the limit of {want.limit} bytes.")
            self._pending.append((request, scratch, lambda _: want.callback(error, sender_tag,
                                                                          np.empty(0, np.uint8))))
            return
        buffer = receive_buffers.take(result.length)
        request = self._worker.tag_recv_with_handle(self._array(buffer), result)
        self._pending.append(
            (request, buffer, lambda err: want.callback(err, sender_tag, buffer)))

    def stop(self) -> None:
        """Stop and join the engine thread (the process is exiting)."""
        self._stopping = True
        self.call_soon(lambda: None)
        if threading.current_thread() is not self._thread:
            self._thread.join(5)


def _ignore(_: BaseException | None) -> None:
    return None
