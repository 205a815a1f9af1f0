"""Values travel as a Value header plus raw buffers, without pickle."""

from __future__ import annotations

import numpy as np
import pytest

from clusterwire import codec
from clusterwire.errors import InvalidArgumentError
from clusterwire.protos.service_pb2 import Value

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", "<U7", "S5",
          "datetime64[ns]", "timedelta64[s]", ">i4", "V3"]


def round_trip(value):
    header, buffers = codec.encode(value)
    header = Value.FromString(header.SerializeToString())
    # what a receiver gets: fresh writable byte buffers
    received = [bytearray(memoryview(b).cast("B")) for b in buffers]
    return codec.decode(header, received), buffers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (2, 0, 4)])
def test_every_dtype_and_shape(dtype, shape):
    array = np.zeros(shape, dtype)
    if array.size:
        array.reshape(-1).view(np.uint8)[:] = np.arange(array.nbytes, dtype=np.uint64) % 251
    result, _ = round_trip(array)
    assert isinstance(result, np.ndarray)
    assert result.dtype == array.dtype and result.shape == array.shape
    assert result.tobytes() == array.tobytes()


def test_structured_dtype():
    dtype = np.dtype([("x", "<f4"), ("name", "S3"), ("v", "<i2", (2,))])
    array = np.array([(1.5, b"ab", (1, 2)), (2.5, b"cd", (3, 4))], dtype)
    result, _ = round_trip(array)
    assert result.dtype == dtype and result.tobytes() == array.tobytes()


def test_non_contiguous_arrays_are_compacted():
    base = np.arange(100, dtype=np.float64).reshape(10, 10)
    for view in (base[::2, ::3], base.T, base[:, 5]):
        result, _ = round_trip(view)
        np.testing.assert_array_equal(result, view)
        assert result.flags.c_contiguous


def test_contiguous_array_is_sent_without_copy():
    array = np.arange(1000, dtype=np.float32)
    _, buffers = codec.encode(array)
    assert np.shares_memory(np.asarray(buffers[0]), array)


def test_received_arrays_are_views_of_the_buffers_and_writable():
    header, buffers = codec.encode(np.arange(4, dtype=np.int32))
    received = [bytearray(memoryview(buffers[0]).cast("B"))]
    result = codec.decode(header, received)
    result[0] = 42
    assert np.frombuffer(received[0], np.int32)[0] == 42


def test_numpy_scalars_stay_scalars():
    for scalar in (np.float32(1.5), np.int64(-3), np.bool_(True), np.complex64(1 + 2j)):
        result, _ = round_trip(scalar)
        assert type(result) is type(scalar) and result == scalar


def test_python_values_and_nesting():
    value = {"a": [1, 2.5, "three", None, True, b"\x00\xff"], 7: (1, (2, [3])),
             "big": 1 << 80, "neg": -(1 << 70), "nested": {"arr": np.ones(3)}}
    result, _ = round_trip(value)
    assert result["a"] == [1, 2.5, "three", None, True, b"\x00\xff"]
    assert result[7] == (1, (2, [3]))
    assert result["big"] == 1 << 80 and result["neg"] == -(1 << 70)
    np.testing.assert_array_equal(result["nested"]["arr"], np.ones(3))
    assert isinstance(result[7], tuple) and isinstance(result["a"], list)


def test_bytes_like_values_become_bytes():
    for value in (bytearray(b"abc"), memoryview(b"abc")):
        result, _ = round_trip(value)
        assert result == b"abc"


@pytest.mark.parametrize("value", [object(), {1, 2}, np.array([object()]), lambda: 1])
def test_unsupported_values_raise_invalid_argument_naming_the_type(value):
    with pytest.raises(InvalidArgumentError, match="Cannot send"):
        codec.encode(value)


def test_too_deep_nesting_is_refused():
    value: list = []
    for _ in range(100):
        value = [value]
    with pytest.raises(InvalidArgumentError, match="deeper"):
        codec.encode(value)


def tensor_header(dtype="<f4", shape=(2,), buffer=0):
    header = Value()
    header.tensor.dtype, header.tensor.buffer = dtype, buffer
    header.tensor.shape.extend(shape)
    return header


@pytest.mark.parametrize("header,buffers,match", [
    (tensor_header(buffer=3), [b"12345678"], "buffer 3"),
    (tensor_header(shape=(3,)), [b"12345678"], "needs 12 bytes"),
    (tensor_header(shape=(-1,)), [b""], "negative"),
    (tensor_header(dtype="|O"), [b"12345678"], "object"),
    (tensor_header(dtype="not a dtype"), [b"12345678"], "dtype"),
    (tensor_header(dtype="[('a', '|O')]"), [b"12345678"], "object"),
    (tensor_header(dtype="__import__('os')"), [b"12345678"], "dtype"),
])
def test_malformed_headers_raise_invalid_argument(header, buffers, match):
    with pytest.raises(InvalidArgumentError, match=match):
        codec.decode(header, buffers)


def test_malformed_big_int_and_bytes_index():
    with pytest.raises(InvalidArgumentError):
        codec.decode(Value(big_int_value="12x"), [])
    with pytest.raises(InvalidArgumentError):
        codec.decode(Value(bytes_buffer=1), [b""])


# -- headers kept by structure (codec.HeaderCache) -------------------------------------------

def _uncached(value):
    header, buffers = codec.encode(value)
    return header.SerializeToString(), [bytes(memoryview(b).cast("B")) for b in buffers]


def _cached(cache, value):
    def build(buffers):
        header = Value()
        codec.encode_into(header, value, buffers)
        return header.SerializeToString()

    header, buffers = cache.encode("prefix", value, build)
    return header, [bytes(memoryview(b).cast("B")) for b in buffers]


_SAME_STRUCTURE_VALUES = [
    None, True, False, 0, 1, -1, 1 << 62, 1 << 70, 0.0, -0.0, float("nan"), -float("nan"),
    1.5, "", "a", "x" * 65, b"", b"ab", bytearray(b"cd"),
    np.arange(6, dtype=np.int32).reshape(2, 3), np.arange(6, dtype=np.int32).reshape(3, 2),
    np.arange(6, dtype=">i4"), np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],
    np.zeros((2, 0)), np.float32(2.5), np.array(3.0), np.zeros(3, "datetime64[s]"),
    np.zeros(2, np.complex64), np.zeros(2, [("x", "<f4"), ("n", "S3")]),
    [np.arange(3), 1, "s"], (np.arange(3), 1, "s"), [[1, [2, (3,)]]], list(range(70)),
    {"a": np.arange(2), "b": [1.0, None]}, {1: "int key"}, {"b": 1, "a": 2}, {"a": 2, "b": 1},
]


def test_cached_headers_equal_freshly_encoded_ones():
    cache = codec.HeaderCache()
    for value in _SAME_STRUCTURE_VALUES:
        expected = _uncached(value)
        assert _cached(cache, value) == expected, value  # built
        assert _cached(cache, value) == expected, value  # reused


def test_values_with_different_headers_never_share_one():
    cache = codec.HeaderCache()
    seen: dict[bytes, object] = {}
    for value in _SAME_STRUCTURE_VALUES:
        header, _ = _cached(cache, value)
        assert header == _uncached(value)[0], value
        seen.setdefault(header, value)
    # Equal in Python, different on the wire: each gets its own header.
    pairs = [(1, True), (0.0, -0.0), ([1], (1,)), ("a", b"a"), ({"a": 1, "b": 2}, {"b": 2, "a": 1})]
    for left, right in pairs:
        assert _cached(cache, left)[0] != _cached(cache, right)[0], (left, right)


def test_a_cached_header_carries_the_new_buffers():
    cache = codec.HeaderCache()
    first = np.arange(4, dtype=np.float64)
    _cached(cache, [first])
    second = first * 10
    header, buffers = _cached(cache, [second])
    result = codec.decode(Value.FromString(header), [bytearray(b) for b in buffers])
    np.testing.assert_array_equal(result[0], second)


def test_the_cache_is_bounded():
    cache = codec.HeaderCache(max_entries=4)
    for i in range(10):
        _cached(cache, i)
    assert len(cache._headers) <= 4


def test_dtype_text_and_field_count_are_capped_before_parsing():
    header, buffers = codec.encode(np.zeros(2, np.uint8))
    header.tensor.dtype = repr([(f"f{i}", "u1") for i in range(codec.MAX_DTYPE_FIELDS + 1)])
    assert len(header.tensor.dtype) < codec.MAX_DTYPE_TEXT
    with pytest.raises(InvalidArgumentError, match="fields: more than"):
        codec.decode(header, buffers)
    header.tensor.dtype = "[" + " " * codec.MAX_DTYPE_TEXT + "]"
    with pytest.raises(InvalidArgumentError, match="characters: more than"):
        codec.decode(header, buffers)
