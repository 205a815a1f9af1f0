"""Values <-> (a ``Value`` protobuf header, a list of raw buffers).

Supported values: numpy arrays of every dtype except ``object`` (any shape,
0-d, empty, non-contiguous), numpy scalars, bytes/bytearray/memoryview, str,
int, float, bool, None, and lists, tuples and dicts of these. No pickle:
tensor and bytes payloads become raw buffers referenced by index, so they
never pass through a protobuf field.
"""

from __future__ import annotations

import ast
import functools
from typing import Any

import numpy as np

from clusterwire.errors import InvalidArgumentError
from clusterwire.protos.service_pb2 import Value

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

Buffer = Any  # any object supporting the buffer protocol


@functools.lru_cache(maxsize=512)
def _dtype_text(dtype: np.dtype) -> str:
    if dtype.hasobject:
        raise InvalidArgumentError(
            f"Cannot send a numpy array of dtype {dtype}: object arrays would need pickle. "
            "Convert it to a fixed-size dtype (e.g. str -> 'U', bytes -> 'S') first.")
    if dtype.fields is None and dtype.subdtype is None:
        return dtype.str
    return repr(np.lib.format.dtype_to_descr(dtype))


@functools.lru_cache(maxsize=512)
def _parse_dtype(text: str) -> np.dtype:
    try:
        descr = ast.literal_eval(text) if text[:1] in "[(" else text
        dtype = np.lib.format.descr_to_dtype(descr)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as err:
        raise InvalidArgumentError(f"Malformed tensor dtype {text!r}: {err}") from None
    if dtype.hasobject:
        raise InvalidArgumentError(f"Refusing tensor dtype {text!r}: object dtypes need pickle.")
    return dtype


def encode(value: Any) -> tuple[Value, list[Buffer]]:
    """Encode ``value`` as a ``Value`` header plus the raw buffers it refers to."""
    header = Value()
    return header, encode_into(header, value)


def encode_into(header: Value, value: Any) -> list[Buffer]:
    """Encode ``value`` into ``header`` (e.g. a field of a request); the raw buffers."""
    buffers: list[Buffer] = []
    _encode_into(header, value, buffers, 0)
    return buffers


def _encode_into(out: Value, value: Any, buffers: list[Buffer], depth: int) -> None:
    # Fills ``out`` in place: nested values are added where they belong, never copied.
    if depth > 64:
        raise InvalidArgumentError("Value nests deeper than 64 levels.")
    if value is None:
        out.none.SetInParent()
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        if _INT64_MIN <= value <= _INT64_MAX:
            out.int_value = value
        else:
            out.big_int_value = str(value)
    elif isinstance(value, float):
        out.float_value = value
    elif isinstance(value, str):
        out.str_value = value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        out.bytes_buffer = len(buffers)
        buffers.append(value)
    elif isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if not array.flags.c_contiguous:
            array = array.copy(order="C")
        tensor = out.tensor
        tensor.dtype = _dtype_text(array.dtype)
        tensor.shape.extend(array.shape)
        tensor.buffer = len(buffers)
        tensor.scalar = isinstance(value, np.generic)
        buffers.append(array.reshape(-1).view(np.uint8) if array.size else b"")
    elif isinstance(value, (list, tuple)):
        items = out.tuple_value if isinstance(value, tuple) else out.list_value
        items.SetInParent()
        add = items.items.add
        for item in value:
            _encode_into(add(), item, buffers, depth + 1)
    elif isinstance(value, dict):
        out.dict_value.SetInParent()
        add = out.dict_value.entries.add
        for key, item in value.items():
            entry = add()
            _encode_into(entry.key, key, buffers, depth + 1)
            _encode_into(entry.value, item, buffers, depth + 1)
    else:
        raise InvalidArgumentError(
            f"Cannot send a value of type {type(value).__name__}: clusterwire sends numpy "
            "arrays, bytes, str, int, float, bool, None and lists/tuples/dicts of these "
            "(no pickle). Convert it to one of those.")


def decode(header: Value, buffers: list[Buffer]) -> Any:
    """Rebuild a value from its header and buffers; InvalidArgumentError if malformed.

    Arrays are views of the received buffers (no copy); they are writable
    when the buffer is.
    """
    return _decode(header, buffers)


def _buffer(buffers: list[Buffer], index: int) -> Buffer:
    if index >= len(buffers):
        raise InvalidArgumentError(
            f"Malformed value: buffer {index} referenced but only {len(buffers)} sent.")
    return buffers[index]


def _decode(value: Value, buffers: list[Buffer]) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "none" or kind is None:
        return None
    if kind == "bool_value":
        return value.bool_value
    if kind == "int_value":
        return value.int_value
    if kind == "big_int_value":
        try:
            return int(value.big_int_value)
        except ValueError:
            raise InvalidArgumentError(f"Malformed integer {value.big_int_value[:40]!r}") from None
    if kind == "float_value":
        return value.float_value
    if kind == "str_value":
        return value.str_value
    if kind == "bytes_buffer":
        return bytes(_buffer(buffers, value.bytes_buffer))
    if kind == "tensor":
        return _decode_tensor(value.tensor, buffers)
    if kind == "list_value":
        return [_decode(item, buffers) for item in value.list_value.items]
    if kind == "tuple_value":
        return tuple(_decode(item, buffers) for item in value.tuple_value.items)
    if kind == "dict_value":
        result = {}
        for entry in value.dict_value.entries:
            key = _decode(entry.key, buffers)
            try:
                result[key] = _decode(entry.value, buffers)
            except TypeError:
                raise InvalidArgumentError(f"Unhashable dict key of type {type(key)}") from None
        return result
    raise InvalidArgumentError(f"Unknown value kind {kind!r}")  # pragma: no cover


def _decode_tensor(tensor, buffers: list[Buffer]) -> np.ndarray:
    dtype = _parse_dtype(tensor.dtype)
    shape = tuple(tensor.shape)
    if any(dim < 0 for dim in shape):
        raise InvalidArgumentError(f"Malformed tensor shape {shape}: negative dimension.")
    raw = memoryview(_buffer(buffers, tensor.buffer)).cast("B")
    count = 1
    for dim in shape:
        count *= dim
    if count * dtype.itemsize != raw.nbytes:
        raise InvalidArgumentError(
            f"Malformed tensor: shape {shape} of {dtype} needs {count * dtype.itemsize} bytes, "
            f"buffer has {raw.nbytes}.")
    array = np.empty(shape, dtype) if count == 0 else np.frombuffer(raw, dtype).reshape(shape)
    return array[()] if tensor.scalar and not shape else array
