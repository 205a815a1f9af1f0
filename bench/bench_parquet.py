"""Read throughput of Parquet numeric columns: clusterwire against pyarrow in the client.

    python bench/bench_parquet.py [--parts local,service] [--runs 5] [--rounds 7]

MB/s are 10^6 bytes of column data (8 bytes a value) per second; page cache warm.

``local``: one file of ``--rows`` rows (4 int64 and 4 float64 columns, random, uncompressed
and snappy-compressed), each reader over the whole file (best and median of ``--runs``):

* baseline: ``pyarrow.parquet.read_table(path)`` then ``to_numpy()`` of each column chunk;
* clusterwire ``ParquetReader(path, batch_rows=...)`` over every row group, each element
  a dict of numpy arrays (views of Arrow's buffers);
* the same reader on one element per row, on the first 200,000 rows only (per-row cost).

Each also in CPU ms per MB (median; this process's CPU, Arrow's threads included): the
figure that survives a loaded machine.

``service`` (issue 30's target, >= 0.7x): 4 uncompressed files of 2,000,000 rows (row groups
of 500,000 rows; bench_data_files.py's b), read whole ``--rounds`` times, the reads of a round
back to back in a rotating order so that load shifts hit each alike: pyarrow's ``read_table``
in this process; ``from_parquet(paths, batch_rows=65536)`` in ``distributed_epoch``
through a ``LocalDataService`` (2 workers) over ``grpc+local``; and, as the floor of what the
service itself costs a MB, the same service sending elements of the same shape (8 columns of
65536 8-byte values) from memory, no Parquet: ``from_tensors(element).repeat(61)`` in
``parallel_epochs`` (each worker sends it all: 512 MB). Each service read opens its
connections anew (as an epoch does). Per round: the ratio of each service
read's MB/s to pyarrow's of that round; the median, lowest and highest; CPU ms per MB of
every process of the read (this one and the service's dispatcher and workers, their
heartbeats included), and of each: the client (this process), the dispatcher, the 2 workers
together, with the workers' minor page faults per MB and their resident memory at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _machine import cpu_model

from clusterwire import data
from clusterwire.data.parquet import ParquetReader

_COLUMNS = 8
SERVICE_FILES, SERVICE_ROWS, SERVICE_GROUP_ROWS, SERVICE_BATCH_ROWS = 4, 2_000_000, 500_000, 65536
TARGET = 0.7
#: Elements each of the 2 workers sends in the in-memory read (2 x 61 x 4 MiB: 512 MB).
_IN_MEMORY_REPEATS = 61


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


def _time(fn, runs: int) -> tuple[float, float, float]:
    """Best and median seconds of ``runs`` calls of ``fn``, and their median CPU seconds
    (this process's, Arrow's threads included)."""
    times, cpu = [], []
    for _ in range(runs):
        start, start_cpu = time.perf_counter(), sum(os.times()[:2])
        fn()
        times.append(time.perf_counter() - start)
        cpu.append(sum(os.times()[:2]) - start_cpu)
    return min(times), statistics.median(times), statistics.median(cpu)


def _process_cpu(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and minor page faults of process ``pid``, from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def _rss_mib(pid: int) -> int:
    """Resident memory of process ``pid`` in MiB, from /proc."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) // 1024


def _pyarrow_files(paths: list[str]) -> int:
    return sum(_pyarrow(path) for path in paths) * 8


def _through(paths: list[str], target: str) -> int:
    dataset = data.Dataset.from_parquet(paths, batch_rows=SERVICE_BATCH_ROWS).apply(
        data.distribute("distributed_epoch", target, data_transfer_protocol="grpc+local"))
    return sum(array.nbytes for element in dataset for array in element.values())


class _Read:
    """One kind of read, and the processes whose CPU it costs (None: this one)."""

    def __init__(self, read: Callable[[], int], nbytes: int,
                 service: data.LocalDataService | None = None):
        self.read, self.nbytes = read, nbytes
        # The dispatcher first, then the workers (LocalDataService starts them so).
        self.pids = [] if service is None else [p.pid for p in service._processes]
        self.rates: list[float] = []
        self.cpu: list[list[float]] = []  # per read: all, client, dispatcher, workers
        self.faults: list[float] = []  # the workers' minor faults per MB
        self.rss: list[int] = []  # the workers' resident MiB once the rounds are done

    def run(self) -> None:
        nbytes = self.nbytes
        before = [(sum(os.times()[:2]), 0)] + [_process_cpu(pid) for pid in self.pids]
        start = time.perf_counter()
        if self.read() != nbytes:
            raise RuntimeError(f"a read returned other than {nbytes} bytes")
        self.rates.append(nbytes / (time.perf_counter() - start) / 1e6)
        after = [(sum(os.times()[:2]), 0)] + [_process_cpu(pid) for pid in self.pids]
        ms = [(a[0] - b[0]) / nbytes * 1e9 for a, b in zip(after, before, strict=True)]
        parts = [ms[0], ms[1], sum(ms[2:])] if self.pids else [ms[0], 0.0, 0.0]
        self.cpu.append([sum(ms)] + parts)
        self.faults.append(sum(a[1] - b[1] for a, b in zip(after[2:], before[2:], strict=True))
                           / (nbytes / 1e6))


def _in_memory(target: str) -> int:
    element = {f"c{k}": np.arange(SERVICE_BATCH_ROWS, dtype=np.int64) for k in range(_COLUMNS)}
    dataset = data.Dataset.from_tensors(element).repeat(_IN_MEMORY_REPEATS).apply(
        data.distribute("parallel_epochs", target, data_transfer_protocol="grpc+local"))
    return sum(array.nbytes for element in dataset for array in element.values())


def _service_rounds(folder: str, rounds: int) -> None:
    """The ``service`` part (see the module docstring)."""
    rng = np.random.default_rng(1)
    paths = []
    for index in range(SERVICE_FILES):
        columns = {f"i{k}": rng.integers(0, 1 << 40, SERVICE_ROWS) for k in range(4)}
        columns.update({f"f{k}": rng.random(SERVICE_ROWS) for k in range(4)})
        paths.append(os.path.join(folder, f"service-{index}.parquet"))
        pq.write_table(pa.table(columns), paths[-1], row_group_size=SERVICE_GROUP_ROWS,
                       compression="none")
    nbytes = SERVICE_FILES * SERVICE_ROWS * _COLUMNS * 8
    in_memory = 2 * _IN_MEMORY_REPEATS * SERVICE_BATCH_ROWS * _COLUMNS * 8
    with data.LocalDataService(2, "grpc+local", readable_dirs=[folder]) as service:
        reads = {
            "pyarrow.parquet.read_table in the client": _Read(lambda: _pyarrow_files(paths),
                                                              nbytes),
            "service (worker defaults)": _Read(lambda: _through(paths, service.target),
                                               nbytes, service),
            "service, the same elements from memory (no Parquet)": _Read(
                lambda: _in_memory(service.target), in_memory, service),
        }
        for read in reads.values():  # warm-up: page cache, workers' imports
            assert read.read() == read.nbytes
        names = list(reads)
        print(f"\nservice: {SERVICE_FILES} files x {SERVICE_ROWS:,} rows x {_COLUMNS} columns "
              f"({nbytes / 1e6:,.0f} MB), row groups of {SERVICE_GROUP_ROWS:,}, batch_rows="
              f"{SERVICE_BATCH_ROWS}; load average {os.getloadavg()[0]:.1f} at the start")
        for round_index in range(rounds):
            order = names[round_index % 3:] + names[:round_index % 3]
            for name in order:
                reads[name].run()
            base = reads[names[0]].rates[-1]
            print(f"  round {round_index + 1}: " + ", ".join(
                f"{reads[n].rates[-1]:,.0f} MB/s" + ("" if n == names[0] else
                                                     f" ({reads[n].rates[-1] / base:.2f}x)")
                for n in names) + f"; load {os.getloadavg()[0]:.1f}", flush=True)
        for read in reads.values():
            read.rss = [_rss_mib(pid) for pid in read.pids[1:]]
    # Both reads keep the 2 cores busy when the machine is quiet, so there the MB/s ratio
    # tends to the CPU ratio; on a loaded machine the service's processes get a larger
    # share of the CPU than pyarrow's one process, and the MB/s ratio flatters it.
    print("\n| read | median MB/s | CPU ms/MB (median) | of it: client / dispatcher / "
          "workers | workers' minor faults per MB | workers' RSS MiB at the end | ratio to "
          "pyarrow: median (lowest-highest) | CPU ratio (pyarrow's CPU ms/MB / this) | target |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---|")
    first = reads[names[0]]
    base_cpu = statistics.median(cpu[0] for cpu in first.cpu)
    for name in names:
        read = reads[name]
        cpu = [statistics.median(c[i] for c in read.cpu) for i in range(4)]
        ratios = [ours / theirs for ours, theirs in zip(read.rates, first.rates, strict=True)]
        cells = [name, f"{statistics.median(read.rates):,.0f}", f"{cpu[0]:.2f}"]
        if read is first:
            cells += [""] * 6
        else:
            median = statistics.median(ratios)
            cells += [f"{cpu[1]:.2f} / {cpu[2]:.2f} / {cpu[3]:.2f}",
                      f"{statistics.median(read.faults):.0f}",
                      " + ".join(map(str, read.rss)),
                      f"{median:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)",
                      f"{base_cpu / cpu[0]:.2f}x",
                      "" if name != names[1] else
                      f">= {TARGET}x: {'met' if median >= TARGET else 'NOT met'} by MB/s at "
                      f"load {os.getloadavg()[0]:.1f}"]
        print("| " + " | ".join(cells) + " |")


def _local(folder: str, args: argparse.Namespace) -> None:
    """The ``local`` part (see the module docstring)."""
    for compression in ("none", "snappy"):
        path = os.path.join(folder, f"bench-{compression}.parquet")
        nbytes = _write(path, args.rows, args.row_group_rows, compression)
        _pyarrow(path)  # page cache
        print(f"\n{args.rows} rows x {_COLUMNS} numeric columns, compression={compression}, "
              f"{nbytes / 1e6:.0f} MB of values, {os.path.getsize(path) / 1e6:.0f} MB file")
        base_best, base_median, base_cpu = _time(lambda p=path: _pyarrow(p), args.runs)
        ours_best, ours_median, ours_cpu = _time(
            lambda p=path: _clusterwire(p, args.batch_rows), args.runs)
        for name, best, median, cpu in (
                ("pyarrow.parquet.read_table", base_best, base_median, base_cpu),
                (f"ParquetReader(batch_rows={args.batch_rows})", ours_best, ours_median,
                 ours_cpu)):
            print(f"  {name:<40} {nbytes / best / 1e6:8.0f} MB/s best, "
                  f"{nbytes / median / 1e6:8.0f} MB/s median, "
                  f"{cpu / nbytes * 1e9:.2f} CPU ms/MB median")
        print(f"  ratio (best): {base_best / ours_best:.2f}x of pyarrow; CPU ratio "
              f"(pyarrow's CPU ms/MB / this): {base_cpu / ours_cpu:.2f}x")
        per_row = min(200_000, args.rows)
        best, _, _ = _time(lambda p=path, n=per_row: _per_row(p, n), max(1, args.runs // 2))
        print(f"  ParquetReader one row per element: {per_row / best:,.0f} rows/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="local,service",
                        help="comma-separated: local (the reader alone), service (the target)")
    parser.add_argument("--rows", type=int, default=8_000_000)
    parser.add_argument("--row-group-rows", type=int, default=1_000_000)
    parser.add_argument("--batch-rows", type=int, default=65536)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"machine: {cpu_model()}, {os.cpu_count()} cpus; pyarrow {pa.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    parts = set(args.parts.split(","))
    if not parts <= {"local", "service"}:
        parser.error(f"--parts takes local and/or service, got {args.parts!r}")
    with tempfile.TemporaryDirectory() as folder:
        if "local" in parts:
            _local(folder, args)
        if "service" in parts:
            _service_rounds(folder, args.rounds)


if __name__ == "__main__":
    main()
