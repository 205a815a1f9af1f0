"""The segment data plane of grpc+local: which buffers travel how, and how they arrive.

``plan_buffers`` decides which buffers of a frame go inline and which in sealed memfd
segments (a buffer of a segment received earlier is re-sent by its descriptor);
``received_buffers`` makes a received control message's buffers again, as read-only
views. Under TLS the descriptors travel on a *segment connection* (``SegmentPeer``) beside
the gRPC call and wait in its ``Inbox`` until the call that names them claims them.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from clusterwire import errors
from clusterwire.envelope import BULK, INLINE, Envelope, inline_kinds
from clusterwire.transports.local import sealed, unix, wire


class Inbox:
    """Descriptors received on one Unix connection, by transfer id, until claimed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[int, list[int]] = {}
        self._closed = False

    def add(self, ident: int, fds: list[int]) -> None:
        """Hold ``fds`` for transfer ``ident`` (closing them if too many are held)."""
        with self._cond:
            held = sum(len(v) for v in self._items.values())
            if self._closed or held + len(fds) > unix.MAX_HELD_FDS:
                unix.close_all(fds)
                raise errors.ResourceExhaustedError("Too many unclaimed segments.")
            self._items.setdefault(ident, []).extend(fds)
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """True once the connection closed."""
        return self._closed

    def take(self, ident: int, count: int, timeout: float) -> list[int]:
        """The ``count`` descriptors of transfer ``ident``, waiting up to ``timeout`` s."""
        with self._cond:
            arrived = self._cond.wait_for(
                lambda: self._closed or len(self._items.get(ident, ())) >= count, timeout)
            if self._closed:
                raise errors.UnavailableError("The shared-memory connection closed.")
            if not arrived:
                raise errors.DeadlineExceededError(
                    f"{count} shared-memory segment(s) of transfer {ident} did not arrive.")
            fds = self._items.pop(ident)
        if len(fds) != count:
            unix.close_all(fds)
            raise errors.InvalidArgumentError("More segments than the frame declares.")
        return fds

    def close(self) -> None:
        """Close every held descriptor; later ``take`` calls fail."""
        with self._cond:
            self._closed = True
            for fds in self._items.values():
                unix.close_all(fds)
            self._items.clear()
            self._cond.notify_all()


class SegmentPeer:
    """One segment connection past its HELLO: a reader thread filling an inbox, and a
    locked sender. Only SEGMENTS messages may follow; anything else closes the connection."""

    def __init__(self, sock: socket.socket, client_id: int = 0,
                 on_close: Callable[[SegmentPeer], None] | None = None, peer: str = ""):
        """``peer``: on a listener, who the client is (``unix.peer_name``), for the requests
        whose segments this connection brings."""
        self.sock = sock
        self.peer = peer
        self._on_close = on_close
        self.inbox = Inbox()
        self._send_lock = threading.Lock()
        self.client_id = client_id
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="clusterwire-local-unix")
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                message, fds, _, _ = socket.recv_fds(self.sock, wire.MAX_UNIX_MESSAGE,
                                                     wire.MAX_FDS_PER_MESSAGE)
                try:
                    op, ident, count, _ = wire.decode_unix(message)
                    if op != wire.SEGMENTS or count != len(fds):
                        raise errors.InvalidArgumentError("not a SEGMENTS message")
                except errors.OpError:  # also the empty message of a closed connection
                    unix.close_all(fds)
                    break
                self.inbox.add(ident, fds)
        except (OSError, errors.OpError):
            pass
        self.close()

    def send(self, op: int, ident: int, fds: Sequence[int] = (), payload: bytes = b"") -> None:
        """Send one message (several, each with its share of ``fds``, past the limit)."""
        with self._send_lock:
            if not fds:
                self.sock.sendmsg([wire.encode_unix(op, ident, 0, payload)])
            for start in range(0, len(fds), wire.MAX_FDS_PER_MESSAGE):
                part = list(fds[start:start + wire.MAX_FDS_PER_MESSAGE])
                socket.send_fds(self.sock, [wire.encode_unix(op, ident, len(part))], part)

    def send_segments(self, ident: int, fds: list[int]) -> None:
        """Send the planned descriptors of transfer ``ident`` (then close our copies)."""
        try:
            if fds:
                self.send(wire.SEGMENTS, ident, fds)
        finally:
            unix.close_all(fds)

    def close(self) -> None:
        """Close the connection and the inbox; tell ``on_close`` once."""
        self.inbox.close()
        unix.shutdown(self.sock)
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close(self)


def plan_buffers(buffers: Sequence[Any], threshold: int,
                 pack: Callable[[list[memoryview]], tuple[int, list[int]]]
                 = sealed.create_packed
                 ) -> tuple[list[memoryview], list[int], list[tuple[int, int]] | None,
                            list[int]]:
    """How a frame's buffers travel: (views, kinds, (segment, offset) places, descriptors).

    Small buffers go inline (``inline_kinds``: under ``threshold`` bytes, within the
    inline budget). A buffer lying in a segment received
    earlier is re-sent by that segment's descriptor; the other bulk buffers are packed
    into one segment by ``pack`` (a new sealed one; a listener's replies: its connection's
    ``pool.ReplyPool.pack``). The caller owns (and closes) the descriptors.
    """
    views = [memoryview(b).cast("B") for b in buffers]
    kinds = inline_kinds(views, threshold)
    if BULK not in kinds:  # the common small frame: no segment to look for
        return views, kinds, None, []
    places: list[tuple[int, int]] = []
    fds: list[int] = []
    segments: dict[int, int] = {}  # id(mapping) -> its index in fds
    to_pack: list[int] = []
    try:
        for index, (buffer, kind) in enumerate(zip(buffers, kinds, strict=True)):
            if kind == INLINE:
                places.append((0, 0))
                continue
            found = sealed.locate(buffer)
            if found is None:
                to_pack.append(index)
                places.append((0, 0))
                continue
            mapping, offset = found
            if id(mapping) not in segments:
                segments[id(mapping)] = len(fds)
                fds.append(os.dup(mapping.fd))
            places.append((segments[id(mapping)], offset))
        if to_pack:
            fd, offsets = pack([views[i] for i in to_pack])
            fds.append(fd)
            for index, offset in zip(to_pack, offsets, strict=True):
                places[index] = (len(fds) - 1, offset)
    except BaseException:
        unix.close_all(fds)
        raise
    return views, kinds, places, fds


def check_descriptors(control: Envelope, fds: Sequence[int]) -> None:
    """InvalidArgumentError unless ``fds`` are as many as the segments ``control`` names."""
    if wire.segments(control) != len(fds):
        raise errors.InvalidArgumentError(
            f"Malformed frame: {len(fds)} segment descriptors, the frame refers to "
            f"{wire.segments(control)}.")


def received_buffers(control: Envelope, fds: list[int],
                     release: Callable[[int], None] | None = None) -> list[Any]:
    """The buffers of a control message: inline slices and views of mapped segments.

    Takes ``fds`` (each one mapped and closed; on failure the rest are closed). With
    ``release`` (a client's replies), reusable segments are accepted too, and ``release``
    is called with each one's inode once nothing maps it (``sealed.open_segment``).
    """
    if not control.places and not fds:  # every buffer inline
        inline = control.inline.toreadonly()
        if len(control.lengths) == 1:
            return [inline]
        views, offset = [], 0
        for length in control.lengths:
            views.append(inline[offset:offset + length])
            offset += length
        return views
    segments = []
    try:
        while fds:
            segments.append(sealed.open_segment(fds.pop(0), release))
    except BaseException:
        unix.close_all(fds)
        raise
    buffers, offset = [], 0
    inline = control.inline.toreadonly()
    places = control.places or itertools.repeat((0, 0))  # none when every buffer is inline
    for kind, length, (segment, start) in zip(control.kinds, control.lengths, places,
                                               strict=False):
        if kind == INLINE:
            buffers.append(inline[offset:offset + length])
            offset += length
            continue
        if segment >= len(segments) or start + length > segments[segment].nbytes:
            raise errors.InvalidArgumentError(
                f"Malformed frame: buffer at segment {segment} offset {start} length {length} "
                "lies outside the received segments.")
        buffers.append(segments[segment][start:start + length])
    return buffers
