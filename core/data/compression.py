"""Snappy compression of element payloads, through cramjam (optional dependency).

cramjam (``pip install 'clusterwire[data]'``) is a maintained binding of the
Rust snappy implementations: wheels for every platform, no other dependencies,
and ``*_into`` calls that decompress straight into a preallocated buffer.
Raw (unframed) snappy is used: each element is one block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clusterwire.buffers import receive_buffers
from clusterwire.errors import FailedPreconditionError, InvalidArgumentError

try:
    import cramjam
except ImportError:  # pragma: no cover - exercised only without the extra
    cramjam = None

# AUTO keeps a compressed element only when it saves at least this share of its bytes.
_AUTO_MIN_SAVING = 0.125


def available() -> bool:
    """Whether snappy compression can be used in this process."""
    return cramjam is not None


def require() -> None:
    """FailedPreconditionError if snappy is unavailable here."""
    if cramjam is None:
        raise FailedPreconditionError(
            "compression='SNAPPY' needs cramjam: pip install 'clusterwire[data]' (or use "
            "compression=None).")


def compress(views: Sequence[memoryview], forced: bool) -> Any | None:
    """One snappy block of the concatenated ``views``; None when AUTO finds it not worth it."""
    raw = views[0] if len(views) == 1 else b"".join(views)
    block = cramjam.snappy.compress_raw(raw)
    size = sum(v.nbytes for v in views)
    if not forced and len(block) > size * (1 - _AUTO_MIN_SAVING):
        return None
    return block


def decompress(block: Any, lengths: Sequence[int]) -> list[memoryview]:
    """The buffers of ``lengths`` bytes that ``block`` holds (writable, one pooled buffer)."""
    if cramjam is None:
        raise FailedPreconditionError(
            "Received snappy-compressed elements but cramjam is not installed: "
            "pip install 'clusterwire[data]'.")
    total = sum(lengths)
    out = receive_buffers.take(total)  # warm pages: a fresh MiB costs as much as decompressing
    try:
        written = cramjam.snappy.decompress_raw_into(memoryview(block).cast("B"), out)
    except Exception as err:  # cramjam raises its own DecompressionError
        raise InvalidArgumentError(f"Corrupt compressed element: {err}") from None
    if written != total:
        raise InvalidArgumentError(
            f"Corrupt compressed element: {written} bytes, expected {total}.")
    whole = memoryview(out)
    views, offset = [], 0
    for length in lengths:
        views.append(whole[offset:offset + length])
        offset += length
    return views
