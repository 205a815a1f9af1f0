"""How a frame (header + buffers) is laid out in gRPC messages.

One gRPC message starts with a fixed prefix::

    magic "CWF1" | flags u8 | pad u8 | bulk port u16 | header_len u32 |
    buffer count u32 | fetch id u64 | buffer lengths u64 * count | header bytes |
    [inline data]

``INLINE``: the buffers follow, concatenated, in the same message (small
frames, one unary call). Otherwise the buffers travel as separate chunk
messages of raw bytes: after the prefix message in an upload stream, or in
a fetch stream the receiver opens with the ``fetch id`` of a ``CONTINUED``
response (or, when the response names a ``bulk port``, over that TCP port:
see ``bulk``). Lengths are checked against the receiver's limit before any
allocation.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from clusterwire.buffers import receive_buffers, split
from clusterwire.errors import InvalidArgumentError, ResourceExhaustedError

MAGIC = b"CWF1"
INLINE = 1
CONTINUED = 2
_PREFIX = struct.Struct("<4sBxHIIQ")
MAX_BUFFERS = 1 << 20
MAX_HEADER_BYTES = 64 << 20


class Prefix(NamedTuple):
    """The decoded fixed part of a framed message (a tuple: cheap on the hot path)."""

    flags: int
    header: bytes
    lengths: list[int]
    fetch_id: int
    body_offset: int
    bulk_port: int


def buffer_views(buffers: Sequence) -> list[memoryview]:
    """Byte views of buffers (no copy)."""
    return [memoryview(b).cast("B") for b in buffers]


@functools.lru_cache(maxsize=64)
def _lengths(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}Q")


def encode_prefix(header: bytes, lengths: Sequence[int], flags: int, fetch_id: int = 0,
                  bulk_port: int = 0) -> bytes:
    """The prefix of a framed message (without inline data)."""
    return b"".join((_PREFIX.pack(MAGIC, flags, bulk_port, len(header), len(lengths), fetch_id),
                     _lengths(len(lengths)).pack(*lengths), header))


def encode_inline(header: bytes, views: Sequence[memoryview]) -> bytes:
    """One message holding the header and every buffer (byte views, as ``buffer_views``)."""
    if not views:
        return _PREFIX.pack(MAGIC, INLINE, 0, len(header), 0, 0) + header
    count = len(views)
    return b"".join([_PREFIX.pack(MAGIC, INLINE, 0, len(header), count, 0),
                     _lengths(count).pack(*map(len, views)), header, *views])


def decode_prefix(message: bytes, limit: int) -> Prefix:
    """Parse and validate a prefix; InvalidArgumentError / ResourceExhaustedError if bad."""
    if len(message) < _PREFIX.size:
        raise InvalidArgumentError(
            f"Malformed frame: {len(message)} bytes is shorter than a prefix.")
    magic, flags, bulk_port, header_len, count, fetch_id = _PREFIX.unpack_from(message)
    if magic != MAGIC:
        raise InvalidArgumentError(
            f"Malformed frame: bad magic {magic!r} (not a clusterwire peer?).")
    if count > MAX_BUFFERS or header_len > MAX_HEADER_BYTES:
        raise ResourceExhaustedError(
            f"Frame declares {count} buffers and a {header_len}-byte header; the limits are "
            f"{MAX_BUFFERS} buffers and {MAX_HEADER_BYTES} header bytes.")
    offset = _PREFIX.size + 8 * count
    if len(message) < offset + header_len:
        raise InvalidArgumentError("Malformed frame: truncated prefix.")
    lengths = list(_lengths(count).unpack_from(message, _PREFIX.size))
    total = sum(lengths)
    if total > limit:
        raise ResourceExhaustedError(
            f"Frame of {total} bytes exceeds the limit of {limit} bytes (max_message_bytes).")
    header = bytes(message[offset:offset + header_len])
    return Prefix(flags, header, lengths, fetch_id, offset + header_len, bulk_port)


def split_inline(message: bytes, prefix: Prefix) -> list[memoryview]:
    """Writable views of the inline buffers of ``message`` (one copy of the body)."""
    lengths = prefix.lengths
    if len(message) - prefix.body_offset != sum(lengths):
        raise InvalidArgumentError(
            f"Malformed frame: {len(message) - prefix.body_offset} inline bytes, declared "
            f"{sum(lengths)}.")
    if not lengths:
        return []
    whole = memoryview(bytearray(memoryview(message)[prefix.body_offset:]))
    return [whole] if len(lengths) == 1 else split(whole, lengths)


def chunks(views: Sequence[memoryview], chunk_bytes: int) -> Iterator[bytes]:
    """Buffers cut into messages of at most ``chunk_bytes`` (never spanning two buffers)."""
    for view in views:
        for start in range(0, view.nbytes, chunk_bytes):
            yield bytes(view[start:start + chunk_bytes])


def assemble(messages: Iterator[bytes], lengths: Sequence[int]) -> list[np.ndarray]:
    """Fill fresh buffers of ``lengths`` from chunk messages; InvalidArgumentError on mismatch."""
    buffers = [receive_buffers.take(length) for length in lengths]
    for buffer in buffers:
        filled, target = 0, memoryview(buffer)
        while filled < buffer.nbytes:
            chunk = next(messages, None)
            if chunk is None:
                raise InvalidArgumentError(
                    f"Frame ended early: {filled} of {buffer.nbytes} bytes of a buffer arrived.")
            if filled + len(chunk) > buffer.nbytes:
                raise InvalidArgumentError("Malformed frame: a chunk overruns its buffer.")
            target[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
    if next(messages, None) is not None:
        raise InvalidArgumentError("Malformed frame: more data than the declared buffers.")
    return buffers
