"""How a clusterwire frame travels as one zmq multipart message.

Part 0 is an envelope (``clusterwire.envelope``) with the fields::

    magic "CWZ1" | kind u8 | 3 pad bytes | request id u64 | status u32

Its INLINE buffers (those under the ``inline_bytes`` option, within the envelope's
inline budget: one small copy is cheaper than a zmq part of its own) follow the
header in part 0; every BULK buffer is a part of its own, in order, sent and received
without copies. Kinds: ``REQUEST``; ``REPLY`` (``status`` 0, or a clusterwire error
code with the error message as the header); ``HELLO`` and ``WELCOME``, the handshake
that proves the listener is alive and tells the client its size limit (``WELCOME``'s
header is the limit as u64).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import NamedTuple

from clusterwire.envelope import (
    BULK,
    MAX_BUFFERS,
    Layout,
    bulk_lengths,
    inline_kinds,
    interleave,
    split_inline,
)
from clusterwire.errors import InvalidArgumentError

MAGIC = b"CWZ1"
REQUEST, REPLY, HELLO, WELCOME = 1, 2, 3, 4
_KINDS = (REQUEST, REPLY, HELLO, WELCOME)
#: Fields (kind, request id, status).
LAYOUT = Layout(MAGIC, "zmq", "B3xQI")
_LIMIT = struct.Struct("<Q")
#: Bytes of part 0 beyond its inline buffers: the largest prefix, buffer table and header.
PART0_OVERHEAD = LAYOUT.max_bytes(0)
#: The most parts a message has: part 0 and a part per BULK buffer.
MAX_PARTS = 1 + MAX_BUFFERS


class Message(NamedTuple):
    """A decoded message; ``buffers`` are views of the received zmq frames."""

    kind: int
    request_id: int
    status: int
    header: bytes
    buffers: list[memoryview]


#: Builds a Message from one tuple without NamedTuple's Python-level ``__new__``.
_new_message = functools.partial(tuple.__new__, Message)


def byte_views(buffers: Sequence) -> list[memoryview]:
    """Flat byte views of buffers (no copy)."""
    return [memoryview(b).cast("B") for b in buffers]


def encode(kind: int, request_id: int, header: bytes, views: Sequence[memoryview],
           inline_max: int, status: int = 0) -> list:
    """The parts of one message: part 0 (bytes), then each BULK buffer's view."""
    kinds = inline_kinds(views, inline_max)
    part0 = LAYOUT.encode((kind, request_id, status), header, views, kinds)
    if BULK not in kinds:
        return [part0]
    return [part0, *(view for view, k in zip(views, kinds, strict=True) if k == BULK)]


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
    fields = LAYOUT.peek_fields(part0)
    return 0 if fields is None else fields[1]


def decode(parts: Sequence, limit: int) -> Message:
    """Parse and check a message; InvalidArgumentError / ResourceExhaustedError if bad.

    ``parts`` are zmq frames (or any buffers). Buffer views share their memory: inline
    buffers are slices of part 0, BULK ones whole parts.
    """
    if not parts:
        raise InvalidArgumentError("Malformed message: no parts.")
    envelope = LAYOUT.decode(parts[0], limit)
    kind, request_id, status = envelope.fields
    if kind not in _KINDS:
        raise InvalidArgumentError(f"Malformed message: unknown kind {kind}.")
    inline = split_inline(envelope, copy=False)
    if len(parts) == 1 and BULK not in envelope.kinds:
        return _new_message((kind, request_id, status, envelope.header, inline))
    lengths = bulk_lengths(envelope)
    if len(parts) - 1 != len(lengths):
        raise InvalidArgumentError(
            f"Malformed message: {len(parts) - 1} buffer parts, declared {len(lengths)}.")
    bulk = [memoryview(part).cast("B") for part in parts[1:]]
    for view, length in zip(bulk, lengths, strict=True):
        if view.nbytes != length:
            raise InvalidArgumentError(
                f"Malformed message: a {view.nbytes}-byte buffer part, declared {length}.")
    return _new_message((kind, request_id, status, envelope.header,
                         interleave(envelope.kinds, inline, bulk)))
