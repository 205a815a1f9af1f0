"""``tf.train.Example`` records parsed into numpy, without TensorFlow.

``parse_example`` / ``parse_single_example`` take the feature specs of
``tf.io.parse_example`` (``FixedLenFeature``, ``VarLenFeature``) and give what TF
gives, as numpy: a fixed-length feature is an array of shape ``[batch] + shape``
(bytes features: an object array of ``bytes``), a var-length one a
``SparseTensorValue(indices, values, dense_shape)`` as TF's ``SparseTensor``.

The records are decoded by protobuf's C parser (upb) from the schema in
``clusterwire/protos/example.proto``, TF's field numbers: the wire format's corner cases
(repeated map entries where the last wins, unknown fields, lists split in chunks) are
the parser's. Float lists are taken as their packed bytes (``PackedExample``, see the
.proto) straight into numpy; one written unpacked goes through the typed schema.
TF's rules are kept: an empty list counts as present (so a ``FixedLenFeature`` wants
its full count even with a default), a feature with no list kind set counts as
missing, a list of the wrong kind is an error even when empty, and a default must
have the feature's shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from clusterwire.data import example_wire
from clusterwire.errors import InvalidArgumentError
from clusterwire.protos.example_pb2 import FloatList, PackedExample

# The three value kinds of an Example: dtype name -> (Feature's oneof field, numpy dtype).
_KINDS = {
    "string": ("bytes_list", np.dtype(object)),
    "float32": ("float_list", np.dtype(np.float32)),
    "int64": ("int64_list", np.dtype(np.int64)),
}
_KIND_NAMES = {"bytes_list": "string", "float_list": "float32", "int64_list": "int64"}
_DTYPE_ALIASES = {"bytes": "string", "object": "string", "str": "string", "float": "float32",
                  "int": "int64"}


class FixedLenFeature(NamedTuple):
    """A feature with exactly ``prod(shape)`` values per example, as ``tf.io.FixedLenFeature``.

    ``dtype`` is "string" (bytes), "float32" or "int64" (also as a numpy dtype or a
    ``tf.DType``). ``default_value``, when given, must have ``shape``'s element count;
    without one the feature is required.
    """

    shape: Sequence[int] | int
    dtype: Any
    default_value: Any = None


class VarLenFeature(NamedTuple):
    """A feature with any number of values per example, as ``tf.io.VarLenFeature``."""

    dtype: Any


class SparseTensorValue(NamedTuple):
    """A parsed ``VarLenFeature``: TF's SparseTensor as numpy arrays.

    ``indices`` (int64, [N, rank]), ``values`` ([N]), ``dense_shape`` (int64, [rank]).
    """

    indices: np.ndarray
    values: np.ndarray
    dense_shape: np.ndarray


class _Spec(NamedTuple):
    key: str
    kind: str  # the Feature oneof field holding this dtype's values
    dtype: np.dtype
    fixed: bool
    shape: tuple[int, ...]
    size: int  # values per example (fixed only)
    default: np.ndarray | None


def _dtype_name(key: str, dtype: Any) -> str:
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if name is None:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    name = _DTYPE_ALIASES.get(name, name)
    if name.startswith("bytes") or name == "object":  # numpy's np.bytes_ is "bytes0"
        name = "string"
    if name not in _KINDS:
        raise InvalidArgumentError(
            f"feature {key!r}: dtype {dtype!r} cannot be parsed from an Example: use "
            "'string' (bytes), 'float32' or 'int64', the three kinds an Example holds")
    return name


def _spec(key: Any, feature: Any) -> _Spec:
    if not isinstance(key, str):
        raise InvalidArgumentError(f"feature key {key!r} must be a str")
    if isinstance(feature, VarLenFeature):
        kind, dtype = _KINDS[_dtype_name(key, feature.dtype)]
        return _Spec(key, kind, dtype, False, (), 0, None)
    if not isinstance(feature, FixedLenFeature):
        raise InvalidArgumentError(
            f"feature {key!r}: {feature!r} is not a clusterwire.data.FixedLenFeature or "
            "VarLenFeature")
    name = _dtype_name(key, feature.dtype)
    kind, dtype = _KINDS[name]
    raw_shape = [feature.shape] if isinstance(feature.shape, int) else feature.shape
    try:
        shape = tuple(int(d) for d in raw_shape)
    except (TypeError, ValueError):
        shape = ()
        raw_shape = None
    if raw_shape is None or any(d < 0 for d in shape):
        raise InvalidArgumentError(
            f"feature {key!r}: shape {feature.shape!r} must be a list of sizes >= 0 "
            "(a FixedLenFeature has a fully known shape; use VarLenFeature for lists of any "
            "length)")
    size = math.prod(shape)
    default = None
    if feature.default_value is not None:
        default = _default(key, feature.default_value, name, shape, size)
    return _Spec(key, kind, dtype, True, shape, size, default)


def _default(key: str, value: Any, name: str, shape: tuple[int, ...], size: int) -> np.ndarray:
    dtype = _KINDS[name][1]
    try:
        if name == "string":
            items = np.array(value, dtype=object).reshape(-1).tolist()
            if not all(isinstance(v, (bytes, str)) for v in items):
                raise TypeError("not bytes or str")
            flat = np.empty(len(items), dtype=object)
            flat[:] = [v.encode() if isinstance(v, str) else v for v in items]
        else:
            flat = np.asarray(value).astype(dtype, casting="same_kind").reshape(-1)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(
            f"feature {key!r}: default_value {value!r} is not a {name} value ({error})") from None
    if flat.size != size:
        raise InvalidArgumentError(
            f"feature {key!r}: default_value has {flat.size} values but shape {list(shape)} "
            f"needs {size}: give the whole default, as TF reshapes it to the shape")
    return flat.reshape(shape)


def _decode(record: Any, index: int) -> Any:
    try:
        example = PackedExample.FromString(record)
    except (DecodeError, TypeError) as error:
        raise InvalidArgumentError(
            f"example {index} is not a serialized tf.train.Example ({error})") from None
    return example.features.feature


def _floats(spec: _Spec, packed: Any, index: int) -> np.ndarray:
    if len(UnknownFieldSet(packed)):  # written unpacked: read through the typed schema
        return np.array(FloatList.FromString(packed.SerializeToString()).value, np.float32)
    chunks = packed.chunks
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if len(data) % 4:
        raise InvalidArgumentError(
            f"feature {spec.key!r} of example {index} is not a valid tf.train.Feature: a "
            f"packed float list of {len(data)} bytes")
    return np.frombuffer(data, "<f4")


def _values(spec: _Spec, feature: Any, index: int) -> Any | None:
    """The feature's values (an array, or bytes objects for strings), None when missing."""
    if feature is None:
        return None
    kind = feature.WhichOneof("kind")
    if kind is None:
        return None
    if kind != spec.kind:
        raise InvalidArgumentError(
            f"feature {spec.key!r} of example {index}: data types don't match: the Example "
            f"holds {_KIND_NAMES[kind]} values, the spec asks for {_KIND_NAMES[spec.kind]}")
    if kind == "float_list":
        return _floats(spec, feature.float_list, index)
    return getattr(feature, kind).value


def _parse(records: Sequence[Any], features: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(features, Mapping):
        raise InvalidArgumentError(
            f"features must be a dict of name -> FixedLenFeature/VarLenFeature, not "
            f"{type(features).__name__}")
    specs = [_spec(key, feature) for key, feature in features.items()]
    batch = len(records)
    decoded = example_wire.decode(records, specs)
    if decoded is None:  # not in the common form: record by record, errors worded
        maps = [_decode(record, i) for i, record in enumerate(records)]
        decoded = {spec.key: _fixed(spec, maps) if spec.fixed else _var(spec, maps)
                   for spec in specs}
    return {spec.key: decoded[spec.key].reshape((batch, *spec.shape)) if spec.fixed
            else _sparse(*decoded[spec.key]) for spec in specs}


def _fixed(spec: _Spec, maps: list[Any]) -> np.ndarray:
    """A fixed-length feature's values, ``[batch, size]``."""
    out = np.empty((len(maps), spec.size), dtype=spec.dtype)
    for i, feature_map in enumerate(maps):
        values = _values(spec, feature_map.get(spec.key), i)
        if values is None:
            if spec.default is None:
                raise InvalidArgumentError(
                    f"feature {spec.key!r} ({_KIND_NAMES[spec.kind]}) is required but example "
                    f"{i} does not have it: give the FixedLenFeature a default_value")
            out[i] = spec.default.reshape(-1)
        elif len(values) != spec.size:
            raise InvalidArgumentError(
                f"feature {spec.key!r} of example {i}: {len(values)} values, but shape "
                f"{list(spec.shape)} needs {spec.size}")
        else:
            out[i] = values
    return out


def _var(spec: _Spec, maps: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(values per example, all values in order) of a var-length feature."""
    lists = [_values(spec, feature_map.get(spec.key), i) for i, feature_map in enumerate(maps)]
    lengths = np.array([0 if v is None else len(v) for v in lists], dtype=np.int64)
    values = np.empty(int(lengths.sum()), dtype=spec.dtype)
    start = 0
    for v, n in zip(lists, lengths.tolist(), strict=True):
        if n:
            values[start:start + n] = v
            start += n
    return lengths, values


def _sparse(lengths: np.ndarray, values: np.ndarray) -> SparseTensorValue:
    """TF's SparseTensor of a batch's lists: ``lengths`` values each, ``values`` in order."""
    batch = lengths.size
    rows = np.repeat(np.arange(batch, dtype=np.int64), lengths)
    columns = np.arange(len(values), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths,
                                                                  lengths)
    width = int(lengths.max()) if batch else 0
    return SparseTensorValue(np.stack([rows, columns], axis=1), values,
                             np.array([batch, width], dtype=np.int64))


def _is_single(serialized: Any) -> bool:
    return isinstance(serialized, (bytes, bytearray, memoryview)) or (
        isinstance(serialized, np.ndarray) and serialized.ndim == 0)


def parse_example(serialized: Sequence[bytes] | bytes,
                  features: Mapping[str, FixedLenFeature | VarLenFeature]) -> dict[str, Any]:
    """Parses a batch of serialized ``tf.train.Example`` records, as ``tf.io.parse_example``.

    ``serialized``: a sequence (or 1-D array) of bytes; a single bytes value is parsed
    as by ``parse_single_example``. Returns a dict feature name -> numpy array of shape
    ``[batch] + shape`` (FixedLenFeature) or ``SparseTensorValue`` with 2-D indices
    (VarLenFeature). Bad records or values: ``InvalidArgumentError`` naming the feature
    and the example's index.
    """
    if _is_single(serialized):
        return parse_single_example(serialized, features)
    if isinstance(serialized, np.ndarray) and serialized.ndim != 1:
        raise InvalidArgumentError(
            f"serialized must be a scalar or a vector of records, got shape "
            f"{list(serialized.shape)}")
    if isinstance(serialized, str) or not isinstance(serialized, (Sequence, np.ndarray)):
        raise InvalidArgumentError(
            f"serialized must be bytes or a sequence of bytes, not {type(serialized).__name__}")
    return _parse(serialized, features)


def parse_single_example(serialized: bytes,
                         features: Mapping[str, FixedLenFeature | VarLenFeature]
                         ) -> dict[str, Any]:
    """Parses one serialized ``tf.train.Example``, as ``tf.io.parse_single_example``.

    A FixedLenFeature is an array of its shape; a VarLenFeature a ``SparseTensorValue``
    with 1-D indices ([N, 1]) and dense_shape ``[N]``.
    """
    if isinstance(serialized, np.ndarray):
        serialized = serialized.item()
    if not isinstance(serialized, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(
            f"serialized must be one record as bytes, not {type(serialized).__name__}")
    parsed = _parse([bytes(serialized)], features)
    single: dict[str, Any] = {}
    for key, value in parsed.items():
        if isinstance(value, SparseTensorValue):
            single[key] = SparseTensorValue(value.indices[:, 1:], value.values,
                                            value.dense_shape[1:])
        else:
            single[key] = value[0]
    return single
