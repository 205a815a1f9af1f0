"""parse_example's vectorised decode (clusterwire.data.example_wire) gives exactly what the
record-by-record protobuf path gives, and leaves every other form to that path."""

from __future__ import annotations

import numpy as np
import pytest

from clusterwire.data import FixedLenFeature, VarLenFeature, example, example_wire, parse_example
from clusterwire.protos.example_pb2 import Example

pytestmark = pytest.mark.timeout(60)

SPEC = {"label": FixedLenFeature([], "int64"), "image": FixedLenFeature([2, 3], "float32"),
        "name": FixedLenFeature([], "string", default_value=b"none"),
        "scores": VarLenFeature("float32"), "ids": VarLenFeature("int64"),
        "tags": VarLenFeature("string"), "mask": FixedLenFeature([2], "int64", [0, 0])}
EDGE_INTS = [0, 1, 127, 128, 2**31, 2**63 - 1, -1, -2**63, -300]


def make(index: int, rng: np.random.Generator) -> bytes:
    message = Example()
    features = message.features.feature
    features["label"].int64_list.value.append(EDGE_INTS[index % len(EDGE_INTS)])
    features["image"].float_list.value.extend(rng.standard_normal(6).astype(np.float32).tolist())
    if index % 3:
        features["name"].bytes_list.value.append(b"n\x00\xff%d" % index)
    features["scores"].float_list.value.extend([0.5] * (index % 4))
    features["ids"].int64_list.value.extend(EDGE_INTS[: index % 5])
    features["tags"].bytes_list.value.extend([b"", b"t" * 200][: index % 3])
    if index % 2:
        features["mask"].int64_list.value.extend([index, -index])
    features["other"].bytes_list.value.append(b"not asked for")
    if index % 4 == 0:
        features["kindless"].SetInParent()
    return message.SerializeToString()


def per_record(records, spec):
    saved = example_wire.decode
    example_wire.decode = lambda records, specs: None
    try:
        return parse_example(records, spec)
    finally:
        example_wire.decode = saved


def assert_same(ours, theirs):
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        other = theirs[key]
        parts = zip(value, other, strict=True) if isinstance(value, tuple) else [(value, other)]
        for mine, expected in parts:
            assert mine.dtype == expected.dtype and mine.shape == expected.shape, key
            np.testing.assert_array_equal(mine, expected, err_msg=key)


def specs(spec):
    return [example._spec(key, feature) for key, feature in spec.items()]


def test_the_vectorised_decode_equals_the_per_record_path():
    rng = np.random.default_rng(7)
    records = [make(i, rng) for i in range(300)]
    assert example_wire.decode(records, specs(SPEC)) is not None  # the batch took the fast path
    assert_same(parse_example(records, SPEC), per_record(records, SPEC))
    single = parse_example(records[5], SPEC)
    assert int(single["label"]) == EDGE_INTS[5] and single["ids"].values.tolist() == EDGE_INTS[:0]
    assert_same(parse_example(records[:0], SPEC), per_record(records[:0], SPEC))
    assert_same(parse_example([b""] * 2, {"v": VarLenFeature("int64")}),
                per_record([b""] * 2, {"v": VarLenFeature("int64")}))


def length_delimited(field: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return bytes([field << 3 | 2, len(payload)]) + payload


def entry(key: bytes, feature: bytes) -> bytes:
    return length_delimited(1, length_delimited(1, key) + length_delimited(2, feature))


@pytest.mark.parametrize("record", [
    make(1, np.random.default_rng(0)) + make(2, np.random.default_rng(0)),  # merged messages
    length_delimited(1, entry(b"label", length_delimited(3, length_delimited(1, b"\x05")))
                     + entry(b"label", length_delimited(3, length_delimited(1, b"\x06")))),
    length_delimited(1, entry(b"label", length_delimited(3, length_delimited(1, b"\x05")
                                                         + length_delimited(1, b"\x07")))),
    length_delimited(1, entry(b"label", length_delimited(3, b"\x08\x09"))),  # unpacked
    length_delimited(1, entry("é".encode(), length_delimited(3, b"")) + entry(
        b"label", length_delimited(3, length_delimited(1, b"\x05")))),  # a UTF-8 key
    length_delimited(1, entry(b"label", length_delimited(3, length_delimited(1, b"\x05")))
                     + b"\x10\x01"),  # an unknown field
])
def test_other_forms_take_the_per_record_path_with_its_results(record):
    spec = {"label": FixedLenFeature([], "int64", default_value=-7)}
    assert example_wire.decode([record], specs(spec)) is None
    try:
        expected = per_record([record], spec)
    except Exception as error:  # noqa: BLE001 - the same error either way
        with pytest.raises(type(error), match=str(error)[:40].replace("(", ".").replace(")", ".")):
            parse_example([record], spec)
        return
    assert_same(parse_example([record], spec), expected)


@pytest.mark.parametrize("records, spec", [
    ([make(0, np.random.default_rng(0))], {"label": FixedLenFeature([], "float32")}),
    ([make(0, np.random.default_rng(0))], {"image": FixedLenFeature([5], "float32")}),
    ([make(0, np.random.default_rng(0))], {"missing": FixedLenFeature([], "int64")}),
    ([b"\x0a\x05\x0a\x03"], {"a": VarLenFeature("int64")}),  # a length past the record
])
def test_errors_are_those_of_the_per_record_path(records, spec):
    with pytest.raises(Exception) as expected:
        per_record(records, spec)
    with pytest.raises(type(expected.value)) as ours:
        parse_example(records, spec)
    assert str(ours.value) == str(expected.value)
