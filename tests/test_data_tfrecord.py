"""TFRecord files and tf.train.Example parsing against what TensorFlow 2.21 wrote and read.

The fixtures (tests/fixtures/tfrecord) were written by ``tf.io.TFRecordWriter``, with
TF's own reads and parses of them in expected.json; make_fixtures.py regenerates them
and defines the records and the Example spec these tests use. CI has no TensorFlow:
the last test runs TF on files clusterwire wrote only where a Python with TF is found.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import pathlib
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
from conftest import fresh_python
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterwire.data import (
    FixedLenFeature,
    SparseTensorValue,
    TFRecordReader,
    TFRecordWriter,
    VarLenFeature,
    crc32c,
    parse_example,
    parse_single_example,
    tfrecord,
)
from clusterwire.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from clusterwire.protos.example_pb2 import Example

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "tfrecord"
_spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
COMPRESSIONS = {None: "records.tfrecord", "GZIP": "records.tfrecord.gz",
                "ZLIB": "records.tfrecord.zlib"}


def digests(records):
    return [[len(r), hashlib.sha256(r).hexdigest()] for r in records]


def framed(records) -> bytes:
    """The plain TFRecord bytes of ``records``, framed independently of the writer."""
    out = bytearray()
    for record in records:
        length = struct.pack("<Q", len(record))
        out += length + struct.pack("<I", crc32c.masked(length)) + record
        out += struct.pack("<I", crc32c.masked(record))
    return bytes(out)


def compress(data: bytes, compression: str | None) -> bytes:
    if compression is None:
        return data
    wbits = 31 if compression == "GZIP" else 15
    deflate = zlib.compressobj(-1, zlib.DEFLATED, wbits, 9)
    return deflate.compress(data) + deflate.flush()


def read_until_error(path, compression=None, **options):
    """(records read, the DataLossError that stopped the read or None)."""
    got = []
    reader = TFRecordReader(path, compression, **options)
    try:
        for record in reader:
            got.append(record)
    except DataLossError as error:
        with pytest.raises(DataLossError) as again:  # no record after the damage, ever
            next(reader)
        assert again.value is error
        return got, error
    return got, None


# ---- CRC-32C ------------------------------------------------------------------------


def test_crc32c_check_value_and_mask():
    assert crc32c.value(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    assert crc32c.value(b"") == 0
    crc = crc32c.value(b"abc")
    rotated = ((crc >> 15) | (crc << 17)) & 0xFFFFFFFF
    assert crc32c.masked(b"abc") == (rotated + 0xA282EAD8) & 0xFFFFFFFF
    assert crc32c.value(bytearray(b"abc")) == crc32c.value(memoryview(b"xabc")[1:]) == crc


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 63, 64, 65, 1023, 1024, 1025, 5000,
                                  (1 << 20) + 3])
def test_crc32c_numpy_fallback_equals_the_library(size):
    data = np.random.default_rng(size).bytes(size)
    assert crc32c._numpy_value(data) == crc32c.value(data)
    if size <= 5000:
        assert crc32c._loop_value(data) == crc32c.value(data)


def test_reads_and_writes_without_the_crc_library(tmp_path):
    out = fresh_python(textwrap.dedent(f"""
        import sys, hashlib
        sys.modules["google_crc32c"] = None  # as if not installed
        from clusterwire.data import crc32c, TFRecordReader, TFRecordWriter
        assert not crc32c.accelerated()
        records = list(TFRecordReader({str(FIXTURES / "records.tfrecord.zlib")!r}, "ZLIB"))
        with TFRecordWriter({str(tmp_path / "w")!r}, "ZLIB") as writer:
            for record in records:
                writer.write(record)
        print(len(records), hashlib.sha256(b"".join(records)).hexdigest())
    """), timeout=120)
    records = list(TFRecordReader(FIXTURES / "records.tfrecord.zlib", "ZLIB"))
    assert out.split() == [str(len(records)), hashlib.sha256(b"".join(records)).hexdigest()]
    assert (tmp_path / "w").read_bytes() == (FIXTURES / "records.tfrecord.zlib").read_bytes()


# ---- Files TensorFlow wrote ----------------------------------------------------------


@pytest.mark.parametrize("compression", list(COMPRESSIONS))
def test_reads_tf_files_as_tf_does(compression):
    name = COMPRESSIONS[compression]
    with TFRecordReader(FIXTURES / name, compression) as reader:
        records = list(reader)
        assert reader.offset == len(framed(records))
    assert digests(records) == EXPECTED["files"][name]
    assert records == make_fixtures.records(compression is not None)
    if compression:
        assert max(map(len, records)) == 1 << 20


@pytest.mark.parametrize("compression", list(COMPRESSIONS))
def test_writes_the_bytes_tf_writes(tmp_path, compression):
    """GZIP too: zlib's gzip header, as TF writes it, has mtime 0 and no name."""
    name = COMPRESSIONS[compression]
    with TFRecordWriter(tmp_path / name, compression_type=compression) as writer:
        for record in make_fixtures.records(compression is not None):
            writer.write(record)
    assert (tmp_path / name).read_bytes() == (FIXTURES / name).read_bytes()


def test_plain_file_with_the_1mib_record_is_tfs_stream(tmp_path):
    """TF's ZLIB fixture decompressed is TF's plain file of the same records."""
    with TFRecordWriter(tmp_path / "big.tfrecord") as writer:
        for record in make_fixtures.records(True):
            writer.write(bytearray(record))  # any bytes-like value
    tf_plain = zlib.decompress((FIXTURES / "records.tfrecord.zlib").read_bytes())
    assert (tmp_path / "big.tfrecord").read_bytes() == tf_plain == \
        framed(make_fixtures.records(True))
    assert digests(TFRecordReader(tmp_path / "big.tfrecord")) == \
        EXPECTED["files"]["records.tfrecord.zlib"]


@pytest.mark.parametrize("compression", list(COMPRESSIONS))
@pytest.mark.parametrize("buffer_size", [None, 0, 1, 7, 4096])
def test_buffer_size_is_honoured(monkeypatch, compression, buffer_size):
    opened, reads = [], []
    real_open = tfrecord._open

    class Spy:
        def __init__(self, file):
            self._file = file
            self.closed = False

        def read(self, n=-1):
            reads.append(n)
            return self._file.read(n)

        def fileno(self):
            return self._file.fileno()

        def close(self):
            self.closed = True
            self._file.close()

    def spy_open(path, mode, buffering, readable_prefixes=None):
        opened.append(buffering)
        return Spy(real_open(path, mode, buffering, readable_prefixes))

    monkeypatch.setattr(tfrecord, "_open", spy_open)
    name = COMPRESSIONS[compression]
    records = list(TFRecordReader(FIXTURES / name, compression, buffer_size=buffer_size))
    assert digests(records) == EXPECTED["files"][name]
    size = tfrecord.DEFAULT_BUFFER_SIZE if buffer_size is None else buffer_size
    assert opened == [0]  # the sources read the file unbuffered, `size` bytes at a time
    if compression is None:
        # Each read asks `size` bytes or more (what a record still needs, when more), but
        # the last, the rest of the file.
        assert all(n >= size for n in reads[:-1]), reads
        if size >= (FIXTURES / name).stat().st_size:
            assert len(reads) == 1
    else:  # the inflater reads `size` compressed bytes at a time
        assert set(reads) == {size or tfrecord.DEFAULT_BUFFER_SIZE}


def test_bad_arguments(tmp_path):
    with pytest.raises(InvalidArgumentError, match="'SNAPPY'.*'GZIP' or 'ZLIB'"):
        TFRecordReader(FIXTURES / "records.tfrecord", "SNAPPY")
    with pytest.raises(InvalidArgumentError, match="'gzip'"):
        TFRecordWriter(tmp_path / "x", "gzip")
    with pytest.raises(InvalidArgumentError, match="buffer_size=-1"):
        TFRecordReader(FIXTURES / "records.tfrecord", buffer_size=-1)
    with pytest.raises(NotFoundError, match="missing.tfrecord"):
        TFRecordReader(tmp_path / "missing.tfrecord")
    with pytest.raises(NotFoundError, match="no-dir"):
        TFRecordWriter(tmp_path / "no-dir" / "x.tfrecord")
    assert list(TFRecordReader(FIXTURES / "records.tfrecord", "")) == \
        make_fixtures.records(False)
    with TFRecordWriter(tmp_path / "w") as writer:
        with pytest.raises(InvalidArgumentError, match="bytes, not str"):
            writer.write("text")
        writer.write(np.arange(3, dtype=np.uint8))  # any bytes-like value
    assert list(TFRecordReader(tmp_path / "w")) == [b"\x00\x01\x02"]


# ---- Damage: DataLossError with the file and offset, every record before it delivered ---


def damage_cases():
    records = make_fixtures.records(False)
    plain = framed(records)
    offsets = np.cumsum([0] + [16 + len(r) for r in records]).tolist()
    k = 3  # the 3000-byte record
    start = offsets[k]
    yield "length CRC", plain[:start + 2] + bytes([plain[start + 2] ^ 1]) + plain[start + 3:], \
        k, start, "corrupt length"
    yield "data CRC", plain[:start + 500] + bytes([plain[start + 500] ^ 0x80]) + \
        plain[start + 501:], k, start, "corrupt data"
    yield "footer CRC", plain[:offsets[k + 1] - 1] + b"\x00" + plain[offsets[k + 1]:], k, \
        start, "corrupt data"
    yield "truncated header", plain[:start + 5], k, start, "truncated header"
    yield "truncated data", plain[:start + 12 + 1000], k, start, "truncated data"
    yield "truncated footer", plain[:offsets[k + 1] - 2], k, start, "truncated data"
    huge = struct.pack("<Q", 1 << 60)  # a valid length CRC on a length no file has
    yield "huge length", plain[:start] + huge + struct.pack("<I", crc32c.masked(huge)) + \
        plain[start + 12:], k, start, "truncated data"


DAMAGE = list(damage_cases())


@pytest.mark.parametrize("compression", list(COMPRESSIONS))
@pytest.mark.parametrize("case", DAMAGE, ids=[c[0] for c in DAMAGE])
def test_damage_is_data_loss_at_its_offset(tmp_path, compression, case):
    _, damaged, index, offset, what = case
    path = tmp_path / "damaged.tfrecord"
    path.write_bytes(compress(damaged, compression))
    got, error = read_until_error(path, compression, buffer_size=1000)
    assert got == make_fixtures.records(False)[:index]
    assert error is not None and error.error_code == 15
    assert str(path) in str(error) and f"byte offset {offset}" in str(error)
    assert what in str(error)


def test_not_a_tfrecord_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("just some text, not records\n" * 4)
    got, error = read_until_error(path)
    assert got == [] and "byte offset 0" in str(error) and "is this a TFRecord file" in str(error)
    got, error = read_until_error(FIXTURES / "records.tfrecord", "GZIP")
    assert got == [] and "compressed stream is corrupt" in str(error)


def test_empty_file_has_no_records(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    assert list(TFRecordReader(tmp_path / "empty")) == []
    with TFRecordWriter(tmp_path / "empty.gz", "GZIP"):
        pass
    assert list(TFRecordReader(tmp_path / "empty.gz", "GZIP")) == []


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
@pytest.mark.parametrize("cut", [0.5, 0.9, -4, -1])
def test_truncated_compressed_stream(tmp_path, compression, cut):
    data = (FIXTURES / COMPRESSIONS[compression]).read_bytes()
    keep = int(len(data) * cut) if cut > 0 else len(data) + cut
    path = tmp_path / "cut"
    path.write_bytes(data[:keep])
    got, error = read_until_error(path, compression)
    expected = make_fixtures.records(True)
    assert error is not None and str(path) in str(error)
    assert got == expected[:len(got)]
    whole = zlib.decompressobj(31 if compression == "GZIP" else 15).decompress(data[:keep])
    complete = sum(1 for i in range(len(expected) + 1) if len(framed(expected[:i])) <= len(whole))
    assert len(got) == complete - 1  # every record the surviving bytes hold
    if cut < 0:  # only the stream's checksum trailer is cut: all records, then the error
        assert got == expected and "truncated" in str(error)


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_corrupt_compressed_stream(tmp_path, compression):
    data = bytearray((FIXTURES / COMPRESSIONS[compression]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "bad").write_bytes(bytes(data))
    got, error = read_until_error(tmp_path / "bad", compression)
    assert error is not None and str(tmp_path / "bad") in str(error)
    assert got == make_fixtures.records(True)[:len(got)]


def test_gzip_members_concatenated_and_zlib_trailing_bytes(tmp_path):
    gz = (FIXTURES / "records.tfrecord.gz").read_bytes()
    (tmp_path / "two.gz").write_bytes(gz + gz)
    assert list(TFRecordReader(tmp_path / "two.gz", "GZIP")) == make_fixtures.records(True) * 2
    (tmp_path / "extra.zlib").write_bytes((FIXTURES / "records.tfrecord.zlib").read_bytes() + b"x")
    got, error = read_until_error(tmp_path / "extra.zlib", "ZLIB")
    assert got == make_fixtures.records(True) and "follow the end of the ZLIB stream" in str(error)


# ---- Writer ---------------------------------------------------------------------------


@pytest.mark.parametrize("compression", list(COMPRESSIONS))
def test_flush_makes_records_readable_before_close(tmp_path, compression):
    path = tmp_path / "f"
    writer = TFRecordWriter(path, compression)
    writer.write(b"first")
    writer.write(b"second")
    writer.flush()
    data = path.read_bytes()
    if compression:
        data = zlib.decompressobj(31 if compression == "GZIP" else 15).decompress(data)
    assert data == framed([b"first", b"second"])
    writer.write(b"third")
    writer.close()
    writer.close()
    with pytest.raises(FailedPreconditionError, match="closed"):
        writer.write(b"late")
    assert list(TFRecordReader(path, compression)) == [b"first", b"second", b"third"]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=20),
       st.sampled_from(list(COMPRESSIONS)), st.sampled_from([None, 0, 5, 64]))
def test_round_trip(tmp_path_factory, records, compression, buffer_size):
    path = tmp_path_factory.mktemp("rt") / "r"
    with TFRecordWriter(path, compression) as writer:
        for record in records:
            writer.write(record)
    assert list(TFRecordReader(path, compression, buffer_size=buffer_size)) == records


# ---- tf.train.Example ----------------------------------------------------------------


def spec():
    out = {}
    for name, entry in make_fixtures.EXAMPLE_SPEC.items():
        if entry[0] == "fixed":
            _, shape, dtype, default = entry
            out[name] = FixedLenFeature(shape, dtype, default_value=default)
        else:
            out[name] = VarLenFeature(entry[1])
    return out


def from_json(entry):
    if entry["dtype"] == "string":
        values = np.empty(len(entry["values"]), dtype=object)
        values[:] = [base64.b64decode(v) for v in entry["values"]]
    else:
        values = np.array(entry["values"], dtype=entry["dtype"])
    return values.reshape(entry["shape"])


def assert_matches_tf(parsed, expected):
    assert set(parsed) == set(expected)
    for name, want in expected.items():
        got = parsed[name]
        if "indices" in want:
            assert isinstance(got, SparseTensorValue), name
            pairs = zip(got, (want["indices"], want["values"], want["dense_shape"]), strict=True)
        else:
            pairs = [(got, want)]
        for array, entry in pairs:
            array = np.asarray(array, dtype=object if entry["dtype"] == "string" else None)
            assert array.dtype == from_json(entry).dtype, name
            assert array.shape == tuple(entry["shape"]), name
            np.testing.assert_array_equal(array, from_json(entry), err_msg=name)


def test_parse_example_equals_tf():
    records = list(TFRecordReader(FIXTURES / "examples.tfrecord"))
    assert digests(records) == EXPECTED["files"]["examples.tfrecord"]
    assert_matches_tf(parse_example(records, spec()), EXPECTED["parse_example"])
    assert_matches_tf(parse_example(np.array(records, dtype=object), spec()),
                      EXPECTED["parse_example"])


def test_parse_single_example_equals_tf():
    record = list(TFRecordReader(FIXTURES / "examples.tfrecord"))[1]
    assert_matches_tf(parse_single_example(record, spec()), EXPECTED["parse_single_example"])
    assert_matches_tf(parse_example(record, spec()), EXPECTED["parse_single_example"])


def example(**features) -> bytes:
    message = Example()
    for name, (kind, values) in features.items():
        feature = message.features.feature[name]
        if kind is not None:
            getattr(feature, kind).SetInParent()
            getattr(feature, kind).value.extend(values)
    return message.SerializeToString()


@pytest.mark.parametrize("records, features, message", [
    ([example(b=("float_list", [1.0]))], {"a": FixedLenFeature([], "float32")},
     "'a' .*required but example 0 does not have it.*default_value"),
    ([example(a=("float_list", [1.0])), example(a=("int64_list", [1]))],
     {"a": FixedLenFeature([], "float32")},
     "'a' of example 1: data types don't match.*int64.*float32"),
    ([example(a=("int64_list", []))], {"a": VarLenFeature("string")},
     "'a' of example 0: data types don't match"),
    ([example(a=("float_list", [1.0, 2.0, 3.0]))], {"a": FixedLenFeature([2], "float32")},
     "'a' of example 0: 3 values, but shape \\[2\\] needs 2"),
    ([example(a=("float_list", []))], {"a": FixedLenFeature([], "float32", 7.0)},
     "'a' of example 0: 0 values"),  # TF: an empty list is present, not missing
    ([example()], {"a": FixedLenFeature([3], "float32", default_value=1.0)},
     "'a': default_value has 1 values but shape \\[3\\] needs 3"),
    ([example()], {"a": FixedLenFeature([], "int64", default_value=2.5)},
     "'a': default_value 2.5 is not a int64"),
    ([example()], {"a": FixedLenFeature([], np.float64)}, "'a': dtype .*float64.*'float32'"),
    ([example()], {"a": FixedLenFeature([-1], "int64")}, "'a': shape \\[-1\\]"),
    ([example()], {"a": ("fixed", [], "int64")}, "'a': .*not a clusterwire.data.FixedLen"),
    ([b"\xff\xff\xff"], {"a": FixedLenFeature([], "int64", 0)},
     "example 0 is not a serialized tf.train.Example"),
    (np.array([[b""]], dtype=object), {"a": VarLenFeature("int64")}, "shape \\[1, 1\\]"),
    ("text", {"a": VarLenFeature("int64")}, "not str"),
])
def test_parse_errors_name_the_feature(records, features, message):
    with pytest.raises(InvalidArgumentError, match=message):
        parse_example(records, features)


def test_parse_semantics_tf_keeps():
    """Cases checked against TF 2.21 by hand: a kind-less Feature is missing, a repeated
    map entry's last value wins, an empty batch has the right shapes."""
    parsed = parse_example(
        [example(a=(None, [])), example(a=("int64_list", [1])) + example(a=("int64_list", [2]))],
        {"a": FixedLenFeature([], "int64", default_value=9), "v": VarLenFeature("float32")})
    np.testing.assert_array_equal(parsed["a"], [9, 2])
    assert parsed["v"].dense_shape.tolist() == [2, 0] and parsed["v"].indices.shape == (0, 2)
    empty = parse_example([], {"a": FixedLenFeature([2], "float32"), "v": VarLenFeature(bytes)})
    assert empty["a"].shape == (0, 2) and empty["v"].dense_shape.tolist() == [0, 0]
    single = parse_single_example(example(s=("bytes_list", [b"a\x00"])),
                                  {"s": FixedLenFeature([], "string", default_value="d"),
                                   "t": FixedLenFeature([], "string", default_value="d")})
    assert single == {"s": b"a\x00", "t": b"d"}


def length_delimited(field: int, payload: bytes) -> bytes:
    assert len(payload) < 128  # one-byte lengths keep the hand-made records short
    return bytes([field << 3 | 2, len(payload)]) + payload


def float_example(float_list: bytes) -> bytes:
    """An Example whose feature "f" has the FloatList bytes ``float_list``, made by hand."""
    feature = length_delimited(2, float_list)
    entry = length_delimited(1, b"f") + length_delimited(2, feature)
    return length_delimited(1, length_delimited(1, entry))


def test_float_lists_in_every_wire_form():
    """Packed (TF's form), split into several packed chunks, unpacked, and mixed: the parser
    takes the packed bytes straight, and an unpacked list through the typed schema."""
    values = [1.5, -2.0, 3.25, 0.0]
    packed = [struct.pack("<f", v) for v in values]
    unpacked = [b"\x0d" + p for p in packed]  # field 1, wire type 5 (32-bit)
    forms = {
        "packed": length_delimited(1, b"".join(packed)),
        "chunks": length_delimited(1, b"".join(packed[:1])) + length_delimited(1, b"".join(
            packed[1:])),
        "unpacked": b"".join(unpacked),
        "mixed": length_delimited(1, b"".join(packed[:2])) + b"".join(unpacked[2:]),
    }
    spec = {"f": FixedLenFeature([4], "float32")}
    for form, float_list in forms.items():
        record = float_example(float_list)
        typed = Example.FromString(record).features.feature["f"].float_list.value
        assert list(typed) == values, form
        np.testing.assert_array_equal(parse_example([record], spec)["f"], [values], err_msg=form)
        var = parse_single_example(record, {"f": VarLenFeature("float32")})["f"]
        np.testing.assert_array_equal(var.values, values, err_msg=form)
    with pytest.raises(InvalidArgumentError, match="'f' of example 0 .*float list of 5 bytes"):
        parse_example([float_example(length_delimited(1, b"\x00" * 5))], spec)


# ---- TensorFlow reads what clusterwire wrote (a developer check: CI has no TF) ---------


def tf_python() -> str | None:
    configured = os.environ.get("CLUSTERWIRE_TF_PYTHON")
    if configured:
        return configured
    return sys.executable if importlib.util.find_spec("tensorflow") is not None else None


TF_READER = textwrap.dedent("""
    import hashlib, json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    out = {}
    for path, compression in json.loads(sys.argv[1]):
        records = [r.numpy() for r in tf.data.TFRecordDataset(path, compression_type=compression)]
        out[path] = [[len(r), hashlib.sha256(r).hexdigest()] for r in records]
    examples = [r.numpy() for r in tf.data.TFRecordDataset(sys.argv[2])]
    parsed = tf.io.parse_example(examples, {
        "x": tf.io.FixedLenFeature([2], tf.float32), "n": tf.io.VarLenFeature(tf.int64),
        "s": tf.io.FixedLenFeature([], tf.string, default_value=b"none")})
    out["parsed"] = {"x": parsed["x"].numpy().tolist(), "n": parsed["n"].values.numpy().tolist(),
                     "s": [v.decode("latin-1") for v in parsed["s"].numpy().tolist()]}
    print(json.dumps(out))
""")


@pytest.mark.skipif(tf_python() is None, reason="needs a Python with TensorFlow "
                    "(CLUSTERWIRE_TF_PYTHON=/path/to/python)")
def test_tensorflow_reads_clusterwire_files(tmp_path):
    files = []
    for compression, name in COMPRESSIONS.items():
        with TFRecordWriter(tmp_path / name, compression) as writer:
            for record in make_fixtures.records(True):
                writer.write(record)
        files.append([str(tmp_path / name), compression or ""])
    records = [example(x=("float_list", [i, -i]), n=("int64_list", list(range(i))),
                       **({"s": ("bytes_list", [b"\xffs%d" % i])} if i % 2 else {}))
               for i in range(4)]
    with TFRecordWriter(tmp_path / "ex.tfrecord") as writer:
        for record in records:
            writer.write(record)
    done = subprocess.run([tf_python(), "-c", TF_READER, json.dumps(files),
                           str(tmp_path / "ex.tfrecord")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for path, _ in files:
        assert out[path] == digests(make_fixtures.records(True)), path
    ours = parse_example(records, {"x": FixedLenFeature([2], "float32"),
                                   "n": VarLenFeature("int64"),
                                   "s": FixedLenFeature([], "string", default_value=b"none")})
    assert out["parsed"] == {"x": ours["x"].tolist(), "n": ours["n"].values.tolist(),
                             "s": [v.decode("latin-1") for v in ours["s"].tolist()]}


# ---- Indexes ------------------------------------------------------------------------------


def test_an_index_of_a_file_tf_wrote_starts_a_reader_at_each_record(tmp_path):
    """write_index of TF's fixture file (DALI's tfrecord2idx format) equals what
    TFRecordWriter(index=True) writes for the same records; each line starts a reader there."""
    path = FIXTURES / "records.tfrecord"
    records = list(TFRecordReader(path))
    index = tfrecord.write_index(path, tmp_path / "tf.idx")
    copy = tmp_path / "copy.tfrecord"
    with TFRecordWriter(copy, index=True) as writer:
        for record in records:
            writer.write(record)
    text = pathlib.Path(index).read_bytes()
    assert text == (tmp_path / "copy.tfrecord.idx").read_bytes()
    assert copy.read_bytes() == path.read_bytes()
    rows = tfrecord.read_index(index)
    assert [int(size) for size in rows[:, 1]] == [16 + len(r) for r in records]
    for (offset, _), record in zip(rows.tolist(), records, strict=True):
        assert next(TFRecordReader(path, start=offset)) == record
    with pytest.raises(InvalidArgumentError, match="only an uncompressed file has an index"):
        TFRecordWriter(tmp_path / "x.gz", "GZIP", index=True)
    with pytest.raises(InvalidArgumentError, match="start=19 needs an uncompressed file"):
        TFRecordReader(FIXTURES / "records.tfrecord.gz", "GZIP", start=19)
