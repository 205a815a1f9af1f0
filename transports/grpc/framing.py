"""How a frame travels in gRPC messages.

A frame's first gRPC message is an envelope (``clusterwire.envelope``) with the
fields::

    magic "CWF1" | bulk port u16 | 2 pad bytes | fetch id u64

With every buffer INLINE the envelope is the whole frame (small frames, one
unary call). Otherwise every buffer is BULK and travels as separate chunk
messages of raw bytes: after the envelope in an upload stream, or in a fetch
stream the receiver opens with the ``fetch id`` of the response (or, when the
response names a ``bulk port``, over that TCP port: see ``bulk``). The
envelope checks the declared sizes against the receiver's limit before any
allocation; a buffer is allocated when its first bytes arrive.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from clusterwire.buffers import receive_buffers
from clusterwire.envelope import BULK, Layout
from clusterwire.errors import InvalidArgumentError

#: Fields (bulk port, fetch id).
LAYOUT = Layout(b"CWF1", "grpc", "H2xQ")
_NO_FIELDS = (0, 0)


def buffer_views(buffers: Sequence) -> list[memoryview]:
    """Byte views of buffers (no copy)."""
    return [memoryview(b).cast("B") for b in buffers]


def encode_inline(header: bytes, views: Sequence[memoryview]) -> bytes:
    """One message holding the header and every buffer (byte views, as ``buffer_views``)."""
    return LAYOUT.encode(_NO_FIELDS, header, views)


def inline_parts(header: bytes, views: Sequence[memoryview]) -> list[memoryview]:
    """``encode_inline``'s message as parts to write one after the other (the buffers are
    not copied)."""
    return [memoryview(LAYOUT.encode_table(_NO_FIELDS, header, [v.nbytes for v in views])),
            *views]


def encode_bulk(header: bytes, lengths: Sequence[int], fetch_id: int = 0,
                bulk_port: int = 0) -> bytes:
    """The envelope of a frame whose buffers (of ``lengths``) all follow as chunks."""
    return LAYOUT.encode_table((bulk_port, fetch_id), header, lengths, [BULK] * len(lengths))


def chunks(views: Sequence[memoryview], chunk_bytes: int) -> Iterator[bytes]:
    """Buffers cut into messages of at most ``chunk_bytes`` (never spanning two buffers)."""
    for view in views:
        for start in range(0, view.nbytes, chunk_bytes):
            yield bytes(view[start:start + chunk_bytes])


def assemble(messages: Iterator[bytes], lengths: Sequence[int]) -> list[np.ndarray]:
    """Fill fresh buffers of ``lengths`` from chunk messages; InvalidArgumentError on mismatch.

    A buffer is taken when its first chunk arrives, so a frame that declares much and
    sends little holds what it sent (pages of a large buffer are committed as written).
    """
    buffers = []
    for length in lengths:
        target, filled = memoryview(receive_buffers.take(0)) if length == 0 else None, 0
        while filled < length:
            chunk = next(messages, None)
            if chunk is None:
                raise InvalidArgumentError(
                    f"Frame ended early: {filled} of {length} bytes of a buffer arrived.")
            if filled + len(chunk) > length:
                raise InvalidArgumentError("Malformed frame: a chunk overruns its buffer.")
            if target is None:
                target = memoryview(receive_buffers.take(length))
            target[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
        buffers.append(target.obj)
    if next(messages, None) is not None:
        raise InvalidArgumentError("Malformed frame: more data than the declared buffers.")
    return buffers
