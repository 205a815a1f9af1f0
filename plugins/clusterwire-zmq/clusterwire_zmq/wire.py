"""How a clusterwire frame travels as one zmq multipart message.

Part 0 starts with a fixed prefix::

    magic "CWZ1" | kind u8 | 3 pad | request id u64 | status u32 | header_len u32 |
    buffer count u32 | inline_max u32 | buffer lengths u64 * count | header | inline bytes

A buffer shorter than ``inline_max`` bytes is copied into part 0 after the header (one
small copy is cheaper than a zmq part of its own); every other buffer is a part of its
own, sent and received without copies. Kinds: ``REQUEST``; ``REPLY`` (``status`` 0, or
a clusterwire error code with the error message as the header); ``HELLO`` and
``WELCOME``, the handshake that proves the listener is alive and tells the client its
size limit (``WELCOME``'s header is the limit as u64).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from clusterwire.errors import InvalidArgumentError, ResourceExhaustedError

MAGIC = b"CWZ1"
REQUEST, REPLY, HELLO, WELCOME = 1, 2, 3, 4
_KINDS = (REQUEST, REPLY, HELLO, WELCOME)
_PREFIX = struct.Struct("<4sB3xQIIII")
_LIMIT = struct.Struct("<Q")
MAX_BUFFERS = 1 << 20
MAX_HEADER_BYTES = 64 << 20
#: Bytes of part 0 beyond its inline buffers: the largest prefix, lengths and header.
PART0_OVERHEAD = _PREFIX.size + 8 * MAX_BUFFERS + MAX_HEADER_BYTES


@dataclass
class Message:
    """A decoded message; ``buffers`` are views of the received zmq frames."""

    kind: int
    request_id: int
    status: int
    header: bytes
    buffers: list[memoryview]


def byte_views(buffers: Sequence) -> list[memoryview]:
    """Flat byte views of buffers (no copy)."""
    return [memoryview(b).cast("B") for b in buffers]


@functools.lru_cache(maxsize=64)
def _lengths(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}Q")


def encode(kind: int, request_id: int, header: bytes, views: Sequence[memoryview],
           inline_max: int, status: int = 0) -> list:
    """The parts of one message: part 0 (bytes), then each large buffer's view."""
    lengths, inline, separate = [], [], []
    for view in views:
        lengths.append(view.nbytes)
        (inline if view.nbytes < inline_max else separate).append(view)
    part0 = b"".join([
        _PREFIX.pack(MAGIC, kind, request_id, status, len(header), len(views), inline_max),
        _lengths(len(lengths)).pack(*lengths), header, *inline])
    return [part0, *separate]


def encode_error(request_id: int, code: int, message: str) -> list:
    """A REPLY carrying a clusterwire error instead of a frame."""
    return encode(REPLY, request_id, message.encode("utf-8", "replace"), [], 0, status=code)


def encode_welcome(request_id: int, limit: int) -> list:
    """The listener's answer to HELLO, announcing its ``max_message_bytes``."""
    return encode(WELCOME, request_id, _LIMIT.pack(limit), [], 0)


def welcome_limit(message: Message) -> int:
    """The size limit a WELCOME announces."""
    if len(message.header) != _LIMIT.size:
        raise InvalidArgumentError("Malformed WELCOME: its header is not a u64 limit.")
    return _LIMIT.unpack(message.header)[0]


def peek_request_id(part0) -> int:
    """The request id of a message that may be malformed (0 if it has none)."""
    view = memoryview(part0)
    if view.nbytes < _PREFIX.size or bytes(view[:4]) != MAGIC:
        return 0
    return _PREFIX.unpack_from(view)[2]


def decode(parts: Sequence, limit: int) -> Message:
    """Parse and check a message; InvalidArgumentError / ResourceExhaustedError if bad.

    ``parts`` are zmq frames (or any buffers). Buffer views share their memory: inline
    buffers are slices of part 0, large ones whole parts.
    """
    if not parts:
        raise InvalidArgumentError("Malformed message: no parts.")
    first = memoryview(parts[0]).cast("B")
    if first.nbytes < _PREFIX.size:
        raise InvalidArgumentError(
            f"Malformed message: {first.nbytes} bytes is shorter than a prefix.")
    magic, kind, request_id, status, header_len, count, inline_max = _PREFIX.unpack_from(first)
    if magic != MAGIC:
        raise InvalidArgumentError(
            f"Malformed message: bad magic {bytes(magic)!r} (not a clusterwire zmq peer?).")
    if kind not in _KINDS:
        raise InvalidArgumentError(f"Malformed message: unknown kind {kind}.")
    if count > MAX_BUFFERS or header_len > MAX_HEADER_BYTES:
        raise ResourceExhaustedError(
            f"Message declares {count} buffers and a {header_len}-byte header; the limits are "
            f"{MAX_BUFFERS} buffers and {MAX_HEADER_BYTES} header bytes.")
    offset = _PREFIX.size + 8 * count
    if first.nbytes < offset + header_len:
        raise InvalidArgumentError("Malformed message: truncated prefix.")
    lengths = _lengths(count).unpack_from(first, _PREFIX.size)
    if sum(lengths) > limit:
        raise ResourceExhaustedError(
            f"Frame of {sum(lengths)} bytes exceeds the limit of {limit} bytes "
            "(max_message_bytes).")
    header = bytes(first[offset:offset + header_len])
    return Message(kind, request_id, status, header,
                   _split(first, offset + header_len, lengths, inline_max, parts[1:]))


def _split(first: memoryview, offset: int, lengths: Sequence[int], inline_max: int,
           rest: Sequence) -> list[memoryview]:
    views, parts = [], iter(rest)
    for length in lengths:
        if length < inline_max:
            views.append(first[offset:offset + length])
            offset += length
            continue
        part = next(parts, None)
        if part is None:
            raise InvalidArgumentError(
                f"Malformed message: {len(rest)} buffer parts, declared more.")
        view = memoryview(part).cast("B")
        if view.nbytes != length:
            raise InvalidArgumentError(
                f"Malformed message: a {view.nbytes}-byte buffer part, declared {length}.")
        views.append(view)
    if offset != first.nbytes:
        raise InvalidArgumentError(
            f"Malformed message: {first.nbytes} bytes in the first part, the prefix declares "
            f"{offset}.")
    if next(parts, None) is not None:
        raise InvalidArgumentError(
            f"Malformed message: {len(rest)} buffer parts, declared fewer.")
    return views
