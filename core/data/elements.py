"""Elements <-> (ElementHeader, raw buffers), with optional compression.

An element is encoded once by the worker's producer thread with the core
codec (no pickle); a batch of elements travels as one response frame whose
buffers are the elements' buffers in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clusterwire import codec
from clusterwire.data import compression
from clusterwire.data.modes import COMPRESSION_AUTO, COMPRESSION_SNAPPY
from clusterwire.errors import InvalidArgumentError
from clusterwire.protos.data_service_pb2 import ElementHeader

# Elements smaller than this are never worth compressing under AUTO.
_AUTO_MIN_BYTES = 256

#: numpy dtype kinds that frameworks hold as tensors: bool, signed and unsigned ints,
#: floats, complex (the framework adapters convert these, leave the rest as they are).
NUMERIC_KINDS = frozenset("biufc")


@dataclass
class Encoded:
    """One element ready to send."""

    header: ElementHeader
    buffers: list[Any]
    nbytes: int


def encode(element: Any, mode: str) -> Encoded:
    """Encode ``element``; ``mode`` is a wire compression name (see modes)."""
    value, buffers = codec.encode(element)
    header = ElementHeader(value=value, num_buffers=len(buffers))
    views = [memoryview(b).cast("B") for b in buffers]
    size = sum(v.nbytes for v in views)
    forced = mode == COMPRESSION_SNAPPY
    if views and (forced or (mode == COMPRESSION_AUTO and size >= _AUTO_MIN_BYTES)):
        compressed = compression.compress(views, forced)
        if compressed is not None:
            block, header.codec = compressed
            header.compressed = True
            header.num_buffers = 1
            header.raw_lengths.extend(v.nbytes for v in views)
            return Encoded(header, [block], len(block))
    return Encoded(header, views, size)


def decode_all(headers: Sequence[ElementHeader], buffers: Sequence[Any]) -> list[Any]:
    """The elements of a response: ``headers`` with their buffers, in order."""
    elements, position = [], 0
    for header in headers:
        end = position + header.num_buffers
        if end > len(buffers):
            raise InvalidArgumentError(
                f"Malformed element batch: {len(buffers)} buffers, element needs {end}.")
        own = list(buffers[position:end])
        position = end
        if header.compressed:
            own = compression.decompress(own[0], header.raw_lengths, header.codec)
        elements.append(codec.decode(header.value, own))
    return elements
