"""A grpc listener's streamed requests: how many uploads, how fast they and fetches must
go, and which upload makes room for another.

An upload (a streamed request) is read by a helper thread (grpcio's request iterator waits
without a timeout) while its handler waits on a queue, parked (``clusterwire.thread_pool``)
with its slot for streamed requests given back: it holds one of those threads only while
its bytes arrive. The rules:

* at most ``limit`` (``max_concurrent_calls``) uploads are open;
* an upload whose next message takes over ``idle`` seconds
  (``message_idle_timeout_seconds``), or that brings less than
  ``MIN_UPLOAD_BYTES_PER_SECOND`` over a window of ``idle`` seconds, is dropped with
  DeadlineExceededError;
* when ``limit`` are open, a new upload makes room by dropping an open upload of the peer
  holding the most (``Frame.peer``: its IP address, however many connections it opens):
  its slowest one, when that peer holds more than one more than the new upload's peer (a
  fair share); else, when the new upload's own peer holds the most, the slowest upload of
  that peer's connection holding the most, by the same rule between its connections (so
  clients of one host share it too); else its slowest one that has been open for
  ``_GRACE_S`` and brought less than ``MIN_UPLOAD_BYTES_PER_SECOND`` since it began. The
  dropped upload gets the same DeadlineExceededError; with none to drop, the new upload is
  refused as busy. So a client's upload gets in beside many uploads of another peer, on
  however many connections and at whatever pace: those only displace each other.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Collection, Iterator
from typing import Any

import grpc

from clusterwire import errors
from clusterwire.thread_pool import WorkSlots, parked
from clusterwire.transport import MIN_UPLOAD_BYTES_PER_SECOND

#: An upload open for less than this is never dropped for another (its first chunks may
#: still be on their way).
_GRACE_S = 1.0
#: Queued for an upload's handler in place of a message: nothing arrived in time, or the
#: upload was dropped to make room.
_TIMED_OUT: Any = object()
_EVICTED: Any = object()


class Upload:
    """One open upload: its messages as they arrive, and how fast they came."""

    def __init__(self, messages: Iterator[bytes], peer: str, connection: str, idle: float,
                 slots: WorkSlots):
        self.peer = peer
        self.connection = connection
        self._source = messages
        self._idle = idle
        self._slots = slots
        self._arrived: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.started = time.monotonic()
        self.received = 0  # bytes so far (read by Uploads.open under its lock, unlocked)
        self.receiving = True  # False once its last message was taken

    def _pump(self) -> None:
        try:
            for message in self._source:
                self._arrived.put(message)
        except grpc.RpcError:
            pass  # the client cancelled or the call ended: the handler has stopped reading
        finally:
            self._arrived.put(None)

    def evict(self) -> None:
        """Drop the upload: its handler's next wait ends with DeadlineExceededError."""
        self._arrived.put(_EVICTED)

    def messages(self) -> Iterator[bytes]:
        """The upload's messages, or DeadlineExceededError as the rules above say."""
        threading.Thread(target=self._pump, name="clusterwire-grpc-upload",
                         daemon=True).start()
        idle = self._idle
        owed = MIN_UPLOAD_BYTES_PER_SECOND * idle  # bytes each window must bring
        last = window_start = time.monotonic()
        window_bytes = 0
        while True:
            try:
                message = self._arrived.get_nowait()
            except queue.Empty:
                message = self._wait(min(last, window_start) + idle)
            now = time.monotonic()
            if message is None:
                self.receiving = False
                return
            if message is _EVICTED:
                raise errors.DeadlineExceededError(
                    f"The request's data arrived at {self.rate(now):.0f} B/s, below the "
                    f"{MIN_UPLOAD_BYTES_PER_SECOND} B/s an upload must keep, when every "
                    "upload the server holds open (max_concurrent_calls) was taken: the "
                    "server dropped it for another. Send faster, or in smaller requests.")
            if message is _TIMED_OUT and now >= last + idle:
                raise errors.DeadlineExceededError(
                    f"No data of the request arrived for {idle:g} s "
                    "(message_idle_timeout_seconds): the server dropped it. Send each chunk "
                    "sooner, or raise message_idle_timeout_seconds on the server.")
            if message is not _TIMED_OUT:
                window_bytes += len(message)
                self.received += len(message)
                last = now
            if now >= window_start + idle:
                if window_bytes < owed:
                    raise errors.DeadlineExceededError(
                        f"The request's data arrived at {window_bytes / idle:.0f} B/s over "
                        f"{idle:g} s (message_idle_timeout_seconds), below the "
                        f"{MIN_UPLOAD_BYTES_PER_SECOND} B/s an upload must keep: the server "
                        "dropped it. Send faster, or in smaller requests.")
                window_start, window_bytes = now, 0
            if message is not _TIMED_OUT:
                yield message

    def _wait(self, until: float) -> Any:
        """The next queued item (``_TIMED_OUT`` if none by monotonic time ``until``), waited
        for with the thread parked and its slot for streamed requests free."""
        self._slots.park()
        try:
            with parked():
                return self._arrived.get(timeout=max(until - time.monotonic(), 0))
        except queue.Empty:
            return _TIMED_OUT
        finally:
            self._slots.unpark()

    def rate(self, now: float) -> float:
        """Bytes a second since the upload began."""
        return self.received / max(now - self.started, 1e-6)


class Uploads:
    """The open uploads of one listener (thread-safe)."""

    def __init__(self, limit: int, idle: float, slots: WorkSlots):
        self.limit = limit
        self._idle = idle
        self._slots = slots
        self._open: dict[str, set[Upload]] = {}  # by peer
        self._count = 0
        self._lock = threading.Lock()

    def open(self, messages: Iterator[bytes], peer: str, connection: str) -> Upload | None:
        """A new upload of ``messages`` from ``peer`` (its IP address) on ``connection``
        (gRPC's peer string), making room if need be; None when it cannot (see the rules
        above)."""
        upload = Upload(messages, peer, connection, self._idle, self._slots)
        with self._lock:
            if self._count >= self.limit:
                dropped = self._to_drop(peer, connection)
                if dropped is None:
                    return None
                self._forget(dropped)
                dropped.evict()
            self._open.setdefault(peer, set()).add(upload)
            self._count += 1
        return upload

    def _to_drop(self, peer: str, connection: str) -> Upload | None:
        """Under the lock: the upload a new one from ``peer`` on ``connection`` may drop."""
        now = time.monotonic()
        own = self._open.get(peer, set())
        busiest = max(self._open.values(), key=len)
        fair = _fair_share(busiest, len(own), now)
        if fair is None and len(own) == len(busiest):
            by_connection: dict[str, list[Upload]] = {}
            for upload in own:
                by_connection.setdefault(upload.connection, []).append(upload)
            fair = _fair_share(max(by_connection.values(), key=len),
                               len(by_connection.get(connection, ())), now)
        if fair is not None:
            return fair
        receiving = [u for u in busiest if u.receiving]
        slow = [u for u in receiving if now - u.started >= _GRACE_S
                and u.rate(now) < MIN_UPLOAD_BYTES_PER_SECOND]
        return min(slow, key=lambda u: u.rate(now)) if slow else None

    def _forget(self, upload: Upload) -> None:
        """Under the lock: ``upload`` no longer counts (a no-op if it did not)."""
        uploads = self._open.get(upload.peer)
        if uploads is None or upload not in uploads:
            return
        uploads.discard(upload)
        self._count -= 1
        if not uploads:
            del self._open[upload.peer]

    def close(self, upload: Upload) -> None:
        """The upload's call ended (it may have been dropped for another already)."""
        with self._lock:
            self._forget(upload)


def _fair_share(busiest: Collection[Upload], held: int, now: float) -> Upload | None:
    """The slowest receiving upload of ``busiest`` if it holds more than ``held + 1``."""
    receiving = [u for u in busiest if u.receiving]
    if len(busiest) > held + 1 and receiving:
        return min(receiving, key=lambda u: u.rate(now))
    return None


class Fetches:
    """The pace rule for fetches (a response streamed to its client): a fetch whose next
    chunk is not sent within ``idle`` seconds (the client stopped reading), or that sends
    less than ``MIN_UPLOAD_BYTES_PER_SECOND`` over a window of ``idle`` seconds, is
    cancelled. gRPC's send waits for the client's flow-control window holding the thread
    (it cannot park), so a watchdog thread, started with the first fetch, checks them."""

    def __init__(self, idle: float):
        self._idle = idle
        self._owed = MIN_UPLOAD_BYTES_PER_SECOND * idle
        self._watched: dict[int, list] = {}  # id -> [context, last, window start, bytes]
        self._ids = iter(range(1 << 62))
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, context: grpc.ServicerContext, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """``chunks``, sent under the rule (the call is cancelled when it is broken)."""
        now = time.monotonic()
        entry = [context, now, now, 0]
        with self._cond:
            key = next(self._ids)
            self._watched[key] = entry
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="clusterwire-grpc-fetch-pace")
                self._thread.start()
            elif len(self._watched) == 1:
                self._cond.notify()  # the watchdog waits without a timeout when idle
        try:
            for chunk in chunks:
                yield chunk  # returns once gRPC has sent it
                entry[1] = time.monotonic()
                entry[3] += len(chunk)
        finally:
            with self._cond:
                del self._watched[key]

    def close(self) -> None:
        """Stop the watchdog (the listener stopped)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for entry in self._watched.values():
                    context, last, window_start, sent = entry
                    if now - last >= self._idle:
                        context.cancel()
                    elif now - window_start >= self._idle:
                        if sent < self._owed:
                            context.cancel()
                        entry[2], entry[3] = now, 0
                self._cond.wait(min(self._idle / 4, 1.0) if self._watched else None)
