"""Provenance (issue 31) through TF's file pipeline: ``list_files`` + ``interleave`` /
``flat_map`` of a read of one file, optionally ``.map(parse).batch(n)``.

Against a real in-process dispatcher with 2 workers on 127.0.0.1, 3 consumers of one
distributed_epoch job (a split is a file): the ids of the epoch are a permutation of the
source ids ``file index in list_files' sorted list * 2**40 + record``, each element is the
value its id names, a shuffled ``list_files`` (another seed, or none) gives every record the
same id, and ``data.replay`` makes the same elements without the service. The same for
flat_map of a TFRecord, text-line, tar-shard or Parquet read, for
``TFRecordDataset(list_files(...))`` and in parallel_epochs (files interleaved on 2
threads); skip ids on resume inside a file's split leave out those records only. A function
whose Dataset is not a read of one file is refused with an InvalidArgumentError naming
interleave / flat_map: before anything is read for the first name, and where it is read
for another (ignore_errors does not hide it)."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import in_process_data_service

from clusterwire import data, errors
from clusterwire.data import provenance

pytestmark = pytest.mark.timeout(240)

#: Records of each file, in list_files' sorted order (part-0 .. part-5): an empty file, a
#: file of one record and files longer than a parallel interleave's read-ahead.
COUNTS = (13, 0, 40, 1, 27, 9)
STRIDE = provenance.FILE_STRIDE
SOURCE_IDS = [f * STRIDE + r for f, count in enumerate(COUNTS) for r in range(count)]


def value(element_id: int) -> bytes:
    """The record an id names: record r of part-f holds b"f:r"."""
    return "{}:{}".format(*provenance.file_record(element_id)).encode()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """part-{f}.tfrecord / .txt / .tar (/ .parquet with pyarrow) of COUNTS[f] records,
    lines, samples (rows in row groups of 4) each."""
    root = tmp_path_factory.mktemp("provenance_files")
    for file, count in enumerate(COUNTS):
        with data.TFRecordWriter(str(root / f"part-{file}.tfrecord")) as writer:
            for record in range(count):
                writer.write(f"{file}:{record}".encode())
        (root / f"part-{file}.txt").write_text(
            "".join(f"{file}:{line}\n" for line in range(count)))
        with tarfile.open(root / f"part-{file}.tar", "w") as tar:
            for sample in range(count):
                body = f"{file}:{sample}".encode()
                info = tarfile.TarInfo(f"s{sample:04d}.txt")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            continue
        column = pa.array([f"{file}:{row}".encode() for row in range(count)], pa.binary())
        pq.write_table(pa.table({"txt": column}), root / f"part-{file}.parquet",
                       row_group_size=4)
    return root


@pytest.fixture(scope="module")
def service(root):
    with in_process_data_service(workers=2, readable_dirs=[str(root)]) as dispatcher:
        yield dispatcher


@data.function
def records_of(name):
    return data.TFRecordDataset(name)


@data.function
def lines_of(name):
    return data.Dataset.from_files(name.decode())


@data.function
def samples_of(name):
    return data.Dataset.from_tar_shards(name).map(sample_text)


@data.function
def sample_text(sample):
    return sample["txt"]


@data.function
def rows_of(name):
    return data.Dataset.from_parquet(name.decode()).map(sample_text)


@data.function
def parse(record):
    return record + b"!"


@data.function
def range_of_name(name):
    return data.Dataset.range(len(name))


@data.function
def first_file_only(name):
    """A read of its one file for part-0, of the file twice for any other name."""
    if name.endswith(b"part-0.tfrecord"):
        return data.TFRecordDataset(name)
    return data.TFRecordDataset([name, name])


def pipeline(root, seed, batch: int | None = 4):
    """TF's pipeline: list_files(shuffle, seed) + interleave(TFRecordDataset, cycle_length=2,
    num_parallel_calls=2) + map(parse) (+ batch)."""
    files = data.Dataset.list_files(str(root / "*.tfrecord"), shuffle=seed is not None,
                                    seed=seed)
    dataset = files.interleave(records_of, cycle_length=2, num_parallel_calls=2).map(parse)
    return dataset if batch is None else dataset.batch(batch)


def read_job(service, dataset, job_name: str, consumers: int = 3, timeout: float = 120.0
             ) -> list[tuple]:
    """Every ``(id, element)`` of one distributed_epoch job read with ids by ``consumers``
    consumers at once (each on a thread of its own; a read not ending in ``timeout`` fails)."""
    dataset_id = data.register_dataset(service.target, dataset)
    iterators = [iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                           job_name=job_name, element_ids=True))
                 for _ in range(consumers)]
    try:
        with ThreadPoolExecutor(consumers) as pool:
            reads = [pool.submit(lambda it=it: list(it)) for it in iterators]
            return [pair for read in reads for pair in read.result(timeout)]
    finally:
        for iterator in iterators:
            iterator.close()


def by_id(pairs) -> dict[int, bytes]:
    """Each row's value by its id, from ``(id, element)`` pairs of batches or rows."""
    rows: dict[int, bytes] = {}
    for raw, element in pairs:
        for element_id, row in zip(provenance.flatten(raw), np.atleast_1d(element).tolist(),
                                   strict=True):
            assert element_id not in rows, f"id {element_id} twice"
            rows[element_id] = row
    return rows


def test_list_files_interleave_map_batch_ids_are_a_permutation_and_replay(root, service):
    dataset = pipeline(root, seed=11)
    pairs = read_job(service, dataset, "tf-pipeline")
    ids = [i for raw, _ in pairs for i in provenance.flatten(raw)]
    assert Counter(ids) == Counter(SOURCE_IDS), "every source record once, with its id"
    assert by_id(pairs) == {i: value(i) + b"!" for i in SOURCE_IDS}, \
        "each row is the one its id names"
    replayed = data.replay(pipeline(root, seed=11), [raw for raw, _ in pairs])
    assert [(raw, element.tolist()) for raw, element in replayed] == \
        [(raw, element.tolist()) for raw, element in pairs]


def test_list_files_shuffle_does_not_change_ids(root, service):
    """Another seed (the files come in another order, to other splits), and no shuffle at
    all, locally: every record has the id it had."""
    served = by_id(read_job(service, pipeline(root, seed=12, batch=None), "tf-seed-12",
                            consumers=2))
    local = by_id(pipeline(root, seed=None, batch=None).with_element_ids())
    assert served == local == {i: value(i) + b"!" for i in SOURCE_IDS}
    replayed = data.replay(pipeline(root, seed=3, batch=None), [2 * STRIDE + 39, 5 * STRIDE])
    assert replayed == [(2 * STRIDE + 39, b"2:39!"), (5 * STRIDE, b"5:0!")]


@pytest.mark.parametrize("reader,ext", [(records_of, "tfrecord"), (lines_of, "txt"),
                                        (samples_of, "tar"), (rows_of, "parquet")])
def test_flat_map_of_a_one_file_read_has_file_and_record_ids(root, service, reader, ext):
    if ext == "parquet":
        pytest.importorskip("pyarrow.parquet", reason="pip install 'clusterwire[parquet]'")
    def make():
        return data.Dataset.list_files(str(root / f"*.{ext}"), seed=5).flat_map(reader)
    pairs = read_job(service, make(), f"flat-map-{ext}")
    assert Counter(raw for raw, _ in pairs) == Counter(SOURCE_IDS)
    assert all(element == value(raw) for raw, element in pairs)
    wanted = [4 * STRIDE + 26, 0, 3 * STRIDE]
    assert data.replay(make(), wanted) == [(i, value(i)) for i in wanted]
    with pytest.raises(errors.InvalidArgumentError, match="for file 3 gives 1 records, none "
                                                          "of them record 1"):
        data.replay(make(), [3 * STRIDE + 1])


def test_parallel_epochs_interleaves_files_with_their_ids(root, service):
    """parallel_epochs: each worker reads the whole epoch through one interleave, 2 files
    open on 2 threads at once: each worker's copy has every id once, with its record."""
    pairs = list(pipeline(root, seed=2).apply(data.distribute(
        "parallel_epochs", service.target, element_ids=True)))
    ids = [i for raw, _ in pairs for i in provenance.flatten(raw)]
    assert Counter(ids) == Counter(SOURCE_IDS * 2)
    for raw, element in pairs:
        assert element.tolist() == [value(i) + b"!" for i in raw]


def test_a_tfrecord_read_of_shuffled_list_files_has_ids(root, service):
    def make():
        return data.TFRecordDataset(data.Dataset.list_files(str(root / "*.tfrecord"), seed=4),
                                    num_parallel_reads=2)
    pairs = read_job(service, make(), "tfrecord-of-list-files")
    assert Counter(raw for raw, _ in pairs) == Counter(SOURCE_IDS)
    assert all(element == value(raw) for raw, element in pairs)
    assert data.replay(make(), [4 * STRIDE + 3]) == [(4 * STRIDE + 3, b"4:3")]


def test_a_function_returning_a_range_is_refused_before_anything_is_read(root, service):
    files = data.Dataset.list_files(str(root / "*.tfrecord"), seed=1)
    why = "its function returned the source range, where ids need a read of one file"
    with pytest.raises(errors.InvalidArgumentError,
                       match=f"not defined through interleave: {why}"):
        files.interleave(range_of_name, cycle_length=2).apply(data.distribute(
            "distributed_epoch", service.target, element_ids=True))
    with pytest.raises(errors.InvalidArgumentError, match=f"not defined through flat_map: {why}"):
        files.flat_map(range_of_name).with_element_ids()
    with pytest.raises(errors.InvalidArgumentError, match=f"not defined through flat_map: {why}"):
        data.replay(files.flat_map(range_of_name), [0])


def test_a_function_reading_several_files_is_refused_where_it_is_read(root, service):
    """``first_file_only`` passes the check (run on part-0, the first name of the sorted
    list); the worker refuses the Dataset it returns for the next name it opens, and the
    consumer's read raises that error."""
    dataset = data.Dataset.list_files(str(root / "*.tfrecord"), seed=1).interleave(
        first_file_only, cycle_length=2)
    why = "not defined through interleave: its function returned a read of 2 files"
    with pytest.raises(errors.InvalidArgumentError, match=why):
        read_job(service, dataset, "not-one-file", consumers=1)
    with pytest.raises(errors.InvalidArgumentError, match=why):
        list(dataset.with_element_ids())
    # ignore_errors leaves out a failed read, not these files' records: the read fails.
    with pytest.raises(errors.InvalidArgumentError, match=why):
        read_job(service, dataset.ignore_errors(), "not-one-file-ignored", consumers=1)
    without_ids = list(dataset.ignore_errors())
    assert Counter(without_ids) == Counter(
        [value(i) for i in SOURCE_IDS] + [value(i) for i in SOURCE_IDS if i >= STRIDE])


def test_names_changed_before_the_read_are_refused(root):
    names = data.Dataset.list_files(str(root / "*.tfrecord"), shuffle=False)
    with pytest.raises(errors.InvalidArgumentError, match="not defined through map of file "
                                                          "names"):
        names.map(parse).interleave(records_of).with_element_ids()
    with pytest.raises(errors.InvalidArgumentError, match="not defined through interleave: "
                                                          "its elements come from"):
        data.Dataset.range(3).map(parse).interleave(records_of).with_element_ids()


#: Records of the 16 files of the resume test: more files than the 3 consumers' read-ahead
#: holds (2 splits per worker each; a consumer left without one would wait for splits the
#: others keep in their saved positions), each of 8 batches or more.
LONG_COUNTS = tuple(30 + file * 7 % 23 for file in range(16))


@pytest.fixture(scope="module")
def long_root(root):
    """root/long/part-{ff}.tfrecord of LONG_COUNTS[f] records (under the readable dir),
    sorted by name in file order."""
    long = root / "long"
    long.mkdir()
    for file, count in enumerate(LONG_COUNTS):
        with data.TFRecordWriter(str(long / f"part-{file:02d}.tfrecord")) as writer:
            for record in range(count):
                writer.write(f"{file}:{record}".encode())
    return long


def test_skip_ids_on_resume_mid_file(long_root, service):
    """3 consumers read 3 batches each, save, read 1 more (the "spike"); 2 consumers resume
    from the merged position with the spike's ids skipped: a saved split is resumed inside
    its file, and every record but the skipped arrives once over the run, each its id's."""
    source_ids = [f * STRIDE + r for f, count in enumerate(LONG_COUNTS) for r in range(count)]
    dataset_id = data.register_dataset(service.target, pipeline(long_root, seed=21))

    def consumer(state=None):
        return iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                         job_name="skip-files", element_ids=True, state=state,
                                         max_outstanding_requests=1))

    def save(iterator):
        try:
            before = [next(iterator) for _ in range(3)]
            state = json.loads(json.dumps(iterator.state_dict()))
            return before, state, next(iterator)
        finally:
            iterator.close()

    with ThreadPoolExecutor(3) as pool:
        saved = [f.result(120) for f in [pool.submit(save, consumer()) for _ in range(3)]]
    before = [pair for pairs, _, _ in saved for pair in pairs]
    spike = [raw for _, _, (raw, _) in saved]
    merged = data.merge_states([state for _, state, _ in saved], skip_ids=spike)
    resumed = [consumer(merged) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            rest = [pair for read in [pool.submit(list, it) for it in resumed]
                    for pair in read.result(120)]
    finally:
        for iterator in resumed:
            iterator.close()
    skipped = set(provenance.flatten(spike))
    assert len(skipped) == sum(len(raw) for raw in spike) > 0
    returned = before + rest
    assert Counter(i for raw, _ in returned for i in raw) == \
        Counter(i for i in source_ids if i not in skipped)
    assert by_id(returned) == {i: value(i) + b"!" for i in source_ids if i not in skipped}
