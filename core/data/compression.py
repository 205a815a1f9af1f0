"""Compression of element payloads, through cramjam (optional dependency).

cramjam (``pip install 'clusterwire[data]'``) is a maintained binding of the
Rust snappy and lz4 implementations: wheels for every platform, no other
dependencies, and ``*_into`` calls that decompress straight into a
preallocated buffer. Each compressed element is one raw block (no framing).

"SNAPPY" compresses with snappy, as TF. "AUTO" leaves the codec to the
runtime, as in TF; clusterwire uses lz4, which on this kind of data
compresses about 1.7x and decompresses about 6x faster than snappy at a
similar or better ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clusterwire.buffers import receive_buffers, split
from clusterwire.errors import FailedPreconditionError, InvalidArgumentError

try:
    import cramjam
except ImportError:  # pragma: no cover - exercised only without the extra
    cramjam = None

# Codec names as they travel in ElementHeader.codec ("" is snappy, the first codec).
SNAPPY, LZ4 = "", "lz4"
# AUTO keeps a compressed element only when it saves at least this share of its bytes.
_AUTO_MIN_SAVING = 0.125


def available() -> bool:
    """Whether compression can be used in this process."""
    return cramjam is not None


def require() -> None:
    """FailedPreconditionError if snappy is unavailable here."""
    if cramjam is None:
        raise FailedPreconditionError(
            "compression='SNAPPY' needs cramjam: pip install 'clusterwire[data]' (or use "
            "compression=None).")


def compress(views: Sequence[memoryview], forced: bool) -> tuple[Any, str] | None:
    """(block, codec) of the concatenated ``views``: snappy when ``forced``, else lz4, or
    None when AUTO finds it not worth it."""
    raw = views[0] if len(views) == 1 else b"".join(views)
    if forced:
        return cramjam.snappy.compress_raw(raw), SNAPPY
    block = cramjam.lz4.compress_block(raw)  # size-prefixed: older cramjams need it
    if len(block) > sum(v.nbytes for v in views) * (1 - _AUTO_MIN_SAVING):
        return None
    return block, LZ4


def decompress(block: Any, lengths: Sequence[int], codec: str = SNAPPY) -> list[memoryview]:
    """The buffers of ``lengths`` bytes that ``block`` holds (writable, one pooled buffer)."""
    if cramjam is None:
        raise FailedPreconditionError(
            "Received compressed elements but cramjam is not installed: "
            "pip install 'clusterwire[data]'.")
    if codec not in (SNAPPY, LZ4):
        raise InvalidArgumentError(f"Unknown element compression codec {codec!r}.")
    total = sum(lengths)
    out = receive_buffers.take(total)  # warm pages: a fresh MiB costs as much as decompressing
    source = memoryview(block).cast("B")
    try:
        if codec == LZ4:
            written = cramjam.lz4.decompress_block_into(source, out)
        else:
            written = cramjam.snappy.decompress_raw_into(source, out)
    except Exception as err:  # cramjam raises its own DecompressionError
        raise InvalidArgumentError(f"Corrupt compressed element: {err}") from None
    if written != total:
        raise InvalidArgumentError(
            f"Corrupt compressed element: {written} bytes, expected {total}.")
    return split(memoryview(out), lengths)
