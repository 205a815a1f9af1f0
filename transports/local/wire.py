"""Message layouts of the grpc+local transport.

Control message (one gRPC unary call each way)::

    "CWL1" | header_len u32 | count u32 | client id u64 | transfer id u64 |
    (kind u8, length u64, segment u32, offset u64) * count | header | inline bytes

``kind`` 0: the buffer is inline (concatenated after the header); 1: it lies
in a sealed memfd segment, entry ``segment`` of the descriptors sent over the
peer's Unix socket under the transfer id, at ``offset`` (bulk buffers of one
frame are packed into one new segment; a buffer received earlier is re-sent
as its own segment's descriptor, never copied). Unix-socket messages
(SOCK_SEQPACKET, descriptors as SCM_RIGHTS)::

    "CWU1" | op u8 | id u64 | count u32 | payload
        HELLO: id = client id, payload = the cluster token (if any)
        SEGMENTS: id = transfer id, ``count`` descriptors attached
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from clusterwire.errors import InvalidArgumentError, ResourceExhaustedError

INLINE, SEGMENT = 0, 1
_CONTROL = struct.Struct("<4sIIQQ")
_ENTRY = struct.Struct("<BQIQ")
_UNIX = struct.Struct("<4sBQI")
HELLO, SEGMENTS = 1, 2
MAX_BUFFERS = 1 << 20
MAX_HEADER_BYTES = 64 << 20
MAX_FDS_PER_MESSAGE = 250  # below the kernel's SCM_MAX_FD (253)


@dataclass
class Control:
    """A decoded control message."""

    header: bytes
    kinds: list[int]
    lengths: list[int]
    places: list[tuple[int, int]]  # (segment, offset) of SEGMENT buffers
    client_id: int
    transfer_id: int
    inline: memoryview
    segments: int  # descriptors the SEGMENT buffers refer to (highest index + 1)


def encode_control(header: bytes, kinds: Sequence[int], views: Sequence[memoryview],
                   places: Sequence[tuple[int, int]], client_id: int, transfer_id: int) -> bytes:
    """A control message; only INLINE buffers' bytes are included."""
    parts = [_CONTROL.pack(b"CWL1", len(header), len(views), client_id, transfer_id)]
    inline = []
    for kind, view, (segment, offset) in zip(kinds, views, places, strict=True):
        parts.append(_ENTRY.pack(kind, view.nbytes, segment, offset))
        if kind == INLINE:
            inline.append(view)
    parts.append(header)
    parts += inline
    return b"".join(parts)


def decode_control(message: bytes, limit: int) -> Control:
    """Parse and validate a control message before anything is allocated."""
    if len(message) < _CONTROL.size:
        raise InvalidArgumentError(f"Malformed frame: {len(message)} bytes is too short.")
    magic, header_len, count, client_id, transfer_id = _CONTROL.unpack_from(message)
    if magic != b"CWL1":
        raise InvalidArgumentError(f"Malformed frame: bad magic {magic!r}.")
    if count > MAX_BUFFERS or header_len > MAX_HEADER_BYTES:
        raise ResourceExhaustedError(f"Frame declares {count} buffers, {header_len} header bytes.")
    offset = _CONTROL.size + _ENTRY.size * count
    if len(message) < offset + header_len:
        raise InvalidArgumentError("Malformed frame: truncated.")
    kinds, lengths, places = [], [], []
    total = expected = segments = 0
    view = memoryview(message)
    for kind, length, segment, start in _ENTRY.iter_unpack(view[_CONTROL.size:offset]):
        if kind == INLINE:
            expected += length
        elif kind == SEGMENT:
            segments = max(segments, segment + 1)
        else:
            raise InvalidArgumentError(f"Malformed frame: buffer kind {kind}.")
        total += length
        kinds.append(kind)
        lengths.append(length)
        places.append((segment, start))
    if total > limit:
        raise ResourceExhaustedError(
            f"Frame of {total} bytes exceeds the limit of {limit} bytes (max_message_bytes).")
    inline = view[offset + header_len:]
    if inline.nbytes != expected:
        raise InvalidArgumentError(
            f"Malformed frame: {inline.nbytes} inline bytes, declared {expected}.")
    header = bytes(view[offset:offset + header_len])
    return Control(header, kinds, lengths, places, client_id, transfer_id, inline, segments)


def encode_unix(op: int, ident: int, count: int, payload: bytes = b"") -> bytes:
    """A Unix-socket message (descriptors travel beside it)."""
    return _UNIX.pack(b"CWU1", op, ident, count) + payload


def decode_unix(message: bytes) -> tuple[int, int, int, bytes]:
    """(op, id, count, payload) of a Unix-socket message."""
    if len(message) < _UNIX.size:
        raise InvalidArgumentError("Malformed unix-socket message.")
    magic, op, ident, count = _UNIX.unpack_from(message)
    if magic != b"CWU1" or op not in (HELLO, SEGMENTS):
        raise InvalidArgumentError("Malformed unix-socket message.")
    return op, ident, count, message[_UNIX.size:]


MAX_UNIX_MESSAGE = _UNIX.size + 4096
