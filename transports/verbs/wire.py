"""Tags and control messages of the grpc+verbs transport.

UCX tag (64 bits)::

    kind:4 | slot:20 | transfer:24 | index:16

``slot`` names a client connection (assigned by the server at hello),
``transfer`` one call of that client, ``index`` a buffer of the call.
Kinds: REQUEST / RESPONSE control messages, GO (the server accepts a
request's bulk buffers), REQUEST_DATA / RESPONSE_DATA bulk buffers.

Control message::

    "CWV1" | status u32 | header_len u32 | count u32 | key 8 bytes |
    (kind u8, length u64) * count | header | inline bytes

``key`` is the secret of the client's slot (handed out by the authenticated
gRPC hello): a request with a wrong key is dropped. ``status`` 0 is a normal
frame; otherwise the frame failed in the transport and ``header`` is the UTF-8
error message. ``kind`` 0 is an inline buffer,
1 a bulk buffer sent as its own UCX message.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from clusterwire.errors import InvalidArgumentError, ResourceExhaustedError

REQUEST, RESPONSE, GO, REQUEST_DATA, RESPONSE_DATA = 1, 2, 3, 4, 5
INLINE, BULK = 0, 1
KIND_MASK = 0xF << 60
CALL_MASK = (1 << 64) - (1 << 16)  # everything but the buffer index
MAX_SLOTS = 1 << 20
MAX_TRANSFERS = 1 << 24
MAX_BULK = 1 << 16
MAX_HEADER_BYTES = 64 << 20
_PREFIX = struct.Struct("<4sIII8s")
_LAYOUTS: dict[int, struct.Struct] = {}  # buffer count -> Struct of prefix and entries
KEY_BYTES = 8


def tag(kind: int, slot: int, transfer: int, index: int = 0) -> int:
    """The UCX tag of one message."""
    return kind << 60 | slot << 40 | transfer << 16 | index


def split_tag(value: int) -> tuple[int, int, int, int]:
    """(kind, slot, transfer, index) of a tag."""
    return value >> 60, (value >> 40) & 0xFFFFF, (value >> 16) & 0xFFFFFF, value & 0xFFFF


@dataclass(slots=True)
class Control:
    """A decoded control message."""

    status: int
    key: bytes
    header: bytes
    kinds: tuple[int, ...]
    lengths: tuple[int, ...]
    inline: memoryview


def _layout(count: int) -> struct.Struct:
    """The Struct of a control message's prefix and ``count`` entries (one pass each way)."""
    layout = _LAYOUTS.get(count)
    if layout is None:
        layout = struct.Struct(_PREFIX.format + "BQ" * count)
        if count <= 64:
            _LAYOUTS[count] = layout
    return layout


def encode(header: bytes, kinds: Sequence[int], views: Sequence[memoryview],
           key: bytes = bytes(KEY_BYTES), status: int = 0) -> bytes:
    """A control message carrying the INLINE buffers' bytes."""
    entries: list[int] = []
    parts: list[bytes | memoryview] = [b"", header]  # the prefix goes first, once packed
    for kind, view in zip(kinds, views, strict=True):
        entries += (kind, view.nbytes)
        if kind == INLINE:
            parts.append(view)
    parts[0] = _layout(len(views)).pack(b"CWV1", status, len(header), len(views), key, *entries)
    return b"".join(parts)


def encode_error(code: int, message: str) -> bytes:
    """A control message reporting a transport-level failure."""
    return encode(message.encode(), (), (), status=code)


def decode(message: memoryview | bytes, limit: int) -> Control:
    """Parse and validate a control message before any bulk buffer is accepted."""
    message = memoryview(message).cast("B")
    if message.nbytes < _PREFIX.size:
        raise InvalidArgumentError(f"Malformed frame: {message.nbytes} bytes is too short.")
    magic, status, header_len, count, key = _PREFIX.unpack_from(message)
    if magic != b"CWV1":
        raise InvalidArgumentError(f"Malformed frame: bad magic {bytes(magic)!r}.")
    if count > MAX_BULK or header_len > MAX_HEADER_BYTES:
        raise ResourceExhaustedError(f"Frame declares {count} buffers, {header_len} header bytes.")
    layout = _layout(count)
    if message.nbytes < layout.size + header_len:
        raise InvalidArgumentError("Malformed frame: truncated.")
    fields = layout.unpack_from(message)
    kinds, lengths = fields[5::2], fields[6::2]
    if kinds and max(kinds) > BULK:
        raise InvalidArgumentError(f"Malformed frame: buffer kind {max(kinds)}.")
    total = sum(lengths)
    if total > limit:
        raise ResourceExhaustedError(
            f"Frame of {total} bytes exceeds the limit of {limit} bytes (max_message_bytes).")
    start = layout.size + header_len
    inline = message[start:]
    expected = total
    if BULK in kinds:
        expected = sum(n for k, n in zip(kinds, lengths, strict=True) if k == INLINE)
    if inline.nbytes != expected:
        raise InvalidArgumentError(
            f"Malformed frame: {inline.nbytes} inline bytes, declared {expected}.")
    return Control(status, key, bytes(message[layout.size:start]), kinds, lengths, inline)
