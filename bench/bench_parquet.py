"""Read throughput of Parquet numeric columns: clusterwire's ParquetReader against pyarrow's.

    python bench/bench_parquet.py [--rows 8000000] [--row-group-rows 1000000] [--runs 5]

Writes one file of ``--rows`` rows (4 int64 and 4 float64 columns, random, uncompressed
and snappy-compressed) in a temporary folder, reads it once to warm the page cache, then
times, in one run, each reader over the whole file (best and median of ``--runs``):

* baseline: ``pyarrow.parquet.read_table(path)`` then ``to_numpy()`` of each column chunk;
* clusterwire ``ParquetReader(path, batch_rows=...)`` over every row group, each element
  a dict of numpy arrays (views of Arrow's buffers);
* the same reader on one element per row, on the first 200,000 rows only (per-row cost).

MB/s are 10^6 bytes of column data (8 bytes a value) per second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _machine import cpu_model

from clusterwire.data.parquet import ParquetReader

_COLUMNS = 8


def _write(path: str, rows: int, row_group_rows: int, compression: str) -> int:
    rng = np.random.default_rng(0)
    columns = {f"i{k}": rng.integers(0, 1 << 40, rows) for k in range(_COLUMNS // 2)}
    columns.update({f"f{k}": rng.random(rows) for k in range(_COLUMNS // 2)})
    pq.write_table(pa.table(columns), path, row_group_size=row_group_rows,
                   compression=compression)
    return rows * _COLUMNS * 8


def _pyarrow(path: str) -> int:
    table = pq.read_table(path)
    values = 0
    for column in table.columns:
        for chunk in column.chunks:
            values += chunk.to_numpy(zero_copy_only=True).size
    return values


def _clusterwire(path: str, batch_rows: int) -> int:
    values = 0
    with ParquetReader(path, batch_rows=batch_rows, readable_prefixes=None) as reader:
        for element in reader.read():
            for array in element.values():
                values += array.size
    return values


def _per_row(path: str, rows: int) -> int:
    seen = 0
    with ParquetReader(path, readable_prefixes=None) as reader:
        for _ in reader.read():
            seen += 1
            if seen == rows:
                break
    return seen


def _time(fn, runs: int) -> tuple[float, float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8_000_000)
    parser.add_argument("--row-group-rows", type=int, default=1_000_000)
    parser.add_argument("--batch-rows", type=int, default=65536)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {cpu_model()}, {os.cpu_count()} cpus; pyarrow {pa.__version__}")
    with tempfile.TemporaryDirectory() as folder:
        for compression in ("none", "snappy"):
            path = os.path.join(folder, f"bench-{compression}.parquet")
            nbytes = _write(path, args.rows, args.row_group_rows, compression)
            _pyarrow(path)  # page cache
            print(f"\n{args.rows} rows x {_COLUMNS} numeric columns, compression={compression}, "
                  f"{nbytes / 1e6:.0f} MB of values, {os.path.getsize(path) / 1e6:.0f} MB file")
            base_best, base_median = _time(lambda p=path: _pyarrow(p), args.runs)
            ours_best, ours_median = _time(
                lambda p=path: _clusterwire(p, args.batch_rows), args.runs)
            for name, best, median in (
                    ("pyarrow.parquet.read_table", base_best, base_median),
                    (f"ParquetReader(batch_rows={args.batch_rows})", ours_best, ours_median)):
                print(f"  {name:<40} {nbytes / best / 1e6:8.0f} MB/s best, "
                      f"{nbytes / median / 1e6:8.0f} MB/s median")
            print(f"  ratio (best): {base_best / ours_best:.2f}x of pyarrow")
            per_row = min(200_000, args.rows)
            best, _ = _time(lambda p=path, n=per_row: _per_row(p, n), max(1, args.runs // 2))
            print(f"  ParquetReader one row per element: {per_row / best:,.0f} rows/s")


if __name__ == "__main__":
    main()
