"""TFRecordDataset, list_files, from_parquet and from_tar_shards: locally, through the data
service in both modes (workers reading only under their readable_dirs), and their errors."""

from __future__ import annotations

import io
import pathlib
import re
import subprocess
import sys
import tarfile
from collections import Counter

import numpy as np
import pytest
from conftest import in_process_data_service

from clusterwire import data
from clusterwire.data import (
    ParquetReader,
    TarShardReader,
    TFRecordReader,
    TFRecordWriter,
    graph,
)
from clusterwire.data.permissions import WorkerPermissions
from clusterwire.errors import DataLossError, InvalidArgumentError, PermissionDeniedError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.timeout(120)

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "tfrecord"
# Records per file of the interleave-order files: TF's order below was read from files
# written the same way, by tf.data.TFRecordDataset(names, num_parallel_reads=N) in TF 2.21.
COUNTS = (3, 1, 4, 2, 5)
TF_ORDER = {
    None: ["0-0", "0-1", "0-2", "1-0", "2-0", "2-1", "2-2", "2-3", "3-0", "3-1", "4-0", "4-1",
           "4-2", "4-3", "4-4"],
    2: ["0-0", "1-0", "0-1", "0-2", "2-0", "2-1", "3-0", "2-2", "3-1", "2-3", "4-0", "4-1",
        "4-2", "4-3", "4-4"],
    3: ["0-0", "1-0", "2-0", "0-1", "2-1", "0-2", "3-0", "2-2", "3-1", "2-3", "4-0", "4-1",
        "4-2", "4-3", "4-4"],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """TFRecord, Parquet and tar files in one directory (the workers' readable dir)."""
    root = tmp_path_factory.mktemp("data")
    tfrecords = []
    for index, count in enumerate(COUNTS):
        tfrecords.append(str(root / f"f{index}.tfrecord"))
        with TFRecordWriter(tfrecords[-1]) as writer:
            for record in range(count):
                writer.write(f"{index}-{record}".encode())
    parquets = []
    for index in range(2):
        parquets.append(str(root / f"t{index}.parquet"))
        table = pa.table({"x": np.arange(index * 100, index * 100 + 50, dtype=np.int64),
                          "y": np.arange(50, dtype=np.float32)})
        pq.write_table(table, parquets[-1], row_group_size=10)
    shards = []
    for index in range(3):
        shards.append(str(root / f"s{index}.tar"))
        with tarfile.open(shards[-1], "w") as tar:
            for sample in range(4):
                members = (("txt", f"{index}/{sample}".encode()), ("bin", b"\x00" * sample))
                for ext, value in members:
                    info = tarfile.TarInfo(f"k{index}_{sample}.{ext}")
                    info.size = len(value)
                    tar.addfile(info, io.BytesIO(value))
    return {"root": str(root), "tfrecord": tfrecords, "parquet": parquets, "tar": shards}


@pytest.fixture(scope="module")
def service(files):
    with in_process_data_service(2, readable_dirs=[files["root"]]) as dispatcher:
        yield dispatcher


def distributed(dataset, mode, target):
    return dataset.apply(data.distribute(processing_mode=mode, service=target))


def direct_tfrecords(paths):
    return [record for path in paths for record in TFRecordReader(path)]


def direct_parquet(paths, **options):
    rows = []
    for path in paths:
        with ParquetReader(path, readable_prefixes=None, **options) as reader:
            rows.extend(reader.read())
    return rows


def direct_tar(paths):
    samples = []
    for path in paths:
        with TarShardReader(path, readable_prefixes=None) as reader:
            samples.extend(reader)
    return samples


def key(element):
    """A hashable form of an element (dicts of bytes and numpy scalars or arrays)."""
    if isinstance(element, dict):
        return tuple(sorted((k, key(v)) for k, v in element.items()))
    if isinstance(element, np.ndarray):
        return (element.dtype.str, element.tobytes())
    if isinstance(element, np.generic):
        return element.item()
    return element


# ---- Locally ------------------------------------------------------------------------------


@pytest.mark.parametrize("reads", sorted(TF_ORDER, key=str))
def test_tfrecord_dataset_order_is_tfs(files, reads):
    names = files["tfrecord"]
    got = [r.decode() for r in data.TFRecordDataset(names, num_parallel_reads=reads)]
    assert got == TF_ORDER[reads]
    listed = data.Dataset.list_files(f"{files['root']}/*.tfrecord", shuffle=False)
    assert [r.decode() for r in data.TFRecordDataset(listed, num_parallel_reads=reads)] == \
        TF_ORDER[reads]


def test_tfrecord_dataset_reads_tfs_fixtures_as_the_reader_does():
    plain, gz = str(FIXTURES / "records.tfrecord"), str(FIXTURES / "records.tfrecord.gz")
    assert list(data.TFRecordDataset(plain)) == list(TFRecordReader(plain))
    assert list(data.TFRecordDataset([gz, gz], "GZIP", buffer_size=1000)) == \
        2 * list(TFRecordReader(gz, "GZIP"))
    examples = str(FIXTURES / "examples.tfrecord")
    expected = list(TFRecordReader(plain)), list(TFRecordReader(examples))
    got = list(data.TFRecordDataset([plain, examples], num_parallel_reads=2))
    assert Counter(got) == Counter(expected[0] + expected[1])
    assert got[:4] == [expected[0][0], expected[1][0], expected[0][1], expected[1][1]]


def test_list_files_is_tfs(files):
    pattern = f"{files['root']}/*.tfrecord"
    names = [n.decode() for n in data.Dataset.list_files(pattern, shuffle=False)]
    assert names == sorted(files["tfrecord"])
    seeded = data.Dataset.list_files(pattern, seed=3)
    first, second = [[n.decode() for n in seeded] for _ in range(2)]
    assert sorted(first) == sorted(second) == names
    assert [n.decode() for n in data.Dataset.list_files(pattern, seed=3)] == first
    with pytest.raises(InvalidArgumentError, match=r"No files matched pattern: .*\*\.nope"):
        data.Dataset.list_files(f"{files['root']}/*.nope")


def test_parquet_and_tar_equal_their_readers(files):
    parquet = files["parquet"]
    assert [key(e) for e in data.Dataset.from_parquet(parquet)] == \
        [key(e) for e in direct_parquet(parquet)]
    batches = list(data.Dataset.from_parquet(parquet, columns=["x"], batch_rows=4))
    assert [key(e) for e in batches] == \
        [key(e) for e in direct_parquet(parquet, columns=["x"], batch_rows=4)]
    assert [len(b["x"]) for b in batches[:3]] == [4, 4, 2]  # within a 10-row row group
    assert [key(e) for e in data.Dataset.from_tar_shards(files["tar"])] == \
        [key(e) for e in direct_tar(files["tar"])]


def test_bad_arguments_name_the_value(files):
    with pytest.raises(InvalidArgumentError, match="'SNAPPY'"):
        data.TFRecordDataset(files["tfrecord"], "SNAPPY")
    with pytest.raises(InvalidArgumentError, match="num_parallel_reads"):
        data.TFRecordDataset(files["tfrecord"], num_parallel_reads=0)
    with pytest.raises(InvalidArgumentError, match="at least one"):
        data.TFRecordDataset([])
    with pytest.raises(InvalidArgumentError, match="batch_rows"):
        data.Dataset.from_parquet(files["parquet"], batch_rows=0)
    with pytest.raises(InvalidArgumentError, match="'nope'"):
        list(data.Dataset.from_parquet(files["parquet"], columns=["nope"]))


# ---- Through the service ------------------------------------------------------------------


def sources(files):
    """(name, dataset, its elements read directly) of each source."""
    return [
        ("tfrecord", data.TFRecordDataset(files["tfrecord"], num_parallel_reads=2),
         direct_tfrecords(files["tfrecord"])),
        ("list_files", data.TFRecordDataset(data.Dataset.list_files(
            f"{files['root']}/*.tfrecord", seed=1)), direct_tfrecords(files["tfrecord"])),
        ("parquet", data.Dataset.from_parquet(files["parquet"]), direct_parquet(files["parquet"])),
        ("tar", data.Dataset.from_tar_shards(files["tar"]), direct_tar(files["tar"])),
    ]


@pytest.mark.parametrize("index", range(4), ids=["tfrecord", "list_files", "parquet", "tar"])
def test_parallel_epochs_every_worker_reads_everything(files, service, index):
    _, dataset, expected = sources(files)[index]
    got = Counter(key(e) for e in distributed(dataset, "parallel_epochs", service.target))
    assert got == Counter({k: 2 * n for k, n in Counter(key(e) for e in expected).items()})


@pytest.mark.parametrize("index", range(4), ids=["tfrecord", "list_files", "parquet", "tar"])
def test_distributed_epoch_reads_every_element_once(files, service, index):
    _, dataset, expected = sources(files)[index]
    got = Counter(key(e) for e in distributed(dataset, "distributed_epoch", service.target))
    assert got == Counter(key(e) for e in expected)


def test_tfrecord_order_through_one_worker_is_tfs(files):
    with in_process_data_service(1, readable_dirs=[files["root"]]) as dispatcher:
        dataset = data.TFRecordDataset(files["tfrecord"], num_parallel_reads=3)
        got = [r.decode() for r in distributed(dataset, "parallel_epochs", dispatcher.target)]
    assert got == TF_ORDER[3]


@pytest.mark.parametrize("kind", ["tfrecord", "parquet", "tar"])
def test_a_path_outside_readable_dirs_is_refused_naming_it(files, service, tmp_path, kind):
    path = tmp_path / pathlib.Path(files[kind][0]).name
    path.write_bytes(pathlib.Path(files[kind][0]).read_bytes())
    make = {"tfrecord": data.TFRecordDataset, "parquet": data.Dataset.from_parquet,
            "tar": data.Dataset.from_tar_shards}[kind]
    with pytest.raises(PermissionDeniedError, match=f"does not read '{path}'"):
        list(distributed(make([str(path)]), "parallel_epochs", service.target))


@data.function
def records_of(name):
    """A file name's records (interleave's map_func, allowed on the in-process workers)."""
    return data.TFRecordDataset(name)


def test_interleave_of_tfrecord_datasets_on_a_worker_keeps_its_readable_dirs(
        files, service, tmp_path):
    """TF's pattern, list_files + interleave(TFRecordDataset): the Datasets the function
    returns on a worker open files only under the worker's readable_dirs."""
    pattern = f"{files['root']}/*.tfrecord"
    inside = data.Dataset.list_files(pattern, shuffle=False).interleave(
        records_of, cycle_length=2, block_length=1)
    assert [r.decode() for r in inside] == TF_ORDER[2]  # locally: TF's order
    got = Counter(distributed(inside, "distributed_epoch", service.target))
    assert got == Counter(direct_tfrecords(files["tfrecord"]))
    outside = tmp_path / "x.tfrecord"
    outside.write_bytes(pathlib.Path(files["tfrecord"][0]).read_bytes())
    escape = data.Dataset.from_tensor_slices(np.array([str(outside).encode()])).interleave(
        records_of, cycle_length=1)
    assert len(list(escape)) == COUNTS[0]  # the client's own read is not checked
    with pytest.raises(PermissionDeniedError, match=f"does not read '{outside}'"):
        list(distributed(escape, "parallel_epochs", service.target))


def test_a_client_cannot_send_the_readable_dirs_of_a_read(files, monkeypatch):
    """``readable`` is set by the worker only: a dataset whose read carries it is refused."""
    dataset = data.TFRecordDataset(files["tfrecord"])
    read = dataset.pipeline.ops[-1]
    forged = {**read.params(), "readable": ("/",)}
    monkeypatch.setattr(type(read), "params", lambda self: forged)
    definition, buffers = graph.to_def(dataset.pipeline)
    with pytest.raises(InvalidArgumentError, match="Malformed dataset: 'tfrecord'"):
        graph.from_def(definition, buffers, WorkerPermissions(readable_dirs=[files["root"]]))


def test_a_corrupt_tfrecord_is_data_loss_at_the_consumer_naming_it(files, service):
    good = files["tfrecord"][0]
    corrupt = str(pathlib.Path(files["root"]) / "corrupt.tfrecord")
    raw = bytearray(pathlib.Path(files["tfrecord"][2]).read_bytes())
    raw[-1] ^= 0xFF  # the last record's data CRC
    pathlib.Path(corrupt).write_bytes(bytes(raw))
    try:
        read = iter(distributed(data.TFRecordDataset([good, corrupt]), "parallel_epochs",
                                service.target))
        with pytest.raises(DataLossError, match="corrupt.tfrecord"):
            for _ in range(100):
                next(read)
    finally:
        pathlib.Path(corrupt).unlink()


def test_local_data_service_passes_readable_dirs_to_its_workers(files):
    with data.LocalDataService(2, readable_dirs=[files["root"]]) as service:
        dataset = data.TFRecordDataset(files["tfrecord"], num_parallel_reads=2)
        got = Counter(distributed(dataset, "distributed_epoch", service.target))
    assert got == Counter(direct_tfrecords(files["tfrecord"]))


def test_the_readme_pipelines_run_as_written(tmp_path):
    text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text("utf-8")
    start = text.index("\n## Your data\n")
    blocks = re.findall(r"```python\n(.*?)```", text[start:text.index("\n## ", start + 1)],
                        re.S)
    outputs = []
    for block in blocks:
        script = tmp_path / "snippet.py"
        script.write_text(block)
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                                timeout=90, cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        outputs.append(result.stdout.splitlines())
    assert outputs[0] == [str(sorted(f"{s}-{i}".encode() for s in range(4) for i in range(3)))]
    assert sorted(outputs[1]) == ["(25,) 12", "(25,) 12", "(25,) 13", "(25,) 13"]
