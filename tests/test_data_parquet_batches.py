"""ParquetReader decodes a row group batch by batch: an element keeps only its batch alive.

A worker keeps a finished split's last elements for a retry; when an element was a slice of
its whole row group, that kept every row group read in memory (BENCHMARKS, Data files b).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from clusterwire.data.parquet import ParquetReader  # noqa: E402

ROWS, GROUP_ROWS, BATCH_ROWS = 200_000, 100_000, 1_000


@pytest.fixture
def path(tmp_path):
    columns = {f"c{k}": np.arange(ROWS, dtype=np.int64) * (k + 1) for k in range(8)}
    target = tmp_path / "t.parquet"
    pq.write_table(pa.table(columns), target, row_group_size=GROUP_ROWS, compression="none")
    return target


def test_an_element_keeps_only_its_batch_alive(path):
    gc.collect()
    before = pa.total_allocated_bytes()
    with ParquetReader(path, batch_rows=BATCH_ROWS, readable_prefixes=None) as reader:
        elements = reader.read(0, 1)
        first = next(elements)
        elements.close()
    del reader  # with it goes its pre-buffered row group (Arrow's memory: it reads the file)
    gc.collect()
    held = pa.total_allocated_bytes() - before
    group_bytes = GROUP_ROWS * 8 * 8  # 6.4 MB: what a slice of the row group kept
    assert held < group_bytes / 10, held
    assert [len(first[f"c{k}"]) for k in range(8)] == [BATCH_ROWS] * 8
    assert np.array_equal(first["c3"], np.arange(BATCH_ROWS) * 4)


def test_batches_tile_each_row_group_in_order(path):
    with ParquetReader(path, batch_rows=30_000, readable_prefixes=None) as reader:
        sizes = [len(element["c0"]) for element in reader.read()]
        assert sizes == [30_000] * 3 + [10_000] + [30_000] * 3 + [10_000]  # per row group
        values = np.concatenate([element["c1"] for element in reader.read(1, 2)])
    assert np.array_equal(values, np.arange(GROUP_ROWS, ROWS) * 2)
