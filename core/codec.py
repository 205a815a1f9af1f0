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
import math
import struct
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from clusterwire.errors import InvalidArgumentError
from clusterwire.protos.service_pb2 import Value

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

Buffer = Any  # any object supporting the buffer protocol
Plan = Callable[[list[Buffer]], Any]


@functools.lru_cache(maxsize=512)
def _dtype_text(dtype: np.dtype) -> str:
    if dtype.hasobject:
        raise InvalidArgumentError(
            f"Cannot send a numpy array of dtype {dtype}: object arrays would need pickle. "
            "Convert it to a fixed-size dtype (e.g. str -> 'U', bytes -> 'S') first.")
    if dtype.fields is None and dtype.subdtype is None:
        return dtype.str
    return repr(np.lib.format.dtype_to_descr(dtype))


#: The longest dtype text and the most fields (nested ones included) a header may declare;
#: both are checked before the text is parsed.
MAX_DTYPE_TEXT = 64 << 10
MAX_DTYPE_FIELDS = 1024


def _parse_dtype(text: str) -> np.dtype:
    if len(text) > MAX_DTYPE_TEXT:
        raise InvalidArgumentError(
            f"Refusing a tensor dtype of {len(text)} characters: more than {MAX_DTYPE_TEXT}.")
    if len(text) > 256:
        return _parse_dtype_text(text)
    return _parse_cached(text)


@functools.lru_cache(maxsize=512)
def _parse_cached(text: str) -> np.dtype:
    return _parse_dtype_text(text)


def _parse_dtype_text(text: str) -> np.dtype:
    try:
        descr = ast.literal_eval(text) if text[:1] in "[(" else text
        fields = _count_fields(descr)
        if fields > MAX_DTYPE_FIELDS:
            raise InvalidArgumentError(
                f"Refusing a tensor dtype of {fields} fields: more than {MAX_DTYPE_FIELDS}.")
        dtype = np.lib.format.descr_to_dtype(descr)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as err:
        raise InvalidArgumentError(f"Malformed tensor dtype {text[:200]!r}: {err}") from None
    if dtype.hasobject:
        raise InvalidArgumentError(
            f"Refusing tensor dtype {text[:200]!r}: object dtypes need pickle.")
    return dtype


def _count_fields(descr: Any) -> int:
    """How many fields a dtype description lists, nested structures included."""
    if not isinstance(descr, list):
        return 0
    return sum(1 + _count_fields(entry[1]) if isinstance(entry, tuple) and len(entry) > 1
               else 1 for entry in descr)


def encode(value: Any) -> tuple[Value, list[Buffer]]:
    """Encode ``value`` as a ``Value`` header plus the raw buffers it refers to."""
    header = Value()
    return header, encode_into(header, value)


def encode_into(header: Value, value: Any, buffers: list[Buffer] | None = None) -> list[Buffer]:
    """Encode ``value`` into ``header`` (e.g. a field of a request); the raw buffers.

    With ``buffers``, the value's buffers are appended there (several values
    of one frame share its buffer list) and that list is returned.
    """
    buffers = [] if buffers is None else buffers
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
        array = value if type(value) is np.ndarray else np.asarray(value)
        tensor = out.tensor
        tensor.dtype = _dtype_text(array.dtype)
        if array.ndim:
            tensor.shape.extend(array.shape)
        if buffers:
            tensor.buffer = len(buffers)
        if isinstance(value, np.generic):
            tensor.scalar = True
        buffers.append(_tensor_buffer(array))
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
        array = framework_array(value)
        if array is None:
            raise InvalidArgumentError(
                f"Cannot send a value of type {type(value).__name__}: clusterwire sends numpy "
                "arrays (and CPU torch tensors and jax arrays, as numpy arrays), bytes, str, "
                "int, float, bool, None and lists/tuples/dicts of these (no pickle). Convert "
                "it to one of those.")
        _encode_into(out, array, buffers, depth)


def framework_array(value: Any) -> np.ndarray | None:
    """A numpy view (no copy) of a CPU ``torch.Tensor`` or ``jax.Array``; None for any other
    type. Neither library is imported here: a value of theirs comes with its library loaded.

    The receiver gets a numpy array. A tensor elsewhere than in host memory (CUDA, MPS, meta)
    or of a dtype numpy lacks (bfloat16) is an InvalidArgumentError naming the fix.
    """
    library = type(value).__module__.partition(".")[0]
    if library == "torch" and hasattr(value, "device"):
        if value.device.type != "cpu":
            raise InvalidArgumentError(
                f"Cannot send a torch.Tensor on device {value.device}: clusterwire's "
                "transports move host memory (there is no GPU transport yet); send "
                "tensor.cpu().")
        try:  # detach: a value sent is data, not a node of the autograd graph
            return value.detach().resolve_conj().resolve_neg().numpy()
        except (TypeError, RuntimeError) as err:
            raise InvalidArgumentError(
                f"Cannot send a torch.Tensor of dtype {value.dtype} ({err}); convert it, "
                "e.g. tensor.float().") from None
    if library in ("jax", "jaxlib") and hasattr(value, "devices"):
        platforms = {device.platform for device in value.devices()}
        if platforms != {"cpu"}:
            raise InvalidArgumentError(
                f"Cannot send a jax.Array on {sorted(platforms)}: clusterwire's transports "
                "move host memory; send jax.device_get(array).")
        return np.asarray(value)
    return None


# Building a header costs several microseconds of protobuf calls per value, paid on
# both sides of every call, and between processes on 2 cores about four times that.
# Most headers repeat (a loop calls the same function with arrays of the same shapes),
# and a header is a function of its value's structure alone: types, dtypes, shapes
# and scalar values. So ``HeaderCache`` builds each header once per structure; a
# call then only walks its value to find that structure and the buffers.
_STRUCTURE_MAX_ITEMS = 64
_STRUCTURE_MAX_STR = 64
_STRUCTURE_MAX_DEPTH = 8
_DOUBLE = struct.Struct("<d")


def structure(value: Any, buffers: list[Buffer]) -> Any:
    """A hashable key for everything ``value``'s header holds, appending its buffers
    (as ``encode_into`` would); None, with ``buffers`` as it was, for a value whose
    header is not worth caching (long lists or strings, dicts with non-str keys, ...)."""
    start = len(buffers)
    key = _structure(value, buffers, 0)
    if key is None:
        del buffers[start:]
    return key


def _structure(value: Any, buffers: list[Buffer], depth: int) -> Any:
    kind = type(value)
    if kind is np.ndarray:
        if value.dtype.hasobject:
            return None
        buffers.append(_tensor_buffer(value))
        return np.ndarray, value.dtype, value.shape
    if value is None or kind is bool:
        return kind, value
    if kind is int:
        return (int, value) if _INT64_MIN <= value <= _INT64_MAX else None
    if kind is float:
        # By its bits: as floats, 0.0 == -0.0 would share a header and nan != nan never hit.
        return float, _DOUBLE.pack(value)
    if kind is str:
        return (str, value) if len(value) <= _STRUCTURE_MAX_STR else None
    if kind is bytes:
        buffers.append(value)
        return bytes
    if kind is list or kind is tuple:
        if depth >= _STRUCTURE_MAX_DEPTH or len(value) > _STRUCTURE_MAX_ITEMS:
            return None
        keys = [kind]
        for item in value:
            key = _structure(item, buffers, depth + 1)
            if key is None:
                return None
            keys.append(key)
        return tuple(keys)
    if kind is dict:
        if depth >= _STRUCTURE_MAX_DEPTH or len(value) > _STRUCTURE_MAX_ITEMS:
            return None
        keys = [_structure(item, buffers, depth + 1) for item in value.values()]
        names = tuple(value)
        if None in keys or not all(type(name) is str and len(name) <= _STRUCTURE_MAX_STR
                                   for name in names):
            return None
        return (dict, names, *keys)
    return None


class HeaderCache:
    """Serialized headers by (a prefix naming their kind, the structure of their value)."""

    def __init__(self, max_entries: int = 1024):
        self._headers: dict[Any, bytes] = {}
        self._max_entries = max_entries

    def encode(self, prefix: Any, value: Any, build: Callable[[list[Buffer]], bytes]
               ) -> tuple[bytes, list[Buffer]]:
        """(header, buffers) of ``value``; ``build(buffers)`` makes the header (encoding the
        value, its buffers appended to ``buffers``) when no header of this structure is kept."""
        buffers: list[Buffer] = []
        shape = structure(value, buffers)
        key = None if shape is None else (prefix, shape)
        try:
            header = None if key is None else self._headers.get(key)
        except TypeError:  # an unhashable prefix: ``build`` says what is wrong with it
            header = key = None
        if header is None:
            buffers = []
            header = build(buffers)
            if key is not None:
                remember(self._headers, key, header, self._max_entries)
        return header, buffers


def remember(cache: dict, key: Any, value: Any, max_entries: int = 1024) -> Any:
    """``cache[key] = value``, emptying ``cache`` first when it holds ``max_entries``: its
    entries are cheap to rebuild, and a stream of distinct keys must not grow it forever."""
    if len(cache) >= max_entries:
        cache.clear()
    cache[key] = value
    return value


def _tensor_buffer(array: np.ndarray) -> Buffer:
    """The raw buffer ``array`` travels as (a C-contiguous copy's, if it is not one)."""
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    return _bytes_view(array) if array.size else b""


def _bytes_view(array: np.ndarray) -> Buffer:
    """A flat byte view of a C-contiguous array (no copy)."""
    try:
        return memoryview(array).cast("B")
    except (ValueError, TypeError):  # dtypes the buffer protocol lacks (datetime64, ...)
        return array.reshape(-1).view(np.uint8)


def decode(header: Value, buffers: list[Buffer]) -> Any:
    """Rebuild a value from its header and buffers; InvalidArgumentError if malformed.

    Arrays are views of the received buffers (no copy); they are writable
    when the buffer is.
    """
    return decoder(header)(buffers)


def decoder(header: Value) -> Plan:
    """The function of the buffers that rebuilds ``header``'s value (cached, see below)."""
    if header.ByteSize() > PLAN_KEY_MAX:
        return functools.partial(_decode_large, header)
    key = header.SerializeToString()
    plan = _plans.get(key)
    if plan is None:
        plan = remember(_plans, key, _plan(header), _PLANS_MAX)
    return plan


# Decoding compiles a header into a plan (a function of the buffers) once and
# caches it by the header's bytes: the same structure arrives again and again
# (a training loop sends the same shapes every step), and running a plan costs
# a fraction of walking the protobuf tree. Every run still checks the buffers.
_PLANS_MAX = 1024
PLAN_KEY_MAX = 4096
_plans: dict[bytes, Plan] = {}
_SCALAR_KINDS = frozenset({"bool_value", "int_value", "float_value", "str_value"})


def _buffer(buffers: list[Buffer], index: int) -> Buffer:
    if index >= len(buffers):
        raise InvalidArgumentError(
            f"Malformed value: buffer {index} referenced but only {len(buffers)} sent.")
    return buffers[index]


def _constant(value: Any) -> Plan:
    return lambda _buffers: value


def _plan(value: Value) -> Plan:
    kind = value.WhichOneof("kind")
    if kind == "none" or kind is None:
        return _constant(None)
    if kind in _SCALAR_KINDS:
        return _constant(getattr(value, kind))
    if kind == "big_int_value":
        try:
            return _constant(int(value.big_int_value))
        except ValueError:
            raise InvalidArgumentError(f"Malformed integer {value.big_int_value[:40]!r}") from None
    if kind == "bytes_buffer":
        index = value.bytes_buffer
        return lambda buffers: bytes(_buffer(buffers, index))
    if kind == "tensor":
        return _tensor_plan(value.tensor)
    if kind in ("list_value", "tuple_value"):
        items = [_plan(item) for item in getattr(value, kind).items]
        if kind == "list_value":
            if len(items) == 1:  # one argument, one result: the common call
                only = items[0]
                return lambda buffers: [only(buffers)]
            return lambda buffers: [item(buffers) for item in items]
        return lambda buffers: tuple([item(buffers) for item in items])
    if kind == "dict_value":
        entries = [(_plan(entry.key), _plan(entry.value)) for entry in value.dict_value.entries]
        return lambda buffers: _build_dict(entries, lambda plan: plan(buffers))
    raise InvalidArgumentError(f"Unknown value kind {kind!r}")  # pragma: no cover


def _decode_large(value: Value, buffers: list[Buffer]) -> Any:
    # Headers too large to cache (long lists, big dicts) are walked once, without
    # building a plan whose closures would cost more than the walk itself.
    kind = value.WhichOneof("kind")
    if kind in _SCALAR_KINDS:
        return getattr(value, kind)
    if kind in ("list_value", "tuple_value"):
        items = [_decode_large(item, buffers) for item in getattr(value, kind).items]
        return items if kind == "list_value" else tuple(items)
    if kind == "dict_value":
        return _build_dict(((entry.key, entry.value) for entry in value.dict_value.entries),
                           lambda part: _decode_large(part, buffers))
    return _plan(value)(buffers)


def _build_dict(entries: Iterable[tuple[Any, Any]], decode_part: Callable[[Any], Any]) -> dict:
    result = {}
    for key_part, value_part in entries:
        key = decode_part(key_part)
        try:
            result[key] = decode_part(value_part)
        except TypeError:
            raise InvalidArgumentError(f"Unhashable dict key of type {type(key)}") from None
    return result


def _tensor_plan(tensor) -> Plan:
    dtype = _parse_dtype(tensor.dtype)
    shape = tuple(tensor.shape)
    if any(dim < 0 for dim in shape):
        raise InvalidArgumentError(f"Malformed tensor shape {shape}: negative dimension.")
    nbytes = math.prod(shape) * dtype.itemsize
    index, scalar = tensor.buffer, tensor.scalar and not shape

    def build(buffers: list[Buffer]) -> np.ndarray:
        raw = memoryview(_buffer(buffers, index)).cast("B")
        if raw.nbytes != nbytes:
            raise InvalidArgumentError(
                f"Malformed tensor: shape {shape} of {dtype} needs {nbytes} bytes, "
                f"buffer has {raw.nbytes}.")
        array = np.ndarray(shape, dtype, raw) if nbytes else np.empty(shape, dtype)
        return array[()] if scalar else array

    return build
