"""global_shuffle's random access to files (indexed TFRecord records, Parquet rows, indexed tar
samples): what it reads is what the sequential reads give, a damaged record fails where it comes
in the permuted order, a view closes the files it opened, and indexes parse in numpy passes as
line by line."""

from __future__ import annotations

import io
import os
import pathlib
import tarfile

import numpy as np
import pytest

from clusterwire import data
from clusterwire.data import tfrecord
from clusterwire.data.ops.formats import GATHER_BYTES
from clusterwire.errors import DataLossError, InvalidArgumentError

pytestmark = pytest.mark.timeout(120)

COUNT = 300


def _record(value: int) -> bytes:
    return b"%d:" % value + b"." * (value % 50)


@pytest.fixture
def files(tmp_path):
    """COUNT values as indexed TFRecord records, Parquet rows and tar samples (3 files each)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    made: dict[str, list[str]] = {"tfrecord": [], "parquet": [], "tar": []}
    for index, (start, stop) in enumerate([(0, 120), (120, 130), (130, COUNT)]):
        made["tfrecord"].append(str(tmp_path / f"r{index}.tfrecord"))
        with data.TFRecordWriter(made["tfrecord"][-1], index=True) as writer:
            for value in range(start, stop):
                writer.write(_record(value))
        made["parquet"].append(str(tmp_path / f"t{index}.parquet"))
        pq.write_table(pa.table({"x": np.arange(start, stop)}), made["parquet"][-1],
                       row_group_size=9)
        made["tar"].append(str(tmp_path / f"s{index}.tar"))
        with tarfile.open(made["tar"][-1], "w") as tar:
            for value in range(start, stop):
                info = tarfile.TarInfo(f"v{value:04d}.x")
                info.size = len(payload := _record(value))
                tar.addfile(info, io.BytesIO(payload))
    return made


def shuffled(files, kind, seed=5):
    if kind == "parquet":
        return data.Dataset.from_parquet(files["parquet"]).global_shuffle(seed)
    if kind == "tar":
        return data.Dataset.from_tar_shards(files["tar"], indexed=True).global_shuffle(seed)
    return data.TFRecordDataset(files["tfrecord"], index_filenames=True,
                                block_bytes=512).global_shuffle(seed)


def value_of(element) -> int:
    if isinstance(element, dict):
        element = element["x"]
    if isinstance(element, bytes):
        return int(element.split(b":")[0])
    return int(element)


def order_of(dataset) -> list[int]:
    return [value_of(e) for e in dataset]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("kind", ["tfrecord", "parquet", "tar"])
def test_every_kind_gives_the_one_permutation_of_its_elements(files, kind):
    """The three files of each kind hold the same values: their shuffles with one seed are
    one order (the permutation is of indices), a permutation of the values, with the
    records' bytes as written."""
    order = order_of(shuffled(files, kind))
    assert sorted(order) == list(range(COUNT)) and order == order_of(shuffled(files, "tar"))
    if kind != "parquet":
        records = [e if isinstance(e, bytes) else e["x"] for e in shuffled(files, kind)]
        assert records == [_record(v) for v in order]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
@pytest.mark.parametrize("kind", ["tfrecord", "parquet", "tar"])
def test_a_view_closes_its_files_at_the_end_and_when_abandoned(files, kind):
    before = open_fds()
    assert len(order_of(shuffled(files, kind))) == COUNT
    assert open_fds() == before
    iterator = iter(shuffled(files, kind))
    next(iterator)
    assert open_fds() > before  # the view holds its files open while it is read
    del iterator
    assert open_fds() == before


def test_a_damaged_record_fails_at_its_place_in_the_permuted_order(files):
    order = order_of(shuffled(files, "tfrecord"))
    place = next(p for p in range(COUNT // 2, COUNT) if order[p] < 120)  # in the first file
    path = pathlib.Path(files["tfrecord"][0])
    offset = int(tfrecord.read_index(f"{path}.idx")[order[place], 0])
    raw = bytearray(path.read_bytes())
    raw[offset + 13] ^= 0xFF  # a byte of its data: the data CRC no longer matches
    path.write_bytes(bytes(raw))
    read = []
    with pytest.raises(DataLossError, match=rf"r0\.tfrecord'.*byte offset {offset}\b"):
        for element in shuffled(files, "tfrecord"):
            read.append(value_of(element))
    assert read == order[:place]


def test_an_index_of_other_records_is_data_loss_naming_the_file(files, tmp_path):
    """An index whose records are not the file's (sizes that do not frame its records)."""
    index = tmp_path / "other.idx"
    rows = tfrecord.read_index(files["tfrecord"][1] + ".idx")
    index.write_bytes(b"".join(b"%d %d\n" % (o, s) for o, s in rows.tolist()))
    dataset = data.TFRecordDataset([files["tfrecord"][0]], index_filenames=[str(index)])
    with pytest.raises(DataLossError, match=r"r0\.tfrecord'.*index says"):
        list(dataset.global_shuffle(seed=1))


def test_an_index_changed_after_the_dataset_was_built_is_data_loss_naming_it(files):
    dataset = shuffled(files, "tfrecord")
    index = pathlib.Path(files["tfrecord"][0] + ".idx")
    index.write_bytes(b"".join(index.read_bytes().splitlines(keepends=True)[:50]))
    with pytest.raises(DataLossError, match=r"r0\.tfrecord\.idx'.*changed since"):
        list(dataset)


def test_a_gather_reads_at_most_its_bytes_at_a_time(tmp_path, monkeypatch):
    """Records of 1 MiB (over GATHER_BYTES / 4 each) are read a few at a time."""
    path = str(tmp_path / "big.tfrecord")
    with data.TFRecordWriter(path, index=True) as writer:
        for value in range(40):
            writer.write(bytes([value]) * (GATHER_BYTES // 16))
    reads: list[int] = []
    real = tfrecord.open_raw

    def counting(*args, **kwargs):
        file = real(*args, **kwargs)
        read = file.read
        file.read = lambda n: reads.append(n) or read(n)
        return file

    import clusterwire.data.ops.formats as formats
    monkeypatch.setattr(formats, "open_raw", counting)
    records = list(data.TFRecordDataset([path], index_filenames=True).global_shuffle(seed=2))
    assert sorted(r[0] for r in records) == list(range(40))
    assert max(reads) <= GATHER_BYTES + 2 * (64 << 10) and len(reads) >= 40 // 16


@pytest.mark.parametrize("text,rows", [
    (b"", []), (b"0 16\n16 20\n", [[0, 16], [16, 20]]), (b"0 16\n16 20", [[0, 16], [16, 20]]),
    (b"0 16\r\n16 20\r\n  ", [[0, 16], [16, 20]]), (b"0\t16\n16  20\n", [[0, 16], [16, 20]])])
def test_an_index_parses_as_line_by_line(tmp_path, text, rows):
    index = tmp_path / "i.idx"
    index.write_bytes(text)
    parsed = tfrecord.read_index(index)
    assert parsed.dtype == np.int64 and parsed.shape == (len(rows), 2)
    assert parsed.tolist() == rows == tfrecord._parse_index_lines("i", text).tolist()


@pytest.mark.parametrize("text,line", [
    (b"\n", 1), (b"0 16\n\n16 20\n", 2), (b"0 16\n16\n32 48\n", 2), (b"0 16\n16 15\n", 2),
    (b"0 16\n16 20\n  \n", 3), (b"1 16\n", 1), (b"0 16 3\n", 1), (b"0 x\n", 1),
    (b"0 16\n17 20\n", 2), (b"-0 16\n", 1)])
def test_a_malformed_index_names_its_line(tmp_path, text, line):
    index = tmp_path / "bad.idx"
    index.write_bytes(text)
    with pytest.raises(InvalidArgumentError, match=rf"bad\.idx', line {line} "):
        tfrecord.read_index(index)


def test_shuffled_reads_of_s3_objects_equal_the_local_files(files, monkeypatch):
    """Indexed TFRecord records, Parquet rows and tar samples read by number from moto's S3
    (seeks in fsspec files) are the local files' shuffle, element for element."""
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    from aws_moto import moto_endpoint, point_aws_at

    with moto_endpoint() as url:
        point_aws_at(monkeypatch, url)
        s3fs.S3FileSystem.clear_instance_cache()
        client = boto3.client("s3")
        client.create_bucket(Bucket="shuffled")
        remote: dict[str, list[str]] = {}
        for kind, paths in files.items():
            remote[kind] = [f"s3://shuffled/{os.path.basename(p)}" for p in paths]
            for path in paths:
                client.upload_file(path, "shuffled", os.path.basename(path))
                if kind == "tfrecord":
                    client.upload_file(path + ".idx", "shuffled", os.path.basename(path) + ".idx")
        try:
            for kind in ("tfrecord", "parquet", "tar"):
                assert [_key(e) for e in shuffled(remote, kind)] == \
                    [_key(e) for e in shuffled(files, kind)]
        finally:
            s3fs.S3FileSystem.clear_instance_cache()


def _key(element):
    if isinstance(element, dict):
        return repr(sorted((k, np.asarray(v).tolist() if not isinstance(v, bytes) else v)
                           for k, v in element.items()))
    return element
