"""Per-element cost of ``global_shuffle`` over file sources, next to their sequential reads
and ``range``.

    python bench/bench_global_shuffle_files.py [--rows 200000] [--runs 3]

Writes, in a temporary folder, ``--rows`` values over 4 files each: indexed TFRecord files
(100-byte records) and Parquet files (4 columns: int64, float32, int64, binary; row groups of
10,000 rows, and a second set with row groups of 1,000). Then times, in one process, each
dataset iterated to the end (median of ``--runs``; wall and CPU microseconds per element):
``global_shuffle(seed=1)`` of each, the same files read in order, ``Dataset.range`` shuffled
and not, and reading the 4 TFRecord indexes. A digest of the shuffled elements shows the
order a run read (it must not change between versions of the reads).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _machine import cpu_model

from clusterwire import data
from clusterwire.data.tfrecord import read_index

FILES = 4


def write(root: str, rows: int) -> dict[str, list[str]]:
    per = rows // FILES
    made: dict[str, list[str]] = {"tfrecord": [], "parquet": [], "parquet_1k": []}
    for index in range(FILES):
        values = np.arange(index * per, (index + 1) * per)
        table = pa.table({"x": values, "y": values.astype(np.float32), "z": values * 2,
                          "s": [b"%d" % v for v in values.tolist()]})
        for kind, group in (("parquet", 10_000), ("parquet_1k", 1_000)):
            made[kind].append(f"{root}/{kind}{index}.parquet")
            pq.write_table(table, made[kind][-1], row_group_size=group)
        made["tfrecord"].append(f"{root}/r{index}.tfrecord")
        with data.TFRecordWriter(made["tfrecord"][-1], index=True) as writer:
            for value in values.tolist():
                writer.write((b"%d:" % value).ljust(100, b"."))
    return made


def timed(make: Callable[[], object], runs: int) -> tuple[float, float, int, str]:
    """Median wall and CPU seconds of iterating ``make()`` to the end, its element count and
    a digest of its elements."""
    walls, cpus = [], []
    count, digest = 0, ""
    for _ in range(runs):
        hasher = hashlib.sha1()
        wall, cpu = time.perf_counter(), time.process_time()
        count = 0
        for element in make():  # type: ignore[attr-defined]
            count += 1
            hasher.update(element if isinstance(element, bytes) else repr(element).encode())
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        digest = hasher.hexdigest()[:12]
    return statistics.median(walls), statistics.median(cpus), count, digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        made = write(root, args.rows)
        cases = {
            "range, global_shuffle": lambda: data.Dataset.range(args.rows).global_shuffle(1),
            "range": lambda: data.Dataset.range(args.rows),
            "TFRecord indexed, global_shuffle": lambda: data.TFRecordDataset(
                made["tfrecord"], index_filenames=True).global_shuffle(1),
            "TFRecord, in order": lambda: data.TFRecordDataset(made["tfrecord"]),
            "Parquet 1 column, global_shuffle": lambda: data.Dataset.from_parquet(
                made["parquet"], columns=["x"]).global_shuffle(1),
            "Parquet 1 column, in order": lambda: data.Dataset.from_parquet(
                made["parquet"], columns=["x"]),
            "Parquet 4 columns, global_shuffle": lambda: data.Dataset.from_parquet(
                made["parquet"]).global_shuffle(1),
            "Parquet 4 columns, in order": lambda: data.Dataset.from_parquet(made["parquet"]),
            "Parquet 4 columns, row groups of 1,000, global_shuffle":
                lambda: data.Dataset.from_parquet(made["parquet_1k"]).global_shuffle(1),
        }
        print(f"# {cpu_model()}; {args.rows} elements in {FILES} files; median of "
              f"{args.runs}; {time.strftime('%Y-%m-%d %H:%M')}")
        print("| read | wall us/element | CPU us/element | digest |")
        print("|---|---:|---:|---|")
        for name, make in cases.items():
            wall, cpu, count, digest = timed(make, args.runs)
            assert count == args.rows, (name, count)
            print(f"| {name} | {wall / count * 1e6:.2f} | {cpu / count * 1e6:.2f} | "
                  f"{digest} |", flush=True)
        wall = time.perf_counter()
        for name in made["tfrecord"]:
            read_index(name + ".idx")
        print(f"\nread_index of the {FILES} indexes ({args.rows} lines): "
              f"{(time.perf_counter() - wall) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
