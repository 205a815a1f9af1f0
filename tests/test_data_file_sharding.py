"""Static ShardingPolicy.FILE over every file source (list_files, TFRecordDataset with and
without indexes, from_parquet, from_tar_shards, from_files) through the service with 2 and 3
workers: each file read by one worker, the one TF's FILE sharding gives it, every element once.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from collections import Counter, defaultdict

import numpy as np
import pytest
from conftest import free_ports, wait_for

from clusterwire import data
from clusterwire.data import TFRecordWriter, splits
from clusterwire.data import worker as worker_module
from clusterwire.data.tfrecord import write_index
from clusterwire.errors import InvalidArgumentError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.timeout(120)

FILES = 7
# The files (by position in the sorted list) each worker read under TF 2.21's FILE
# auto-sharding (_AutoShardDataset(..., AutoShardPolicy.FILE)) of TFRecordDataset(names)
# and of list_files(...).interleave(TFRecordDataset), shuffled (seed 5) or not, 7 files.
TF_FILE_SHARDS = {
    2: [{0, 2, 4, 6}, {1, 3, 5}],
    3: [{0, 3, 6}, {1, 4}, {2, 5}],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """FILES files of each format in one directory (the workers' readable dir)."""
    root = tmp_path_factory.mktemp("sharded")
    made = defaultdict(list)
    for index in range(FILES):
        made["tfrecord"].append(str(root / f"f{index}.tfrecord"))
        with TFRecordWriter(made["tfrecord"][-1]) as writer:
            for record in range(index + 2):  # 2..8 records of 100 bytes
                writer.write(f"{index}-{record}".encode().ljust(100, b"."))
        write_index(made["tfrecord"][-1])
        made["parquet"].append(str(root / f"t{index}.parquet"))
        pq.write_table(pa.table({"x": np.arange(index * 100, index * 100 + 5 * (index + 1))}),
                       made["parquet"][-1], row_group_size=5)  # index + 1 row groups
        made["tar"].append(str(root / f"s{index}.tar"))
        with tarfile.open(made["tar"][-1], "w") as tar:
            for sample in range(3):
                info = tarfile.TarInfo(f"k{index}_{sample}.txt")
                info.size = len(value := f"{index}/{sample}".encode())
                tar.addfile(info, io.BytesIO(value))
        made["text"].append(str(root / f"l{index}.txt"))
        with open(made["text"][-1], "w") as handle:
            handle.write("".join(f"{index}-{line}\n" for line in range(4)))
    made["root"] = [str(root)]
    return made


@pytest.fixture(scope="module", params=[2, 3])
def static_service(request, files):
    """A dispatcher configured with the addresses of its ``request.param`` workers."""
    ports = free_ports(request.param)
    dispatcher = data.DispatchServer(data.DispatcherConfig(
        port=0, worker_addresses=[f"localhost:{port}" for port in ports]))
    address = dispatcher.target.split("://")[1]
    workers = [data.WorkerServer(data.WorkerConfig(dispatcher_address=address, port=port,
                                                   readable_dirs=files["root"],
                                                   function_modules=[__name__]))
               for port in ports]
    try:
        wait_for(lambda: dispatcher.num_workers() == len(ports), what="the workers")
        yield dispatcher, len(ports)
    finally:
        for worker in workers:
            worker.stop()
        dispatcher.stop()


def records_of(name):
    """A file name's records (interleave's map_func, allowed on the in-process workers)."""
    return data.TFRecordDataset(name)


def _sources(files):
    root = files["root"][0]
    return {
        "TFRecordDataset": data.TFRecordDataset(files["tfrecord"]),
        "indexed TFRecordDataset": data.TFRecordDataset(
            files["tfrecord"], index_filenames=True, block_bytes=256),  # 1-4 blocks a file
        "list_files": data.Dataset.list_files(f"{root}/f*.tfrecord", shuffle=False)
        .interleave(records_of, cycle_length=2),
        "list_files shuffled": data.Dataset.list_files(f"{root}/f*.tfrecord", seed=5)
        .interleave(records_of, cycle_length=1),
        "from_parquet": data.Dataset.from_parquet(files["parquet"]),
        "from_tar_shards": data.Dataset.from_tar_shards(files["tar"]),
        "from_files": data.Dataset.from_files(files["text"]),
    }


SOURCES = ["TFRecordDataset", "indexed TFRecordDataset", "list_files", "list_files shuffled",
           "from_parquet", "from_tar_shards", "from_files"]


def _key(element):
    if isinstance(element, dict):
        return repr(sorted((k, v if isinstance(v, bytes) else np.asarray(v).tolist())
                           for k, v in element.items()))
    return bytes(element)


def _file_names(source) -> set[str]:
    names = getattr(source, "paths", None)
    if names is None:
        tensors = source.tensors
        names = tensors if isinstance(tensors, np.ndarray) else tensors[0]
    return {n.decode() if isinstance(n, bytes) else n for n in np.asarray(names).tolist()}


@pytest.mark.parametrize("name", SOURCES)
@pytest.mark.parametrize("policy", [data.ShardingPolicy.FILE, data.ShardingPolicy.FILE_OR_DATA])
def test_each_file_is_read_by_the_worker_tf_gives_it_and_every_element_once(
        files, static_service, monkeypatch, name, policy):
    dispatcher, workers = static_service
    shards: dict[int, list[set[str]]] = defaultdict(list)

    def spy(source, index, count):
        shard = splits.file_shard(source, index, count)
        assert count == workers
        shards[index].append(_file_names(shard))
        return shard

    monkeypatch.setattr(worker_module, "file_shard", spy)
    dataset = _sources(files)[name]
    read = [_key(e) for e in dataset.apply(data.distribute(policy, dispatcher.target))]
    assert Counter(read) == Counter(_key(e) for e in dataset)
    assert sorted(shards) == list(range(workers))
    kind = {"from_parquet": "parquet", "from_tar_shards": "tar", "from_files": "text"}.get(
        name, "tfrecord")
    expected = [{files[kind][i] for i in shard} for shard in TF_FILE_SHARDS[workers]]
    # Each stream a worker opens reads TF's shard of that worker (a loaded machine may see a
    # stream opened again, after its reader's retry: the same shard).
    assert {index: [expected[index]] * len(shards[index]) for index in shards} == shards


def test_workers_beyond_the_files_read_nothing(files, static_service, monkeypatch):
    dispatcher, workers = static_service
    shards: dict[int, set[str]] = {}

    def spy(source, index, count):
        shard = splits.file_shard(source, index, count)
        shards[index] = _file_names(shard)
        return shard

    monkeypatch.setattr(worker_module, "file_shard", spy)
    dataset = data.Dataset.from_parquet(files["parquet"][:1])  # one file of 1 row group
    read = [int(e["x"]) for e in dataset.apply(data.distribute(data.ShardingPolicy.FILE,
                                                                 dispatcher.target))]
    assert sorted(read) == list(range(5))
    assert shards == {0: {files["parquet"][0]}, **{k: set() for k in range(1, workers)}}


def test_a_worker_reads_its_files_in_tfs_order(files):
    """Worker 1 of 3 reads the records of files 1 and 4, in file order, as TF's did."""
    root = files["root"][0]
    source = data.Dataset.list_files(f"{root}/f*.tfrecord", shuffle=False)._pipeline.source
    shard = splits.file_shard(source, 1, 3)
    read = [bytes(r).rstrip(b".").decode()
            for r in data.TFRecordDataset(shard.tensors.tolist())]
    assert read == [f"1-{i}" for i in range(3)] + [f"4-{i}" for i in range(6)]


def test_row_groups_and_record_blocks_go_with_their_file(files):
    parquet = data.Dataset.from_parquet(files["parquet"])._pipeline.source
    assert splits.file_numbers(parquet).tolist() == [f for f in range(FILES)
                                                     for _ in range(f + 1)]
    same_twice = data.Dataset.from_parquet(files["parquet"][:2] * 2)._pipeline.source
    assert splits.file_numbers(same_twice).tolist() == [0, 1, 1, 2, 3, 3]
    # Files 5 and 6, twice: 7 and 8 records 116 bytes apart, 3 and 4 blocks of 256 bytes.
    blocks = data.TFRecordDataset(files["tfrecord"][5:] * 2, index_filenames=True,
                                  block_bytes=256)._pipeline.source
    assert splits.file_numbers(blocks).tolist() == [0] * 3 + [1] * 4 + [2] * 3 + [3] * 4


def test_file_sharding_refuses_a_source_that_is_not_files(static_service):
    dispatcher, _ = static_service
    dataset = data.Dataset.range(10).apply(data.distribute(data.ShardingPolicy.FILE,
                                                           dispatcher.target))
    with pytest.raises(InvalidArgumentError, match="TFRecordDataset, from_parquet"):
        list(dataset)


def tf_python() -> str | None:
    """A Python with TensorFlow: CLUSTERWIRE_TF_PYTHON, or this one if it has it."""
    configured = os.environ.get("CLUSTERWIRE_TF_PYTHON")
    if configured:
        return configured
    return sys.executable if importlib.util.find_spec("tensorflow") is not None else None


TF_SHARDS = textwrap.dedent("""
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops.distribute import _AutoShardDataset
    names, pattern = json.loads(sys.argv[1]), sys.argv[2]
    FILE = tf.data.experimental.AutoShardPolicy.FILE
    pipelines = {
        "names": lambda: tf.data.TFRecordDataset(names),
        "list_files": lambda: tf.data.Dataset.list_files(pattern, shuffle=False).interleave(
            tf.data.TFRecordDataset, cycle_length=1),
        "shuffled": lambda: tf.data.Dataset.list_files(pattern, seed=5).interleave(
            tf.data.TFRecordDataset, cycle_length=1)}
    print(json.dumps({f"{name} {n} {k}": [r.numpy().rstrip(b".").decode()
                                         for r in _AutoShardDataset(make(), n, k, FILE)]
                      for name, make in pipelines.items() for n in (2, 3) for k in range(n)}))
""")


@pytest.mark.skipif(tf_python() is None, reason="needs a Python with TensorFlow "
                    "(CLUSTERWIRE_TF_PYTHON=/path/to/python)")
def test_the_shards_are_tfs(files):
    """TF 2.21's FILE auto-sharding of the same files: the records of each worker, in order
    for the unshuffled pipelines, as a set for list_files' shuffle (its order is TF's RNG)."""
    root = files["root"][0]
    done = subprocess.run([tf_python(), "-c", TF_SHARDS, json.dumps(files["tfrecord"]),
                           f"{root}/f*.tfrecord"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    tf_shards = json.loads(done.stdout.strip().splitlines()[-1])
    for name, dataset in [("names", data.TFRecordDataset(files["tfrecord"])),
                          ("list_files", _sources(files)["list_files"]),
                          ("shuffled", _sources(files)["list_files shuffled"])]:
        pipeline = dataset._pipeline
        for workers in (2, 3):
            for index in range(workers):
                shard = splits.file_shard(pipeline.source, index, workers)
                ours = [bytes(r).rstrip(b".").decode()
                        for r in data.Dataset(shard, pipeline.ops)]
                theirs = tf_shards[f"{name} {workers} {index}"]
                if name == "list_files":  # ours interleaves 2 files at a time, TF's 1
                    ours = [bytes(r).rstrip(b".").decode() for r in data.TFRecordDataset(
                        [n.decode() for n in shard.tensors.tolist()])]
                if name == "shuffled":
                    assert sorted(ours) == sorted(theirs), (name, workers, index)
                else:
                    assert ours == theirs, (name, workers, index)
