"""distributed_epoch's split providers (``clusterwire.data.splits``): a file, a tar shard or a
Parquet row group per split, element ranges for the other sources; and a damaged file among
good ones, through the service, with and without ignore_errors (TF 2.21's behaviour)."""

from __future__ import annotations

import io
import pathlib
import tarfile
from collections import Counter

import numpy as np
import pytest
from conftest import in_process_data_service

from clusterwire import data
from clusterwire.data.pipeline import split_plan
from clusterwire.data.splits import MAX_SPLIT_UNITS, SPLITS_PER_WORKER, provider
from clusterwire.data.tfrecord import write_index
from clusterwire.errors import DataLossError, InvalidArgumentError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.timeout(120)

FILES, RECORDS = 6, 5


def _corrupt(raw: bytes, record: int, size: int) -> bytes:
    """``raw`` (records of ``size`` data bytes) with the data CRC of ``record`` flipped."""
    damaged = bytearray(raw)
    damaged[(record + 1) * (12 + size + 4) - 1] ^= 0xFF
    return bytes(damaged)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """TFRecord files f0..f5 (records ``b"i-j"``), Parquet tables and tar shards in one
    directory (the workers' readable dir), and damaged copies of each kind."""
    root = tmp_path_factory.mktemp("splits")
    tfrecords = []
    for index in range(FILES):
        tfrecords.append(str(root / f"f{index}.tfrecord"))
        with data.TFRecordWriter(tfrecords[-1]) as writer:
            for record in range(RECORDS):
                writer.write(f"{index}-{record}".encode())
    bad = root / "bad"
    bad.mkdir()
    # f1's record 1 damaged: TF 2.21 reads f1's record 0, then fails (DataLossError
    # "corrupted record at 31"); with ignore_errors it leaves out the rest of f1 only.
    (bad / "f1.tfrecord").write_bytes(_corrupt(pathlib.Path(tfrecords[1]).read_bytes(), 1, 3))
    gz = bad / "g.tfrecord.gz"
    with data.TFRecordWriter(str(gz), "GZIP") as writer:
        for record in range(200):
            writer.write(f"g-{record}".encode() * 20)
    whole = gz.read_bytes()
    (bad / "gt.tfrecord.gz").write_bytes(whole[:len(whole) // 2])
    parquets = []
    for index in range(2):
        parquets.append(str(root / f"t{index}.parquet"))
        pq.write_table(pa.table({"x": np.arange(index * 100, index * 100 + 30)}),
                       parquets[-1], row_group_size=10)
    pq.write_table(pa.table({"z": np.arange(30)}), str(bad / "noz.parquet"), row_group_size=10)
    shards = []
    for index in range(3):
        shards.append(str(root / f"s{index}.tar"))
        _tar(shards[-1], [f"k{index}_{sample}.txt" for sample in range(4)])
    _tar(str(bad / "nokey.tar"), ["a.txt", "nokey", "b.txt"])
    return {"root": str(root), "bad": str(bad), "tfrecord": tfrecords, "parquet": parquets,
            "tar": shards, "gz": str(gz)}


def _tar(path: str, names: list[str]) -> None:
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = len(name)
            tar.addfile(info, io.BytesIO(name.encode()))


@pytest.fixture(scope="module")
def service(files):
    with in_process_data_service(2, readable_dirs=[files["root"]]) as dispatcher:
        yield dispatcher


def distributed(dataset, target, mode="distributed_epoch"):
    return dataset.apply(data.distribute(processing_mode=mode, service=target))


def read_and_split(dispatcher, dataset, count):
    """Reads ``count`` elements of ``dataset`` in distributed_epoch (all of them), then, while
    its job is still there, the job and its splits as its workers read them (each split's
    elements, in order); then the read's end. Returns (elements, job, splits)."""
    read = iter(distributed(dataset, dispatcher.target))
    elements = [next(read) for _ in range(count)]
    job = dispatcher._state.jobs[max(dispatcher._state.jobs)]
    pipe = dataset.pipeline
    ops = split_plan(pipe).ops
    splits = [list(pipe.run(lambda i=i: pipe.source.read(*job.split_range(i)), ops))
              for i in range(int(job.total_splits))]
    assert next(read, None) is None
    return elements, job, splits


def key(element):
    if isinstance(element, dict):
        return tuple(sorted((k, key(v)) for k, v in element.items()))
    return element.item() if isinstance(element, np.generic) else element


# ---- A split per file, shard, row group -----------------------------------------------


def test_a_tfrecord_file_is_a_split(files, service):
    dataset = data.TFRecordDataset(files["tfrecord"])
    got, job, splits = read_and_split(service, dataset, FILES * RECORDS)
    assert Counter(got) == \
        Counter(f"{i}-{j}".encode() for i in range(FILES) for j in range(RECORDS))
    assert (job.split_units, job.total_units, job.splits_handed) == (1, FILES, FILES)
    assert splits == [[f"{i}-{j}".encode() for j in range(RECORDS)] for i in range(FILES)]


@data.function
def records_of(name):
    return data.TFRecordDataset(name)


def test_list_files_with_interleave_is_a_file_per_split(files, service):
    """TF's pipeline, list_files + interleave(TFRecordDataset): each split is one file name,
    shuffled per epoch (list_files' shuffle runs in a split of one name: a no-op)."""
    dataset = data.Dataset.list_files(f"{files['root']}/*.tfrecord", seed=2).interleave(
        records_of, cycle_length=2, block_length=1)
    got, job, splits = read_and_split(service, dataset, FILES * RECORDS)
    assert Counter(got) == \
        Counter(f"{i}-{j}".encode() for i in range(FILES) for j in range(RECORDS))
    assert (job.split_units, job.total_units) == (1, FILES)
    assert sorted(s[0][:1] for s in splits) == [str(i).encode() for i in range(FILES)]
    assert all(len({r[:1] for r in s}) == 1 and len(s) == RECORDS for s in splits)


def test_a_parquet_row_group_is_a_split(files, service):
    dataset = data.Dataset.from_parquet(files["parquet"], batch_rows=4)
    got, job, splits = read_and_split(service, dataset, 18)
    assert sorted(int(x) for b in got for x in b["x"]) == [*range(30), *range(100, 130)]
    assert (job.split_units, job.total_units) == (1, 6)
    firsts = [0, 10, 20, 100, 110, 120]
    assert [[list(b["x"]) for b in s] for s in splits] == [
        [list(range(f, f + 4)), list(range(f + 4, f + 8)), [f + 8, f + 9]] for f in firsts]


def test_a_tar_shard_is_a_split(files, service):
    dataset = data.Dataset.from_tar_shards(files["tar"])
    got, job, splits = read_and_split(service, dataset, 12)
    assert Counter(e["__key__"] for e in got) == \
        Counter(f"k{i}_{s}" for i in range(3) for s in range(4))
    assert (job.split_units, job.total_units) == (1, 3)
    assert [[e["__key__"] for e in s] for s in splits] == \
        [[f"k{i}_{s}" for s in range(4)] for i in range(3)]


def test_a_text_file_of_from_files_is_a_split(files, service):
    names = []
    for index in range(3):
        names.append(str(pathlib.Path(files["root"]) / f"l{index}.txt"))
        pathlib.Path(names[-1]).write_text("".join(f"{index}-{i}\n" for i in range(4)))
    dataset = data.Dataset.from_files(names)
    got, job, splits = read_and_split(service, dataset, 12)
    assert sorted(got) == sorted(f"{i}-{j}".encode() for i in range(3) for j in range(4))
    assert (job.split_units, job.total_units) == (1, 3)
    assert splits == [[f"{i}-{j}".encode() for j in range(4)] for i in range(3)]


def test_element_sources_keep_splits_per_worker(service):
    """range and from_tensor_slices: SPLITS_PER_WORKER splits per live worker, batch-aligned."""
    dataset = data.Dataset.range(1000).batch(7)
    got, job, splits = read_and_split(service, dataset, 143)
    assert sorted(int(x) for b in got for x in b) == list(range(1000))
    assert job.split_units == 63  # ceil(1000 / (2 workers * 8)) = 63, a multiple of 7
    assert len(splits) == 16 and all(len(s) == 9 for s in splits[:-1])
    assert provider("elements").units_per_split(10 ** 9, 1, 1) == MAX_SPLIT_UNITS
    assert provider("elements").units_per_split(64, 4, 1) == 64 // (4 * SPLITS_PER_WORKER)
    assert {provider(k).units_per_split(10 ** 6, 2, 8) for k in ("file", "row_group")} == {1}


# ---- A damaged file among good ones ---------------------------------------------------


def _good_and(files, *bad):
    return [files["tfrecord"][0], *(str(pathlib.Path(files["bad"]) / b) for b in bad),
            files["tfrecord"][2]]


def test_a_corrupt_tfrecord_fails_the_consumer_naming_it(files):
    names = _good_and(files, "f1.tfrecord")
    with in_process_data_service(2, readable_dirs=[files["root"]]) as dispatcher:
        for mode in ("parallel_epochs", "distributed_epoch"):
            with pytest.raises(DataLossError, match=r"f1\.tfrecord.*CRC-32C.*offset 19"):
                list(distributed(data.TFRecordDataset(names), dispatcher.target, mode))


@pytest.mark.parametrize("mode", ["parallel_epochs", "distributed_epoch"])
def test_ignore_errors_leaves_out_the_rest_of_a_corrupt_file_as_tf(files, service, mode):
    """TF 2.21: TFRecordDataset([f0, damaged f1, f2]).ignore_errors() gives f0, f1's record
    0, f2 (the rest of f1 left out); the other splits of the job are read."""
    names = _good_and(files, "f1.tfrecord")
    expected = Counter([*(f"0-{j}" for j in range(RECORDS)), "1-0",
                        *(f"2-{j}" for j in range(RECORDS))])
    local = [r.decode() for r in data.TFRecordDataset(names).ignore_errors()]
    assert local == [*(f"0-{j}" for j in range(RECORDS)), "1-0",
                     *(f"2-{j}" for j in range(RECORDS))]
    dataset = data.TFRecordDataset(names, num_parallel_reads=2).ignore_errors()
    got = Counter(r.decode() for r in distributed(dataset, service.target, mode))
    assert got == Counter({k: 2 if mode == "parallel_epochs" else 1 for k in expected})


def test_a_truncated_gzip_stream_is_data_loss_then_ignored_as_tf(files, service):
    truncated = str(pathlib.Path(files["bad"]) / "gt.tfrecord.gz")
    whole = [r for r in data.TFRecordDataset(files["gz"], "GZIP")]
    with pytest.raises(DataLossError, match=r"gt\.tfrecord\.gz.*truncated"):
        list(distributed(data.TFRecordDataset(truncated, "GZIP"), service.target))
    kept = list(data.TFRecordDataset([truncated, files["gz"]], "GZIP").ignore_errors())
    assert kept[-len(whole):] == whole and kept[:-len(whole)] == whole[:len(kept) - len(whole)]
    got = list(distributed(data.TFRecordDataset([truncated, files["gz"]], "GZIP")
                           .ignore_errors(), service.target))
    assert Counter(got) == Counter(kept)


def test_a_parquet_file_missing_a_column_names_it_and_the_others_are_read(files, service):
    noz = str(pathlib.Path(files["bad"]) / "noz.parquet")
    dataset = data.Dataset.from_parquet([files["parquet"][0], noz], columns=["x"])
    with pytest.raises(InvalidArgumentError, match=r"'x'.*noz\.parquet|noz\.parquet.*'x'"):
        list(distributed(dataset, service.target))
    got = sorted(int(e["x"]) for e in distributed(dataset.ignore_errors(), service.target))
    assert got == list(range(30))


def test_a_tar_member_without_a_key_names_it_and_the_others_are_read(files, service):
    nokey = str(pathlib.Path(files["bad"]) / "nokey.tar")
    dataset = data.Dataset.from_tar_shards([files["tar"][0], nokey, files["tar"][1]])
    with pytest.raises(InvalidArgumentError, match=r"nokey\.tar.*'nokey'"):
        list(distributed(dataset, service.target))
    got = Counter(e["__key__"] for e in distributed(dataset.ignore_errors(), service.target))
    assert got == Counter(["a", *(f"k{i}_{s}" for i in range(2) for s in range(4))])



# ---- Blocks of records of indexed TFRecord files ----------------------------------------


@pytest.fixture(scope="module")
def indexed(files):
    """Two indexed files of 40 records of 20..59 data bytes (36..75 bytes framed)."""
    names = []
    for index in range(2):
        names.append(str(pathlib.Path(files["root"]) / f"i{index}.tfrecord"))
        with data.TFRecordWriter(names[-1], index=True) as writer:
            for record in range(40):
                writer.write(f"{index}-{record}-".encode().ljust(20 + record, b"."))
    return names


def test_an_indexed_file_is_split_into_blocks_of_records(files, service, indexed):
    dataset = data.TFRecordDataset(indexed, index_filenames=True, block_bytes=512)
    expected = [r for name in indexed for r in data.TFRecordDataset(name)]
    assert list(dataset) == expected
    got, job, splits = read_and_split(service, dataset, len(expected))
    assert Counter(got) == Counter(expected)
    offsets = np.cumsum([0] + [36 + r for r in range(39)])  # each file's record offsets
    per_file = len(np.unique(offsets // 512))
    assert (job.split_units, job.total_units) == (1, 2 * per_file) and per_file > 4
    assert [r for s in splits for r in s] == expected
    for split in splits:  # records of one file whose offsets fall in one 512-byte window
        file, records = {r.split(b"-")[0] for r in split}, [int(r.split(b"-")[1]) for r in split]
        assert len(file) == 1 and records == list(range(records[0], records[-1] + 1))
        assert len({int(offsets[r]) // 512 for r in records}) == 1


def test_an_index_not_of_its_file_is_an_error_naming_them(files, service, indexed, tmp_path):
    wrong = tmp_path / "wrong.idx"
    write_index(files["tfrecord"][0], wrong)  # 5 records of 19 bytes
    with pytest.raises(InvalidArgumentError, match=r"index_filenames names 1 indexes for 2"):
        data.TFRecordDataset(indexed, index_filenames=[str(wrong)])
    dataset = data.TFRecordDataset([indexed[1]], index_filenames=[str(wrong)], block_bytes=512)
    with pytest.raises(DataLossError, match=r"i1\.tfrecord.*index is not this file's"):
        list(distributed(dataset, service.target))
    wrong.write_bytes(b"0 36\n36 x\n")
    with pytest.raises(InvalidArgumentError, match=r"wrong\.idx', line 2"):
        data.TFRecordDataset([indexed[1]], index_filenames=[str(wrong)])
    with pytest.raises(InvalidArgumentError, match="uncompressed files named in a list"):
        data.TFRecordDataset(indexed, "GZIP", index_filenames=True)
