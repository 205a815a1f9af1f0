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
gRPC hello): a request with a wrong key is dropped. The C helper (``_ucp.c``)
has the same ``encode`` and ``decode``, byte for byte. ``status`` 0 is a normal
frame; otherwise the frame failed in the transport and ``header`` is the UTF-8
error message. ``kind`` 0 is an inline buffer,
1 a bulk buffer sent as its own UCX message.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from clusterwire.errors import InvalidArgumentError, ResourceExhaustedError
from clusterwire.transport import inline_mask

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
NO_KEY = bytes(KEY_BYTES)


def tag(kind: int, slot: int, transfer: int, index: int = 0) -> int:
    """The UCX tag of one message."""
    return kind << 60 | slot << 40 | transfer << 16 | index


def split_tag(value: int) -> tuple[int, int, int, int]:
    """(kind, slot, transfer, index) of a tag."""
    return value >> 60, (value >> 40) & 0xFFFFF, (value >> 16) & 0xFFFFFF, value & 0xFFFF


class Control(NamedTuple):
    """A decoded control message (``decode``; the C helper's is a plain tuple of the same)."""

    status: int
    key: bytes
    header: bytes
    kinds: tuple[int, ...]
    lengths: tuple[int, ...]
    #: A writable copy of each INLINE buffer, in order.
    inline: list[memoryview]


def _layout(count: int) -> struct.Struct:
    """The Struct of a control message's prefix and ``count`` entries (one pass each way)."""
    layout = _LAYOUTS.get(count)
    if layout is None:
        layout = struct.Struct(_PREFIX.format + "BQ" * count)
        if count <= 64:
            _LAYOUTS[count] = layout
    return layout


def encode(header: bytes, buffers: Sequence[Any], threshold: int, budget: int,
           key: bytes = NO_KEY, status: int = 0) -> tuple[bytes, list[int]]:
    """A control message and the indices of its BULK buffers (each sent as its own message).

    Which buffers ride inline: ``clusterwire.transport.inline_mask``.
    """
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    entries: list[int] = []
    parts: list[bytes | memoryview] = [b"", header]  # the prefix goes first, once packed
    bulk: list[int] = []
    for index, (view, small) in enumerate(zip(views, inline_mask(views, threshold, budget),
                                              strict=True)):
        entries += (INLINE if small else BULK, view.nbytes)
        if small:
            parts.append(view)
        else:
            bulk.append(index)
    parts[0] = _layout(len(views)).pack(b"CWV1", status, len(header), len(views), key, *entries)
    return b"".join(parts), bulk


def encode_error(code: int, message: str) -> bytes:
    """A control message reporting a transport-level failure."""
    return encode(message.encode(), (), 0, 0, status=code)[0]


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
    copies, offset = [], 0
    whole = memoryview(bytearray(inline))
    for kind, length in zip(kinds, lengths, strict=True):
        if kind == INLINE:
            copies.append(whole[offset:offset + length])
            offset += length
    return Control(status, key, bytes(message[layout.size:start]), kinds, lengths, copies)
