"""Cut-through forwarding: a forwarded response's bulk bytes pass through as they arrive.

A task forwarding a request for another task (``Channel.call_relayed``) gets the owner's
reply header at once and its announced bulk buffers as a ``Relay``: nothing is fetched
yet. The forwarding task's listener announces the same buffers to its own client; when
that client fetches them, the relay opens the owner's response (``Incoming``) and hands
the bytes on as they arrive. From the owner's bulk port to the client's bulk connection
they move inside the kernel (``os.splice`` through a pipe: no copy in this process);
otherwise one chunk (``chunk_bytes``) at a time. Either way the forwarding task holds at
most a pipe or a chunk of it, and reads only as fast as its client takes the bytes. A
relay nobody fetches expires with its listener's pending responses, having read nothing.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import os
import select
import socket
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from clusterwire import errors

Chunk = memoryview | bytes
_PIPE_BYTES = 1 << 20  # asked for; the kernel may grant less (fs.pipe-max-size)
_SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK


class Incoming(abc.ABC):
    """A peer's response whose bytes are next on its connection (the peer answered)."""

    @abc.abstractmethod
    def chunks(self) -> Iterator[Chunk]:
        """The bytes in order; each chunk is valid until the next one is asked for."""

    def send_to(self, connection: socket.socket, idle: float) -> None:
        """Write every byte to ``connection`` (a blocking socket write may wait ``idle`` s)."""
        for chunk in self.chunks():
            connection.sendall(chunk)

    @abc.abstractmethod
    def close(self) -> None:
        """Release the peer connection (the unread rest is dropped)."""

    def __enter__(self) -> Incoming:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class Relay:
    """The announced buffers of a peer's response, opened once, when they are sent on."""

    def __init__(self, lengths: Sequence[int], open_incoming: Callable[[], Incoming]):
        self.lengths = list(lengths)
        self.nbytes = sum(self.lengths)
        self._open = open_incoming
        self._opened = False

    def open(self) -> Incoming:
        """Ask the peer for the bytes (clusterwire errors if it cannot send them). Once
        only: the peer sends a response once."""
        if self._opened:
            raise errors.NotFoundError("This forwarded response was fetched already.")
        self._opened = True
        return self._open()

    def read_all(self) -> list[np.ndarray]:
        """Every buffer, received whole (for a response small enough to send inline)."""
        whole = np.empty(self.nbytes, np.uint8)
        filled = 0
        with self.open() as incoming:
            for chunk in incoming.chunks():
                count = memoryview(chunk).nbytes
                if filled + count > self.nbytes:
                    raise errors.DataLossError(
                        "A forwarded response sent more bytes than it announced.")
                whole[filled:filled + count] = np.frombuffer(chunk, np.uint8)
                filled += count
        offsets = np.cumsum([0, *self.lengths])
        return [whole[start:end] for start, end in zip(offsets[:-1], offsets[1:], strict=True)]


class RelayPart:
    """Buffer ``index`` of a relay, standing in a response frame until a listener of the
    grpc transport sends the relay on."""

    __slots__ = ("relay", "index")

    def __init__(self, relay: Relay, index: int):
        self.relay, self.index = relay, index

    @property
    def nbytes(self) -> int:
        """The size of the buffer it stands for (what the metrics count as sent)."""
        return self.relay.lengths[self.index]


def relay_of(buffers: Sequence[object]) -> Relay | None:
    """The relay a response frame's buffers stand for; None for ordinary buffers."""
    if not buffers or not isinstance(buffers[0], RelayPart):
        return None
    relay = buffers[0].relay
    if len(buffers) != len(relay.lengths) or any(
            not isinstance(part, RelayPart) or part.relay is not relay or part.index != index
            for index, part in enumerate(buffers)):
        raise errors.InternalError("A response mixes a forwarded relay with other buffers.")
    return relay


class Verbatim(list):
    """A forwarded response's inline buffers (views of ``envelope``), with the reply envelope
    they came in: a listener of this transport sends that envelope on as it is, rather than
    encoding the same bytes again (``verbatim_of``)."""

    __slots__ = ("header", "envelope")

    def __init__(self, header: bytes, buffers: Sequence[memoryview], envelope: bytes):
        super().__init__(buffers)
        self.header, self.envelope = header, envelope


def verbatim_of(header: bytes, buffers: Sequence[object]) -> bytes | None:
    """The envelope a response of ``header`` and ``buffers`` arrived in, if it is passed on
    unchanged (``Verbatim``); else None."""
    if type(buffers) is Verbatim and buffers.header is header:
        return buffers.envelope
    return None


def splice(source: socket.socket, destination: socket.socket, total: int,
           deadline: float | None, idle: float) -> None:
    """Move ``total`` bytes from ``source`` to ``destination`` through a pipe, in the
    kernel. TimeoutError when ``source`` passes ``deadline`` or ``destination`` takes
    nothing for ``idle`` seconds; ConnectionResetError if ``source`` ends early."""
    timeouts = source.gettimeout(), destination.gettimeout()
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        source.setblocking(False)
        destination.setblocking(False)
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        room = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ)
        left, piped = total, 0
        last_write = time.monotonic()
        while left or piped:
            moved = False
            if left and piped < room:
                try:
                    count = os.splice(source.fileno(), write_end, min(left, room - piped),
                                      flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    count = -1
                if count == 0:
                    raise ConnectionResetError(f"the peer closed {left} bytes early")
                if count > 0:
                    left, piped, moved = left - count, piped + count, True
            if piped:
                try:
                    count = os.splice(read_end, destination.fileno(), piped, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    count = 0
                if count:
                    piped, moved, last_write = piped - count, True, time.monotonic()
            if moved:
                continue
            now = time.monotonic()
            if (deadline is not None and now >= deadline) or now - last_write >= idle:
                raise TimeoutError("a forwarded response stalled")
            poller = select.poll()
            if left and piped < room:
                poller.register(source, select.POLLIN)
            if piped:
                poller.register(destination, select.POLLOUT)
            poller.poll(min(idle, 1.0) * 1000)
    finally:
        os.close(read_end)
        os.close(write_end)
        source.settimeout(timeouts[0])
        destination.settimeout(timeouts[1])
