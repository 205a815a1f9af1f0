"""TFRecordDataset(index_filenames=..., num_parallel_reads=N): TF's interleaved order locally
and on a worker, every record once in distributed_epoch (a block of one file per split)."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import in_process_data_service

from clusterwire import data
from clusterwire.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(120)

# Records per file; TF 2.21's order of tf.data.TFRecordDataset(names, num_parallel_reads=2)
# over files written the same way (test_data_file_sources' fixture).
COUNTS = (3, 1, 4, 2, 5)
TF_ORDER_2 = ["0-0", "1-0", "0-1", "0-2", "2-0", "2-1", "3-0", "2-2", "3-1", "2-3", "4-0",
              "4-1", "4-2", "4-3", "4-4"]


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    root = tmp_path_factory.mktemp("indexed")
    names = []
    for index, count in enumerate(COUNTS):
        names.append(str(root / f"f{index}.tfrecord"))
        with data.TFRecordWriter(names[-1], index=True) as writer:
            for record in range(count):
                writer.write(f"{index}-{record}".encode().ljust(60, b"."))
    return str(root), names


def strings(dataset) -> list[str]:
    return [bytes(r).rstrip(b".").decode() for r in dataset]


@pytest.mark.parametrize("reads", [1, 2, 3, data.AUTOTUNE])
@pytest.mark.parametrize("block_bytes", [64, 1 << 20])  # a block per record / per file
def test_parallel_reads_of_indexed_files_are_in_tfs_order(indexed, reads, block_bytes):
    _, names = indexed
    got = strings(data.TFRecordDataset(names, num_parallel_reads=reads, index_filenames=True,
                                       block_bytes=block_bytes))
    assert got == strings(data.TFRecordDataset(names, num_parallel_reads=reads))
    if reads == 2:
        assert got == TF_ORDER_2


def test_through_the_service_on_a_worker_and_in_splits(indexed):
    root, names = indexed
    dataset = data.TFRecordDataset(names, num_parallel_reads=2, index_filenames=True,
                                   block_bytes=64)
    with in_process_data_service(1, readable_dirs=[root]) as dispatcher:
        whole = strings(dataset.apply(data.distribute("parallel_epochs", dispatcher.target)))
        split = strings(dataset.apply(data.distribute("distributed_epoch", dispatcher.target)))
    assert whole == TF_ORDER_2
    assert Counter(split) == Counter(TF_ORDER_2)


def test_a_bad_num_parallel_reads_is_named(indexed):
    _, names = indexed
    with pytest.raises(InvalidArgumentError, match="num_parallel_reads"):
        data.TFRecordDataset(names, num_parallel_reads=0, index_filenames=True)
    with pytest.raises(InvalidArgumentError, match="compression_type=None"):
        data.TFRecordDataset(names, "GZIP", num_parallel_reads=2, index_filenames=True)
