"""Provenance (issue 31): element ids through the data service, ``data.replay`` and
``merge_states(..., skip_ids=...)``.

Against a real in-process dispatcher with 2 workers on 127.0.0.1: the ids of a
distributed_epoch epoch read by several consumers of one job are a permutation of the source
ids (map/filter/batch, global_shuffle, padded_batch, TFRecord files), each element the value
its id says (the id travels with its element); parallel_epochs gives each worker's copy its
ids; replay makes the same elements from the ids alone; a skip list merged into a job position
leaves those elements out of the rest of the epoch, which still arrives exactly once, also
after a second save and merge of the resumed consumers; transformations and reads where ids
are not defined, and bad ids, are refused with errors naming them."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import in_process_data_service, wait_for

from clusterwire import data, errors
from clusterwire.data import provenance
from clusterwire.data.limits import MAX_SKIP_IDS

pytestmark = pytest.mark.timeout(240)

COUNT = 16 * 512  # 16 splits (SPLITS_PER_WORKER on each of 2 workers) of 512 elements
BATCH = 8


@data.function
def square(x):
    return x * x


@data.function
def not_multiple_of_3(x):
    return x % 3 != 0


@data.function
def row(x):
    """A row whose length depends on the element (for padded_batch)."""
    return np.full(int(x) % 5 + 1, x, dtype=np.int64)


@data.function
def record_bytes(record):
    return record + b"!"


@data.function
def add_one(x, y):
    return x + y


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tmp_path_factory.mktemp("provenance")


@pytest.fixture(scope="module")
def service(files):
    with in_process_data_service(workers=2, readable_dirs=[str(files)]) as dispatcher:
        yield dispatcher


def read_all(iterators, timeout: float = 120.0) -> list[list]:
    """Every element of each iterator, read at once on threads of their own (consumers of
    one job)."""
    with ThreadPoolExecutor(len(iterators)) as pool:
        reads = [pool.submit(lambda it=it: list(it)) for it in iterators]
        return [read.result(timeout) for read in reads]


def consumers(service, dataset, count: int, job_name: str, **options) -> list:
    dataset_id = data.register_dataset(service.target, dataset)
    return [iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                      job_name=job_name, element_ids=True, **options))
            for _ in range(count)]


def rows(pairs) -> list[int]:
    """The source ids of ``(id, element)`` pairs (a batch's: its rows')."""
    return [i for raw, _ in pairs for i in provenance.flatten(raw)]


# ---- ids through the service -----------------------------------------------------------------

PIPELINES = {
    "map_filter_batch": (lambda: data.Dataset.range(COUNT).map(square)
                         .filter(not_multiple_of_3).batch(BATCH),
                         [i for i in range(COUNT) if i * i % 3], lambda i: i * i),
    "global_shuffle_map_batch": (lambda: data.Dataset.range(COUNT).global_shuffle(seed=5)
                                 .map(square).batch(BATCH),
                                 list(range(COUNT)), lambda i: i * i),
    "slices_shuffle": (lambda: data.Dataset.from_tensor_slices(np.arange(COUNT) * 10)
                       .shuffle(64, seed=3), list(range(COUNT)), lambda i: i * 10),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_ids_of_a_distributed_epoch_are_a_permutation_of_the_source_ids(service, name):
    make, expected, value_of = PIPELINES[name]
    reads = read_all(consumers(service, make(), 3, f"ids-{name}"))
    assert all(reads), "every consumer got elements"
    pairs = [pair for read in reads for pair in read]
    assert Counter(rows(pairs)) == Counter(expected)
    for raw, element in pairs:  # the id travelled with its element
        assert np.array_equal(element, np.vectorize(value_of)(np.asarray(raw)))
    sample = [pairs[0][0], pairs[len(pairs) // 2][0], pairs[-1][0]]
    assert [(i, e.tolist() if hasattr(e, "tolist") else e)
            for i, e in data.replay(make(), sample)] == \
        [(raw, element.tolist()) for raw, element in (pairs[0], pairs[len(pairs) // 2],
                                                      pairs[-1])]


def test_local_ids_match_the_service_ids(service):
    dataset = data.Dataset.range(1000).global_shuffle(seed=9).map(square).batch(BATCH)
    local = {tuple(raw): element.tolist() for raw, element in dataset.with_element_ids()}
    served = {tuple(raw): element.tolist()
              for read in read_all(consumers(service, dataset, 2, "local-vs-service"))
              for raw, element in read}
    assert {i for ids in served for i in ids} == set(range(1000))
    by_row_local = {i: v for ids, values in local.items() for i, v in zip(ids, values,
                                                                          strict=True)}
    by_row_served = {i: v for ids, values in served.items() for i, v in zip(ids, values,
                                                                           strict=True)}
    assert by_row_local == by_row_served


def test_padded_batch_ids_and_replay(service):
    def make():
        return data.Dataset.range(500).map(row).padded_batch(4)
    pairs = [pair for read in read_all(consumers(service, make(), 2, "padded"))
             for pair in read]
    assert sorted(rows(pairs)) == list(range(500))
    replayed = data.replay(make(), [raw for raw, _ in pairs[:5]])
    for (raw, element), (again_id, again) in zip(pairs[:5], replayed, strict=True):
        assert again_id == raw
        assert np.array_equal(again, element)


def test_parallel_epochs_gives_every_worker_copy_its_ids(service):
    dataset = data.Dataset.range(300).map(square)
    read = list(dataset.apply(data.distribute("parallel_epochs", service.target,
                                              element_ids=True)))
    assert Counter(raw for raw, _ in read) == Counter(list(range(300)) * 2)
    assert all(element == raw * raw for raw, element in read)


@pytest.fixture(scope="module")
def tfrecords(files):
    """3 TFRecord files of 7, 0 and 40 records: record r of file f is b"f:r"."""
    root = files
    names = []
    for file, count in enumerate((7, 0, 40)):
        name = str(root / f"part-{file}.tfrecord")
        with data.TFRecordWriter(name) as writer:
            for record in range(count):
                writer.write(f"{file}:{record}".encode())
        names.append(name)
    return names


@pytest.mark.parametrize("reads", [None, 2], ids=["one_by_one", "parallel_reads"])
def test_tfrecord_ids_are_file_and_record(service, tfrecords, reads):
    def make():
        return data.TFRecordDataset(tfrecords, num_parallel_reads=reads).map(record_bytes)
    pairs = [pair for read in read_all(consumers(service, make(), 2, f"tfrecord-{reads}"))
             for pair in read]
    expected = [f * provenance.FILE_STRIDE + r for f, count in enumerate((7, 0, 40))
                for r in range(count)]
    assert Counter(raw for raw, _ in pairs) == Counter(expected)
    for raw, element in pairs:
        file, record = provenance.file_record(raw)
        assert element == f"{file}:{record}!".encode()
    wanted = [2 * provenance.FILE_STRIDE + 39, 3, 2 * provenance.FILE_STRIDE]
    assert data.replay(make(), wanted) == [(i, dict(pairs)[i]) for i in wanted]
    with pytest.raises(errors.InvalidArgumentError, match="file 2 has 40 records, not 41"):
        data.replay(make(), [2 * provenance.FILE_STRIDE + 40])


def test_text_line_ids_are_file_and_line(service, files):
    names = []
    for file, count in enumerate((3, 5)):
        name = files / f"lines-{file}.txt"
        name.write_text("".join(f"{file}/{line}\n" for line in range(count)))
        names.append(str(name))
    pairs = [pair for read in read_all(consumers(service, data.Dataset.from_files(names), 2,
                                                 "lines")) for pair in read]
    assert sorted(raw for raw, _ in pairs) == [
        f * provenance.FILE_STRIDE + r for f, count in enumerate((3, 5)) for r in range(count)]
    for raw, element in pairs:
        assert element == "{}/{}".format(*provenance.file_record(raw)).encode()
    assert data.replay(data.Dataset.from_files(names), [provenance.FILE_STRIDE + 4, 0]) == [
        (provenance.FILE_STRIDE + 4, b"1/4"), (0, b"0/0")]


def test_tar_shard_sample_ids_are_shard_and_sample(service, files):
    names = []
    for shard, count in enumerate((4, 6)):
        name = files / f"shard-{shard}.tar"
        with tarfile.open(name, "w") as tar:
            for sample in range(count):
                body = f"{shard}.{sample}".encode()
                info = tarfile.TarInfo(f"s{sample:04d}.txt")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
        names.append(str(name))
    pairs = [pair for read in read_all(consumers(service, data.Dataset.from_tar_shards(names),
                                                 2, "tar")) for pair in read]
    assert sorted(raw for raw, _ in pairs) == [
        f * provenance.FILE_STRIDE + r for f, count in enumerate((4, 6)) for r in range(count)]
    for raw, sample in pairs:
        assert sample["txt"] == "{}.{}".format(*provenance.file_record(raw)).encode()
    wanted = provenance.FILE_STRIDE + 5
    assert data.replay(data.Dataset.from_tar_shards(names), [wanted])[0][1]["txt"] == b"1.5"


@pytest.mark.parametrize("batch_rows", [None, 3])
def test_parquet_row_ids_are_file_and_row(service, files, batch_rows):
    pq = pytest.importorskip("pyarrow.parquet", reason="pip install 'clusterwire[parquet]'")
    pa = pytest.importorskip("pyarrow")
    names = []
    for file, count in enumerate((10, 7)):
        name = files / f"part-{file}.parquet"
        pq.write_table(pa.table({"v": [file * 1000 + row for row in range(count)]}), name,
                       row_group_size=4)
        names.append(str(name))
    dataset = data.Dataset.from_parquet(names, batch_rows=batch_rows)
    pairs = [pair for read in read_all(consumers(service, dataset, 2, f"parquet-{batch_rows}"))
             for pair in read]
    expected = [f * provenance.FILE_STRIDE + r for f, count in enumerate((10, 7))
                for r in range(count)]
    assert Counter(rows(pairs)) == Counter(expected)
    for raw, element in pairs:
        ids = provenance.flatten(raw)
        assert [f * 1000 + r for f, r in map(provenance.file_record, ids)] == \
            np.atleast_1d(element["v"]).tolist()
    if batch_rows is None:
        wanted = [provenance.FILE_STRIDE + 6, 5, provenance.FILE_STRIDE]
        assert [element["v"] for _, element in data.replay(dataset, wanted)] == \
            [1006, 5, 1000]
        with pytest.raises(errors.InvalidArgumentError, match="not in the epoch"):
            data.replay(dataset, [provenance.FILE_STRIDE + 7])
    else:
        with pytest.raises(errors.InvalidArgumentError, match="without batch_rows"):
            data.replay(dataset, [0])


# ---- what is refused ---------------------------------------------------------------------------

@pytest.mark.parametrize("make,op", [
    (lambda: data.Dataset.range(10).scan(0, add_one), "scan"),
    (lambda: data.Dataset.range(10).unique(), "unique"),
    (lambda: data.Dataset.range(10).window(2), "window"),
    (lambda: data.Dataset.range(10).concatenate(data.Dataset.range(3)), "concatenate"),
    (lambda: data.Dataset.range(10).batch(2).rebatch(3), "rebatch"),
    (lambda: data.Dataset.from_tensors(1), "the source tensors"),
    (lambda: data.Dataset.zip(data.Dataset.range(3), data.Dataset.range(3)), "the source zip"),
])
def test_element_ids_are_refused_where_not_defined(service, make, op):
    with pytest.raises(errors.InvalidArgumentError, match=f"not defined through {op}"):
        make().apply(data.distribute("distributed_epoch", service.target, element_ids=True))
    with pytest.raises(errors.InvalidArgumentError, match=f"not defined through {op}"):
        make().with_element_ids()


def test_bad_element_ids_arguments_are_refused(service):
    with pytest.raises(errors.InvalidArgumentError, match="file shard"):
        data.distribute(data.ShardingPolicy.FILE, service.target, element_ids=True)
    with pytest.raises(TypeError, match="must be a bool"):
        data.distribute("distributed_epoch", service.target, element_ids="yes")
    tagged = data.Dataset.range(5).with_element_ids()
    with pytest.raises(errors.InvalidArgumentError, match="for local iteration"):
        tagged.apply(data.distribute("distributed_epoch", service.target))
    dataset_id = data.register_dataset(service.target, data.Dataset.range(5).unique())
    with pytest.raises(errors.InvalidArgumentError, match="not defined through unique"):
        list(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                  element_ids=True))


def test_a_named_job_is_read_with_ids_by_all_its_consumers_or_none(service):
    dataset_id = data.register_dataset(service.target, data.Dataset.range(50))
    with_ids = iter(data.from_dataset_id("parallel_epochs", service.target, dataset_id,
                                         job_name="mixed", element_ids=True))
    assert next(with_ids) == (0, 0)
    without = iter(data.from_dataset_id("parallel_epochs", service.target, dataset_id,
                                        job_name="mixed"))
    with pytest.raises(errors.InvalidArgumentError, match="same element_ids"):
        list(without)
    with_ids.close()


def test_replay_refuses_ids_not_in_the_epoch():
    dataset = data.Dataset.range(100).filter(not_multiple_of_3)
    assert data.replay(dataset, [1, 2]) == [(1, 1), (2, 2)]
    with pytest.raises(errors.InvalidArgumentError, match="id 100 is not in the epoch"):
        data.replay(dataset, [100])
    with pytest.raises(errors.InvalidArgumentError, match="filter leaves it out"):
        data.replay(dataset, [3])
    with pytest.raises(errors.InvalidArgumentError, match="pass their ids, not lists"):
        data.replay(dataset, [[1, 2]])
    with pytest.raises(errors.InvalidArgumentError, match="pass the list of ids of a batch"):
        data.replay(dataset.batch(2), [1])
    with pytest.raises(errors.InvalidArgumentError, match="not an element id"):
        data.replay(dataset, [-1])
    with pytest.raises(errors.InvalidArgumentError, match="through enumerate"):
        data.replay(dataset.enumerate(), [1])
    shuffled = data.Dataset.range(100).skip(10).global_shuffle(seed=1)
    with pytest.raises(errors.InvalidArgumentError, match="from index 10"):
        data.replay(shuffled, [5])


# ---- skip on resume ------------------------------------------------------------------------------

TAKE = 40  # batches each old consumer returns before its position is saved
AFTER = 5  # and after: the "loss spike" steps, skipped on resume


def save_with_spike(iterators) -> tuple[list, list[dict], list]:
    """Each consumer returns TAKE batches, saves its position (through JSON), returns AFTER
    more (the steps to skip) and is closed: (batches before, positions, batches after)."""

    def run(iterator):
        before = [next(iterator) for _ in range(TAKE)]
        state = json.loads(json.dumps(iterator.state_dict()))
        after = [next(iterator) for _ in range(AFTER)]
        iterator.close()
        return before, state, after

    with ThreadPoolExecutor(len(iterators)) as pool:
        results = [f.result(120) for f in [pool.submit(run, i) for i in iterators]]
    return ([p for before, _, _ in results for p in before], [s for _, s, _ in results],
            [p for _, _, after in results for p in after])


def test_skip_ids_leave_the_spike_out_and_the_rest_arrives_once(service):
    dataset = data.Dataset.range(COUNT).batch(BATCH)
    dataset_id = data.register_dataset(service.target, dataset)

    def resumed(count, state):
        return [iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                          job_name="skip", element_ids=True, state=state,
                                          max_outstanding_requests=1))
                for _ in range(count)]

    old = [iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                     job_name="skip", element_ids=True,
                                     max_outstanding_requests=1)) for _ in range(3)]
    before, states, spike = save_with_spike(old)
    skipped = [raw for raw, _ in spike[1:]]  # whole batches ...
    half = spike[0][0][:BATCH // 2]  # ... and half of one
    skipped.append(half)
    merged = json.loads(json.dumps(data.merge_states(states, skip_ids=skipped)))
    assert len(merged["skip"]) == (len(spike) - 1) * BATCH + BATCH // 2
    # Two new consumers read a while, save, stop; their positions carry the skip list.
    first = resumed(2, merged)
    middle = []
    again = []
    for iterator in first:
        middle += [next(iterator) for _ in range(30)]
        again.append(json.loads(json.dumps(iterator.state_dict())))
        iterator.close()
    assert all(state["skip"] == merged["skip"] for state in again)
    rest = [p for read in read_all(resumed(3, data.merge_states(again))) for p in read]
    returned = before + middle + rest
    assert Counter(rows(returned)) == Counter(
        set(range(COUNT)) - set(provenance.flatten(skipped)))
    for raw, element in returned:
        assert element.tolist() == raw
    partial = [(raw, element) for raw, element in middle + rest if raw == spike[0][0][BATCH // 2:]]
    assert len(partial) == 1, "the half-skipped batch arrives with its other rows"


def test_skip_ids_hold_across_a_sigkilled_dispatcher(processes, tmp_path):
    """Save, SIGKILL the fault-tolerant dispatcher, restart it on its port, resume 2 -> 3
    with skip ids: the epoch minus the skipped ids, once (the list lives in the consumers)."""
    ft = ["--fault-tolerant-mode", "--work-dir", str(tmp_path / "work")]
    dispatcher = processes("dispatcher", "--port", "0", *ft)
    for _ in range(2):
        processes("worker", "--dispatcher-address", dispatcher.address,
                  "--heartbeat-interval-ms", "200")
    wait_for(lambda: len(data.service_status(dispatcher.target).workers) == 2,
             timeout=30, what="workers registered")
    dataset_id = data.register_dataset(dispatcher.target,
                                       data.Dataset.range(COUNT).global_shuffle(seed=4)
                                       .batch(BATCH))
    old = [iter(data.from_dataset_id("distributed_epoch", dispatcher.target, dataset_id,
                                     job_name="ranks", element_ids=True,
                                     max_outstanding_requests=1)) for _ in range(2)]
    before, states, spike = save_with_spike(old)
    merged = data.merge_states(states, skip_ids=[raw for raw, _ in spike])
    port = dispatcher.port
    dispatcher.kill()
    dispatcher = processes("dispatcher", "--port", str(port), *ft)
    rest = [pair for read in read_all([
        iter(data.from_dataset_id("distributed_epoch", dispatcher.target, dataset_id,
                                  job_name="ranks", element_ids=True, state=merged))
        for _ in range(3)]) for pair in read]
    skipped = set(provenance.flatten([raw for raw, _ in spike]))
    assert len(skipped) == len(spike) * BATCH
    assert Counter(rows(before + rest)) == Counter(set(range(COUNT)) - skipped)


def test_skip_ids_are_bounded_and_checked(service):
    dataset = data.Dataset.range(COUNT).batch(BATCH)
    dataset_id = data.register_dataset(service.target, dataset)
    old = [iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                     job_name="skip-bounds", element_ids=True,
                                     max_outstanding_requests=1)) for _ in range(2)]
    _, states, _ = save_with_spike(old)
    with pytest.raises(errors.ResourceExhaustedError, match=f"at most {MAX_SKIP_IDS}"):
        data.merge_states(states, skip_ids=list(range(MAX_SKIP_IDS + 1)))
    assert len(data.merge_states(states, skip_ids=list(range(MAX_SKIP_IDS)))["skip"]) == \
        MAX_SKIP_IDS
    for bad in (["7"], [1.5], [[1, -2]], [True]):
        with pytest.raises(errors.InvalidArgumentError, match="not an element id"):
            data.merge_states(states, skip_ids=bad)
    merged = data.merge_states(states, skip_ids=[1])
    with pytest.raises(errors.InvalidArgumentError, match="'skip' must be a list"):
        data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                             job_name="skip-bounds", state={**merged, "skip": "1"})
    with pytest.raises(errors.ResourceExhaustedError, match=f"at most {MAX_SKIP_IDS}"):
        data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                             job_name="skip-bounds",
                             state={**merged, "skip": list(range(MAX_SKIP_IDS + 1))})
    single = iter(data.from_dataset_id("parallel_epochs", service.target, dataset_id))
    next(single)
    state = single.state_dict()
    single.close()
    with pytest.raises(errors.InvalidArgumentError, match="Only distributed_epoch positions"):
        data.from_dataset_id("parallel_epochs", service.target, dataset_id,
                             state={**state, "skip": [1]})
