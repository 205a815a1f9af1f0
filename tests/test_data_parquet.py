"""ParquetReader and plan_row_groups against pyarrow reading the same files."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow", reason="pip install 'clusterwire[parquet]'")
pq = pytest.importorskip("pyarrow.parquet")

from clusterwire.data import ParquetReader  # noqa: E402
from clusterwire.data.parquet import _values, plan_row_groups  # noqa: E402
from clusterwire.errors import (  # noqa: E402
    DataLossError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
)

pytestmark = pytest.mark.timeout(60)

ROWS = 1000
ROW_GROUP_ROWS = 300  # 4 row groups: 300, 300, 300, 100


def _table() -> pa.Table:
    rng = np.random.default_rng(7)
    return pa.table({
        "i64": rng.integers(-(1 << 40), 1 << 40, ROWS),
        "f32": rng.random(ROWS, dtype=np.float32),
        "u8": rng.integers(0, 256, ROWS, dtype=np.uint8),
        "flag": rng.random(ROWS) < 0.5,
        "text": [f"row {i} é" for i in range(ROWS)],
        "blob": [bytes([i % 256]) * (i % 7) for i in range(ROWS)],
        "maybe": pa.array([None if i % 3 == 0 else i for i in range(ROWS)], pa.int32()),
    })


@pytest.fixture
def parquet_file(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(_table(), path, row_group_size=ROW_GROUP_ROWS)
    return str(path)


def _expected_rows(path, row_groups, columns=None):
    """pyarrow's own read of the same row groups, as Python values."""
    table = pq.ParquetFile(path).read_row_groups(row_groups, columns=columns)
    return table.to_pylist()


def _as_python(value):
    if isinstance(value, np.generic):
        return None if isinstance(value, np.floating) and np.isnan(value) else value.item()
    return value


def test_rows_equal_pyarrows_read_of_each_row_group(parquet_file, tmp_path):
    with ParquetReader(parquet_file, readable_prefixes=[str(tmp_path)]) as reader:
        assert reader.num_row_groups == 4 and reader.num_rows == ROWS
        for index in range(4):
            rows = list(reader.read(index, index + 1))
            expected = _expected_rows(parquet_file, [index])
            assert len(rows) == len(expected) == (100 if index == 3 else 300)
            for row, want in zip(rows, expected, strict=True):
                assert list(row) == list(want)  # the file's column order
                assert isinstance(row["i64"], np.int64) and isinstance(row["f32"], np.float32)
                assert isinstance(row["text"], str) and isinstance(row["blob"], bytes)
                assert {k: _as_python(v) for k, v in row.items()} == want


def test_a_range_of_row_groups_is_their_rows_in_order(parquet_file):
    with ParquetReader(parquet_file, columns=["text", "i64"], readable_prefixes=None) as reader:
        rows = list(reader.read(1, 3))
    expected = _expected_rows(parquet_file, [1, 2], columns=["text", "i64"])
    assert [list(r) for r in rows] == [["text", "i64"]] * 600
    assert [{k: _as_python(v) for k, v in r.items()} for r in rows] == expected


def test_batches_are_arrays_of_at_most_batch_rows_within_a_row_group(parquet_file):
    with ParquetReader(parquet_file, batch_rows=128, readable_prefixes=None) as reader:
        batches = list(reader.read())
    # Row groups of 300, 300, 300, 100 rows: 128 + 128 + 44 three times, then 100.
    assert [len(b["i64"]) for b in batches] == [128, 128, 44] * 3 + [100]
    table = pq.read_table(parquet_file)
    for name in ("i64", "f32", "u8", "flag"):
        got = np.concatenate([b[name] for b in batches])
        np.testing.assert_array_equal(got, table.column(name).to_numpy())
        assert got.dtype == table.column(name).to_numpy().dtype
    texts = np.concatenate([b["text"] for b in batches])
    assert texts.dtype == object and list(texts) == table.column("text").to_pylist()
    assert list(np.concatenate([b["blob"] for b in batches])) == table.column("blob").to_pylist()
    maybe = np.concatenate([b["maybe"] for b in batches])  # nulls: Arrow's float with NaN
    assert np.isnan(maybe[::3]).all()
    assert list(maybe[1::3]) == list(range(1, ROWS, 3))


def test_numeric_columns_reach_numpy_without_a_copy(parquet_file):
    table = pq.ParquetFile(parquet_file).read_row_group(0)
    for name in ("i64", "f32", "u8"):
        arrow = table.column(name).chunk(0)
        array = _values(arrow, per_row=False)
        # The numpy array starts at Arrow's data buffer (plus the array's offset): a view.
        start = arrow.buffers()[1].address + arrow.offset * arrow.type.bit_width // 8
        assert array.__array_interface__["data"][0] == start
        assert not array.flags.writeable and not array.flags.owndata
    with ParquetReader(parquet_file, batch_rows=1000, readable_prefixes=None) as reader:
        batch = next(reader.read())
    for name in ("i64", "f32", "u8"):
        assert not batch[name].flags.owndata and not batch[name].flags.writeable


def test_a_row_groups_columns_come_in_fewer_reads_than_columns(tmp_path, monkeypatch):
    """Pre-buffered: the 8 column chunks of a row group (160 KB each) are read in a few
    coalesced reads, not one or more per chunk (pyarrow reads them so only when asked
    before apache/arrow#49924)."""
    import io

    from clusterwire.data import parquet

    path = tmp_path / "wide.parquet"
    rng = np.random.default_rng(3)
    pq.write_table(pa.table({f"c{k}": rng.random(40_000) for k in range(8)}), path,
                   row_group_size=20_000)
    reads = []

    class CountingFile(io.FileIO):
        def readinto(self, buffer):
            reads.append(len(buffer))
            return super().readinto(buffer)

        def read(self, size=-1):
            reads.append(size)
            return super().read(size)

    class PythonFile(io.BufferedReader):  # read as a Python file (as fsspec's), counted
        pass

    monkeypatch.setattr(parquet, "open_readable",
                        lambda path, prefixes: PythonFile(CountingFile(path, "rb")))
    with ParquetReader(path, batch_rows=5000, readable_prefixes=None) as reader:
        opened = len(reads)
        elements = list(reader.read(1, 2))
    assert sum(len(element["c0"]) for element in elements) == 20_000
    assert 1 <= len(reads) - opened < 8, reads[opened:]


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_local_file_is_read_by_arrow_and_no_descriptor_outlives_the_reader(parquet_file,
                                                                          tmp_path):
    """A local file is read through an Arrow OSFile over the descriptor open_readable checked
    (not through Python's file object); closing the reader, or a file that is no Parquet,
    leaves no descriptor open."""
    before = _open_descriptors()
    with ParquetReader(parquet_file, batch_rows=40, readable_prefixes=None) as reader:
        assert isinstance(reader._file, pa.OSFile)
        assert _open_descriptors() == before + 1
        assert [len(element["i64"]) for element in reader.read(3, 4)] == [40, 40, 20]
    assert _open_descriptors() == before
    bad = tmp_path / "not.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataLossError, match="not.parquet"):
        ParquetReader(bad, readable_prefixes=None)
    assert _open_descriptors() == before


def test_a_missing_column_names_the_column_and_the_file(parquet_file):
    with pytest.raises(InvalidArgumentError) as caught:
        ParquetReader(parquet_file, columns=["i64", "label"], readable_prefixes=None)
    assert "'label'" in str(caught.value) and parquet_file in str(caught.value)


@pytest.mark.parametrize("bad", [[], "i64"])
def test_columns_must_be_a_non_empty_list(parquet_file, bad):
    with pytest.raises(InvalidArgumentError, match="columns="):
        ParquetReader(parquet_file, columns=bad, readable_prefixes=None)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_batch_rows_must_be_a_positive_int(parquet_file, bad):
    with pytest.raises(InvalidArgumentError, match="batch_rows"):
        ParquetReader(parquet_file, batch_rows=bad, readable_prefixes=None)


def test_row_groups_out_of_range(parquet_file):
    with ParquetReader(parquet_file, readable_prefixes=None) as reader:
        with pytest.raises(OutOfRangeError, match=r"4 row groups.*\[3, 5\)"):
            next(reader.read(3, 5))


def test_plan_counts_row_groups_and_rows_of_each_file(tmp_path):
    paths = []
    for n, (rows, group) in enumerate([(1000, 300), (50, 100), (0, 100)]):
        path = tmp_path / f"part-{n}.parquet"
        pq.write_table(_table().slice(0, rows), path, row_group_size=group)
        paths.append(str(path))
    plan = plan_row_groups(paths, readable_prefixes=[str(tmp_path)])
    assert [f.path for f in plan.files] == paths
    assert [f.row_group_rows for f in plan.files] == [
        tuple(pq.ParquetFile(p).metadata.row_group(i).num_rows
              for i in range(pq.ParquetFile(p).metadata.num_row_groups)) for p in paths]
    assert plan.files[0].row_group_rows == (300, 300, 300, 100)
    assert plan.row_groups == sum(pq.ParquetFile(p).metadata.num_row_groups for p in paths)
    assert plan.rows == 1050


def test_not_a_parquet_file_is_data_loss_naming_it(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_bytes(b"PAR1 but not really" * 10)
    with pytest.raises(DataLossError, match="fake.parquet"):
        ParquetReader(str(path), readable_prefixes=None)


def test_a_truncated_file_is_data_loss_naming_it(parquet_file, tmp_path):
    data = pathlib.Path(parquet_file).read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(DataLossError, match="cut.parquet"):
        ParquetReader(str(cut), readable_prefixes=None)


def test_a_corrupt_row_group_is_data_loss_naming_file_and_row_group(tmp_path):
    path = tmp_path / "snappy.parquet"
    pq.write_table(_table(), path, row_group_size=ROW_GROUP_ROWS, compression="snappy")
    column = pq.ParquetFile(path).metadata.row_group(2).column(0)
    data = bytearray(path.read_bytes())
    start = column.data_page_offset + 40  # inside row group 2's first compressed page
    data[start:start + 64] = bytes(64)
    path.write_bytes(bytes(data))
    with ParquetReader(str(path), columns=["i64"], readable_prefixes=None) as reader:
        rows = reader.read()
        assert sum(1 for _ in zip(range(600), rows, strict=False)) == 600  # groups 0 and 1
        with pytest.raises(DataLossError, match=r"snappy.parquet.*row group 2"):
            next(rows)


def test_reads_only_under_readable_prefixes(parquet_file, tmp_path):
    other = tmp_path / "allowed"
    other.mkdir()
    with pytest.raises(PermissionDeniedError, match="--readable-dir") as caught:
        ParquetReader(parquet_file, readable_prefixes=[str(other)])
    assert parquet_file in str(caught.value)
    with pytest.raises(PermissionDeniedError):
        ParquetReader(parquet_file, readable_prefixes=[])  # default deny
    # A link inside the allowed folder to a file outside it is not followed.
    link = other / "link.parquet"
    os.symlink(parquet_file, link)
    with pytest.raises(PermissionDeniedError):
        ParquetReader(str(link), readable_prefixes=[str(other)])
    with pytest.raises(PermissionDeniedError):
        ParquetReader(str(other / ".." / "data.parquet"), readable_prefixes=[str(other)])


def test_file_urls_and_missing_files(parquet_file, tmp_path):
    with ParquetReader("file://" + parquet_file, readable_prefixes=["file://" + str(tmp_path)],
                       batch_rows=ROWS) as reader:
        assert sum(len(b["i64"]) for b in reader.read()) == ROWS
    with pytest.raises(NotFoundError, match="nope.parquet"):
        ParquetReader(str(tmp_path / "nope.parquet"), readable_prefixes=[str(tmp_path)])
