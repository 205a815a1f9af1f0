"""``Dataset.global_shuffle``: a permutation of a random-access dataset fixed by seed and epoch,
the same locally and through the service whatever the number of workers and consumers."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import cw_data_functions as fns
import numpy as np
import pytest
from conftest import in_process_data_service

from clusterwire import data, errors
from clusterwire.data.pipeline import split_plan
from clusterwire.data.position import split_limit

COUNT = 1000


def ints(dataset) -> list[int]:
    return [int(x) for x in dataset]


def distributed(dataset, target, mode="distributed_epoch", **kwargs):
    return dataset.apply(data.distribute(processing_mode=mode, service=target, **kwargs))


# ---- locally ------------------------------------------------------------------------------

def test_local_iteration_is_a_permutation_of_the_input():
    shuffled = ints(data.Dataset.range(COUNT).global_shuffle(seed=1))
    assert sorted(shuffled) == list(range(COUNT)) and shuffled != list(range(COUNT))


def test_slices_then_map_take_and_skip_are_shuffled_by_index():
    features = np.arange(50, dtype=np.int64) * 10
    dataset = (data.Dataset.from_tensor_slices((features, features + 1))
               .map(fns.add).skip(5).take(40).prefetch(2).global_shuffle(seed=3))
    elements = ints(dataset)
    expected = (2 * features[5:45] + 1).tolist()
    assert sorted(elements) == expected and elements != expected
    assert dataset.cardinality() == 40


def test_the_same_seed_gives_the_same_order_and_another_seed_another():
    def order(seed):
        return ints(data.Dataset.range(COUNT).map(fns.square).global_shuffle(seed=seed))
    assert order(7) == order(7)
    assert order(7) != order(8)


def test_each_epoch_is_reshuffled_unless_told_not_to():
    epochs = ints(data.Dataset.range(COUNT).global_shuffle(seed=2).repeat(3))
    parts = [epochs[i * COUNT:(i + 1) * COUNT] for i in range(3)]
    assert all(sorted(p) == list(range(COUNT)) for p in parts)
    assert len({tuple(p) for p in parts}) == 3
    fixed = ints(data.Dataset.range(COUNT).global_shuffle(seed=2,
                                                          reshuffle_each_iteration=False)
                 .repeat(3))
    assert fixed == parts[0] * 3
    # A new iteration of the same Dataset is a new epoch too (as TF's reshuffle).
    dataset = data.Dataset.range(COUNT).global_shuffle(seed=2)
    assert ints(dataset) == parts[0] and ints(dataset) == parts[1]


def test_no_seed_draws_one_when_the_dataset_is_built():
    dataset = data.Dataset.range(COUNT).global_shuffle(reshuffle_each_iteration=False)
    assert ints(dataset) == ints(dataset)
    other = data.Dataset.range(COUNT).global_shuffle(reshuffle_each_iteration=False)
    assert ints(other) != ints(dataset)


@pytest.mark.parametrize("make,what", [
    (lambda: data.Dataset.range(10).filter(fns.is_even), "filter"),
    (lambda: data.Dataset.range(10).batch(2), "batch"),
    (lambda: data.Dataset.range(10).shuffle(4), "shuffle"),
    (lambda: data.Dataset.range(10).repeat(2), "repeat"),
    (lambda: data.Dataset.from_generator(fns.count_up, args=(5,)), "GeneratorSource"),
    (lambda: data.Dataset.counter(), "CounterSource"),
])
def test_a_non_random_access_input_is_refused_naming_the_fix(make, what):
    with pytest.raises(errors.InvalidArgumentError) as raised:
        make().global_shuffle(seed=1)
    message = str(raised.value)
    assert "global_shuffle needs a random-access input" in message and what in message
    assert "shuffle(buffer_size)" in message


def test_a_file_source_is_refused(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("a\nb\n")
    with pytest.raises(errors.InvalidArgumentError, match="FilesSource is not"):
        data.Dataset.from_files(str(path)).global_shuffle(seed=1)


@pytest.mark.parametrize("kwargs,message", [
    ({"seed": "a"}, "`seed` must be an int64"), ({"seed": 2 ** 63}, "`seed` must be an int64"),
    ({"seed": 1.5}, "`seed` must be an int64"), ({"seed": True}, "`seed` must be an int64"),
    ({"seed": 1, "reshuffle_each_iteration": "yes"}, "must be a bool")])
def test_bad_arguments_are_invalid_argument_errors(kwargs, message):
    with pytest.raises(errors.InvalidArgumentError, match=message):
        data.Dataset.range(10).global_shuffle(**kwargs)


def test_split_positions_stay_offsets_in_the_shuffled_order():
    pipe = data.Dataset.range(COUNT).global_shuffle(seed=1).repeat(3).map(fns.square).pipeline
    plan = split_plan(pipe)
    assert (plan.units, plan.epochs) == (3 * COUNT, 1)  # the epochs are folded into units
    assert split_limit(pipe.source, plan.ops, 250) == 250
    fixed = data.Dataset.range(COUNT).global_shuffle(1, False).repeat(3).pipeline
    assert (split_plan(fixed).units, split_plan(fixed).epochs) == (COUNT, 3)
    endless = data.Dataset.range(COUNT).global_shuffle(seed=1).repeat().pipeline
    with pytest.raises(errors.InvalidArgumentError, match="repeat\\(count\\)"):
        split_plan(endless)


# ---- through the service -------------------------------------------------------------------

def shuffled(seed=11, epochs=1):
    return data.Dataset.range(COUNT).global_shuffle(seed=seed).repeat(epochs).map(fns.square)


def batches(dataset) -> list[tuple[int, ...]]:
    return [tuple(batch.tolist()) for batch in dataset]


def read_batches(datasets, timeout: float = 60.0) -> list[tuple[int, ...]]:
    """The batches of all ``datasets``, read at once (consumers of one job)."""
    with ThreadPoolExecutor(len(datasets)) as pool:
        reads = [pool.submit(batches, d) for d in datasets]
        return [b for read in reads for b in read.result(timeout)]


# A consumer reads several splits at once (the reader's split slots), so its element order
# interleaves splits; a split's size is a multiple of a leading batch's, so batches show
# what each split read: a range of the local order.
@pytest.mark.parametrize("workers,consumers", [(1, 1), (2, 1), (3, 1), (2, 3)])
def test_any_workers_and_consumers_read_ranges_of_the_one_permutation(workers, consumers):
    local = batches(shuffled(epochs=2).batch(100))
    with in_process_data_service(workers=workers) as dispatcher:
        read = read_batches([distributed(shuffled(epochs=2).batch(100), dispatcher.target,
                                         job_name="gs") for _ in range(consumers)])
    assert Counter(read) == Counter(local) and len(local) == 20
    assert sorted(x for batch in read for x in batch) == sorted(
        [x * x for x in range(COUNT)] * 2)


def test_a_split_of_a_whole_epoch_is_the_local_epoch_in_order():
    local = batches(shuffled(epochs=2).batch(COUNT))
    with in_process_data_service(workers=1) as dispatcher:
        read = batches(distributed(shuffled(epochs=2).batch(COUNT), dispatcher.target))
    assert sorted(read) == sorted(local) and local[0] != local[1]


def test_parallel_epochs_workers_each_read_the_whole_permutation():
    local = ints(shuffled())
    with in_process_data_service(workers=2) as dispatcher:
        read = ints(distributed(shuffled(), dispatcher.target, mode="parallel_epochs"))
    assert Counter(read) == Counter(local * 2)


def test_an_endless_reshuffling_repeat_is_refused_in_distributed_epoch():
    endless = data.Dataset.range(COUNT).global_shuffle(seed=1).repeat()
    with in_process_data_service(workers=1) as dispatcher:
        with pytest.raises(errors.InvalidArgumentError, match="parallel_epochs"):
            next(iter(distributed(endless, dispatcher.target)))
        fixed = data.Dataset.range(COUNT).global_shuffle(seed=1, reshuffle_each_iteration=False)
        iterator = iter(distributed(fixed.repeat(), dispatcher.target))
        first = [int(next(iterator)) for _ in range(2 * COUNT)]
        iterator.close()
    assert set(first) <= set(range(COUNT))  # reshuffle_each_iteration=False: accepted


def test_a_stopped_shuffled_iteration_resumes_from_its_position():
    with in_process_data_service(workers=2) as dispatcher:
        iterator = iter(distributed(shuffled(), dispatcher.target, job_name="resume"))
        before = [int(next(iterator)) for _ in range(137)]
        state = json.loads(json.dumps(iterator.state_dict()))
        iterator.close()
        rest = ints(distributed(shuffled(), dispatcher.target, job_name="resume",
                                state=state))
    assert Counter(before + rest) == Counter(ints(shuffled()))


# ---- file sources: Parquet rows, records of indexed TFRecord files -------------------------

ROWS = 240


@pytest.fixture(scope="module")
def row_files(tmp_path_factory):
    """ROWS rows over 3 Parquet files (row groups of 7), as records over 3 indexed TFRecord
    files and as samples over 3 tar shards; the workers' readable dir."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    root = tmp_path_factory.mktemp("rows")
    parquets, tfrecords, shards = [], [], []
    for index, (start, stop) in enumerate([(0, 100), (100, 130), (130, ROWS)]):
        parquets.append(str(root / f"t{index}.parquet"))
        pq.write_table(pa.table({"x": np.arange(start, stop), "y": -np.arange(start, stop)}),
                       parquets[-1], row_group_size=7)
        tfrecords.append(str(root / f"r{index}.tfrecord"))
        with data.TFRecordWriter(tfrecords[-1], index=True) as writer:
            for value in range(start, stop):
                writer.write(b"%d" % value)
        shards.append(str(root / f"s{index}.tar"))
        with tarfile.open(shards[-1], "w") as tar:
            for value in range(start, stop):
                for ext, payload in (("x", b"%d" % value), ("pad", b"." * (value % 5))):
                    info = tarfile.TarInfo(f"v{value:04d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return {"root": str(root), "parquet": parquets, "tfrecord": tfrecords, "tar": shards}


def file_rows(files, kind, seed=3):
    if kind == "parquet":
        return data.Dataset.from_parquet(files["parquet"], columns=["x"]).global_shuffle(seed)
    if kind == "tar":
        return data.Dataset.from_tar_shards(files["tar"], indexed=True).global_shuffle(seed)
    return data.TFRecordDataset(files["tfrecord"], index_filenames=True,
                                block_bytes=256).global_shuffle(seed)


def row_batches(dataset) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in (b["x"] if isinstance(b, dict) else b).tolist())
            for b in dataset]


@pytest.mark.parametrize("kind", ["parquet", "tfrecord", "tar"])
def test_file_rows_are_a_permutation_fixed_by_seed_and_epoch(row_files, kind):
    dataset = file_rows(row_files, kind).batch(ROWS)
    first, second = row_batches(dataset.repeat(2))
    assert sorted(first) == sorted(second) == list(range(ROWS)) and first != second
    assert row_batches(file_rows(row_files, kind).batch(ROWS))[0] == first
    assert row_batches(file_rows(row_files, kind, seed=4).batch(ROWS))[0] != first


@pytest.mark.parametrize("kind", ["parquet", "tfrecord", "tar"])
@pytest.mark.parametrize("workers,consumers", [(1, 1), (2, 1), (2, 3)])
def test_file_rows_through_any_workers_and_consumers_are_ranges_of_one_permutation(
        row_files, kind, workers, consumers):
    local = row_batches(file_rows(row_files, kind).batch(20))
    with in_process_data_service(workers, readable_dirs=[row_files["root"]]) as dispatcher:
        with ThreadPoolExecutor(consumers) as pool:
            reads = [pool.submit(row_batches, distributed(
                file_rows(row_files, kind).batch(20), dispatcher.target, job_name="rows"))
                for _ in range(consumers)]
            read = [b for r in reads for b in r.result(60)]
    assert Counter(read) == Counter(local) and len(local) == ROWS // 20
    assert sorted(x for b in read for x in b) == list(range(ROWS))


def test_file_sources_without_random_access_are_refused_naming_the_fix(row_files):
    for dataset, what in [
            (data.TFRecordDataset(row_files["tfrecord"]), "TFRecordRead"),
            (data.Dataset.from_parquet(row_files["parquet"], batch_rows=4), "ParquetRead"),
            (data.Dataset.from_tar_shards(row_files["tar"]), "TarShardRead"),
            (data.Dataset.list_files(f"{row_files['root']}/*.tfrecord"), "Shuffle")]:
        with pytest.raises(errors.InvalidArgumentError, match=f"(?i){what}.* is not"):
            dataset.global_shuffle(seed=1)
    names = data.Dataset.list_files(f"{row_files['root']}/*.tfrecord", shuffle=False)
    assert sorted(n.decode() for n in names.global_shuffle(seed=1)) == row_files["tfrecord"]


@pytest.mark.parametrize("kind", ["parquet", "tfrecord", "tar"])
def test_a_worker_reads_shuffled_rows_only_under_its_readable_dirs(row_files, kind, tmp_path):
    """The random-access reads open files as the sequential ones do: a file outside the
    workers' readable_dirs is refused, naming it."""
    with in_process_data_service(1, readable_dirs=[str(tmp_path)]) as dispatcher:
        outside = f"does not read '{row_files['root']}"
        with pytest.raises(errors.PermissionDeniedError, match=outside):
            list(distributed(file_rows(row_files, kind), dispatcher.target))
