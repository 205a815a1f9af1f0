"""Tags and control messages of the grpc+verbs transport.

UCX tag (64 bits)::

    kind:4 | slot:20 | transfer:24 | index:16

``slot`` names a client connection (assigned by the server at hello),
``transfer`` one call of that client, ``index`` a buffer of the call.
Kinds: REQUEST / RESPONSE control messages, GO (the server accepts a
request's bulk buffers), REQUEST_DATA / RESPONSE_DATA bulk buffers.

Control message: an envelope (``clusterwire.envelope``) with the fields::

    magic "CWV1" | status u32 | key 8 bytes

``key`` is the secret of the client's slot (handed out by the authenticated
gRPC hello): a request with a wrong key is dropped. ``status`` 0 is a normal
frame; otherwise the frame failed in the transport and ``header`` is the UTF-8
error message. A BULK buffer is sent as its own UCX message. The C helper
(``_ucp.c``) has the same ``encode`` and ``decode``, byte for byte and error
for error (``tests/envelope_vectors.json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from clusterwire.envelope import BULK, Layout, inline_kinds, split_inline

REQUEST, RESPONSE, GO, REQUEST_DATA, RESPONSE_DATA = 1, 2, 3, 4, 5
KIND_MASK = 0xF << 60
CALL_MASK = (1 << 64) - (1 << 16)  # everything but the buffer index
MAX_SLOTS = 1 << 20
MAX_TRANSFERS = 1 << 24
KEY_BYTES = 8
NO_KEY = bytes(KEY_BYTES)
#: Fields (status, key).
LAYOUT = Layout(b"CWV1", "grpc+verbs", f"I{KEY_BYTES}s")


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


def encode(header: bytes, buffers: Sequence[Any], threshold: int, budget: int,
           key: bytes = NO_KEY, status: int = 0) -> tuple[bytes, list[int]]:
    """A control message and the indices of its BULK buffers (each sent as its own message).

    Which buffers ride inline: ``clusterwire.envelope.inline_kinds``.
    """
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    kinds = inline_kinds(views, threshold, budget)
    message = LAYOUT.encode((status, key), header, views, kinds)
    return message, [index for index, kind in enumerate(kinds) if kind == BULK]


def encode_error(code: int, message: str) -> bytes:
    """A control message reporting a transport-level failure."""
    return encode(message.encode(), (), 0, 0, status=code)[0]


def decode(message: memoryview | bytes, limit: int) -> Control:
    """Parse and validate a control message before any bulk buffer is accepted."""
    envelope = LAYOUT.decode(message, limit)
    status, key = envelope.fields
    return Control(status, key, envelope.header, envelope.kinds, envelope.lengths,
                   split_inline(envelope))
