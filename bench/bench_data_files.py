"""Reading training files through clusterwire.data: TFRecord and Parquet, beside TF and pyarrow.

Run from the repository root::

    python bench/bench_data_files.py [--runs 3] [--records-per-file 64] [--tf-python PATH]

Writes, in a temporary folder, 8 TFRecord files of 1 MiB random records and 4 Parquet files
of 8 numeric columns (4 int64, 4 float64; row groups of 500,000 rows), reads each once to
warm the page cache, then times in one run (1 warm-up and ``--runs`` measured reads each,
MB/s = 10^6 bytes of record or column data per second over the whole read, registration
and first element included; best and median; also the median time to the first element, the
rate after it, and the CPU time per MB of every process of the read: this one, and the
service's dispatcher and workers, from /proc):

a) TFRecord through the service: ``list_files(shuffle=False).interleave(TFRecordDataset,
   cycle_length=4, num_parallel_calls=4)`` in ``distributed_epoch`` mode, read by this
   process (bytes per record). clusterwire: ``LocalDataService`` (a dispatcher and 2 worker
   processes, ``readable_dirs`` the folder), elements over ``grpc+local`` and over ``grpc``.
   TF: the same pipeline on tf.data service 2.x (``DispatchServer`` and 2 ``WorkerServer``s
   in one subprocess of ``--tf-python``, a Python with tensorflow, also the client), read
   as tensors and through ``as_numpy_iterator()`` (bytes), with ``distribute``'s default
   compression ("AUTO": snappy over grpc) and with None; the ratio is against TF's fastest.
b) Parquet through the service over ``grpc+local``: ``from_parquet(paths, batch_rows=65536)``
   in ``distributed_epoch`` mode (a row group per split; also with one element per row
   group, ``batch_rows=500000``), against
   ``pyarrow.parquet.read_table`` of the same files in this process (``to_numpy()`` of
   every column chunk).
c) ``interleave(TFRecordDataset, cycle_length=8, num_parallel_calls=8)`` over the 8 TFRecord
   files (and with ``num_parallel_calls=2``, the cores here), locally, against
   ``num_parallel_calls=None`` (sequential); beside them 2 plain threads reading 4 files
   each with ``TFRecordReader`` (no interleave): how far two readers that release the GIL
   scale on this machine at this moment. The files are in the page cache, so this
   measures CPU work (CRC-32C checks, copies, page faults), not disk latency: one thread
   copies near the memory's speed, so the plain threads show how much a second one adds.
   With ``--gzip``, c) reads 8 GZIP-compressed files instead (1 MiB records of bytes drawn
   from 16 values, so inflating them is the work, as with real compressed shards).

Prints a Markdown table with the ratios and targets. Every process started here is stopped
at the end, also on error.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The workers LocalDataService starts import _file_workload from here.
os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from _file_workload import gzip_records_of, records_of  # noqa: E402
from _machine import cpu_model  # noqa: E402

from clusterwire import data  # noqa: E402
from clusterwire.plugins import get_plugin_manager  # noqa: E402

MIB = 1 << 20
FILES = 8
CYCLE = 4  # the service pipeline's interleave cycle_length and num_parallel_calls
PARQUET_FILES, PARQUET_ROWS, ROW_GROUP_ROWS, BATCH_ROWS = 4, 2_000_000, 500_000, 65536
TARGETS = {"a": 2.0, "b": 0.7, "c": 1.5}

TF_SERVICE = """
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
pattern, cycle, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
service = tf.data.experimental.service
dispatcher = service.DispatchServer(service.DispatcherConfig(port=0))
address = dispatcher.target.split("://")[1]
workers = [service.WorkerServer(service.WorkerConfig(dispatcher_address=address, port=0))
           for _ in range(2)]
def pipeline(compression="AUTO"):
    files = tf.data.Dataset.list_files(pattern, shuffle=False)
    records = files.interleave(tf.data.TFRecordDataset, cycle_length=cycle,
                               num_parallel_calls=cycle)
    return records.apply(service.distribute("distributed_epoch", dispatcher.target,
                                            compression=compression))
def consume(records, size):
    total, first = 0, None
    for record in records:
        first = first or time.perf_counter()
        total += size(record)
    return total, first
def tensors():
    return consume(pipeline(), lambda record: int(tf.strings.length(record)))
def as_numpy(compression="AUTO"):
    return consume(pipeline(compression).as_numpy_iterator(), len)
out = {}
for name, read in [("tensors", tensors), ("as_numpy_iterator", as_numpy),
                   ("as_numpy_iterator, compression=None", lambda: as_numpy(None))]:
    read()
    times = []
    for _ in range(runs):
        start = time.perf_counter(); total, first = read()
        times.append([time.perf_counter() - start, first - start])
    out[name] = [total, times]
out["version"] = tf.__version__
print(json.dumps(out))
"""


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its live child processes (the
    service's dispatcher and workers), from Linux's /proc."""
    user, system = os.times()[:2]
    total = user + system
    tick = os.sysconf("SC_CLK_TCK")
    pids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as children:
                pids.update(children.read().split())
        except OSError:  # the thread ended meanwhile
            continue
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _time(read: Callable[[], tuple[int, float]], runs: int
          ) -> tuple[int, list[tuple[float, ...]]]:
    """(bytes read, [(seconds of the read, seconds to its first element, CPU seconds of
    every process here meanwhile)] per measured run) after one warm-up read; ``read``
    returns its bytes and the perf_counter of its first."""
    expected, _ = read()
    times = []
    for _ in range(runs):
        cpu = _cpu_seconds()
        start = time.perf_counter()
        total, first = read()
        times.append((time.perf_counter() - start, first - start, _cpu_seconds() - cpu))
        if total != expected:
            raise RuntimeError(f"a read gave {total} bytes, the warm-up {expected}")
    return expected, times


def _rates(total: int, times: list[tuple[float, ...]]
           ) -> tuple[float, float, float, float, float | None]:
    """(best MB/s, median MB/s, median s to the first element, median MB/s after it,
    median CPU ms per MB of all processes here, or None when not measured)."""
    whole = [run[0] for run in times]
    cpu = [run[2] for run in times if len(run) > 2]
    return (total / min(whole) / 1e6, total / statistics.median(whole) / 1e6,
            statistics.median(run[1] for run in times),
            statistics.median(total / (run[0] - run[1]) / 1e6 for run in times),
            statistics.median(cpu) / total * 1e9 if cpu else None)


def _consume(elements: Iterable, size: Callable[[object], int]) -> tuple[int, float]:
    """The elements' total size and the perf_counter when the first arrived."""
    total, first = 0, None
    for element in elements:
        first = first or time.perf_counter()
        total += size(element)
    return total, first


def _write_tfrecords(root: str, per_file: int) -> int:
    rng = np.random.default_rng(0)
    for index in range(FILES):
        with data.TFRecordWriter(os.path.join(root, f"train-{index}.tfrecord")) as writer:
            for _ in range(per_file):
                writer.write(rng.bytes(MIB))
    return FILES * per_file * MIB


def _write_gzip_tfrecords(root: str, per_file: int) -> str:
    """8 GZIP TFRecord files of compressible 1 MiB records; their glob pattern."""
    rng = np.random.default_rng(2)
    folder = os.path.join(root, "gzip")
    os.mkdir(folder)
    for index in range(FILES):
        with data.TFRecordWriter(os.path.join(folder, f"train-{index}.tfrecord.gz"),
                                 compression_type="GZIP") as writer:
            for _ in range(per_file):
                writer.write(rng.integers(0, 16, MIB, dtype=np.uint8).tobytes())
    return os.path.join(folder, "*.tfrecord.gz")


def _write_parquet(root: str) -> tuple[list[str], int]:
    rng = np.random.default_rng(1)
    paths = []
    for index in range(PARQUET_FILES):
        columns = {f"i{k}": rng.integers(0, 1 << 40, PARQUET_ROWS) for k in range(4)}
        columns.update({f"f{k}": rng.random(PARQUET_ROWS) for k in range(4)})
        paths.append(os.path.join(root, f"train-{index}.parquet"))
        pq.write_table(pa.table(columns), paths[-1], row_group_size=ROW_GROUP_ROWS,
                       compression="none")
    return paths, PARQUET_FILES * PARQUET_ROWS * 8 * 8


def _tfrecord_pipeline(pattern: str, cycle: int, parallel: int | None,
                       gzip: bool = False) -> data.Dataset:
    return data.Dataset.list_files(pattern, shuffle=False).interleave(
        gzip_records_of if gzip else records_of, cycle_length=cycle,
        num_parallel_calls=parallel)


def _through(dataset: data.Dataset, target: str, transfer: str | None) -> data.Dataset:
    return dataset.apply(data.distribute("distributed_epoch", target,
                                         data_transfer_protocol=transfer))


def _record_bytes(dataset: data.Dataset) -> tuple[int, float]:
    return _consume(dataset, len)


def _column_bytes(dataset: data.Dataset) -> tuple[int, float]:
    return _consume(dataset, lambda batch: sum(array.nbytes for array in batch.values()))


def _pyarrow_tables(paths: list[str]):
    for path in paths:
        yield pq.read_table(path)


def _pyarrow(paths: list[str]) -> tuple[int, float]:
    return _consume(_pyarrow_tables(paths), lambda table: sum(
        chunk.to_numpy(zero_copy_only=True).nbytes
        for column in table.columns for chunk in column.chunks))


def _tf_service(tf_python: str, pattern: str, runs: int) -> tuple[str, dict] | str:
    """TF's rows {name: (bytes, times)} and its version, or why there are none."""
    done = subprocess.run([tf_python, "-c", TF_SERVICE, pattern, str(CYCLE), str(runs)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return f"failed: {done.stderr.strip()[-300:]}"
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return results.pop("version"), results


def _row(name: str, rates: tuple[float, float, float, float, float | None],
         baseline: tuple[float, ...] | None = None, target: float | None = None) -> str:
    best, median, first, steady, cpu = rates
    cpu_cell = "" if cpu is None else f"{cpu:.2f}"
    cells = (f"| {name} | {best:,.0f} | {median:,.0f} | {first:.2f} | {steady:,.0f} | "
             f"{cpu_cell} |")
    if baseline is None:
        return cells + " | |"
    ratio = median / baseline[1]
    verdict = "" if target is None else \
        f" >= {target}x: {'met' if ratio >= target else 'NOT met'}"
    return cells + f" {ratio:.2f}x (best {best / baseline[0]:.2f}x) |{verdict} |"


def _service_tfrecord_rows(args: argparse.Namespace, target: str, local: str | None,
                           pattern: str, tf_bytes: int) -> list[str]:
    """a): TF's service rows (if --tf-python) and clusterwire's over each transfer."""
    tf = _tf_service(args.tf_python, pattern, args.runs) if args.tf_python else \
        "not run (--tf-python)"
    pipeline = _tfrecord_pipeline(pattern, CYCLE, CYCLE)
    ours = {transfer or "grpc": _time(
        lambda t=transfer: _record_bytes(_through(pipeline, target, t)), args.runs)
        for transfer in dict.fromkeys([local, None])}
    for total, _ in ours.values():
        if total != tf_bytes:
            raise RuntimeError(f"the service read {total} bytes of {tf_bytes}")
    rows = []
    if isinstance(tf, str):
        rows.append(f"| a) tf.data service: {tf} | | | | | | | |")
        best_tf = None
    else:
        version, results = tf
        tf_rates = {name: _rates(*result) for name, result in results.items()}
        for name, rates in tf_rates.items():
            rows.append(_row(f"a) tf.data service {version}, 2 workers, {name}", rates))
        best_tf = max(tf_rates.values(), key=lambda rates: rates[1])
    for transfer, result in ours.items():
        rows.append(_row(f"a) clusterwire service, 2 workers, over {transfer}",
                         _rates(*result), best_tf, TARGETS["a"]))
    return rows


def _threads(pattern: str, gzip: bool = False) -> tuple[int, float]:
    """The TFRecord files read whole by 2 threads, half the files each (bytes, and when
    the first record was read): how far 2 readers releasing the GIL scale here."""
    names = sorted(glob.glob(pattern))
    totals: list[int] = []
    firsts: list[float] = []

    def read(part: list[str]) -> None:
        total = 0
        for name in part:
            for record in data.TFRecordReader(name, "GZIP" if gzip else None):
                if not total:
                    firsts.append(time.perf_counter())
                total += len(record)
        totals.append(total)
    threads = [threading.Thread(target=read, args=(names[i::2],)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(totals), min(firsts)


def _interleave_rows(pattern: str, runs: int, gzip: bool
                     ) -> tuple[list[str], list[str]]:
    """c): the local interleave, sequential and with 2 and 8 parallel calls, and 2 plain
    threads, in alternation: 1 warm-up round, then ``runs`` rounds that read once in each way,
    so that the load of the machine meets them alike. The table's rows, and a line per
    parallel read with its ratio to the sequential read of the same round, round by round,
    and one with each read's minor page faults per MiB."""
    files = "GZIP files, " if gzip else ""
    reads: dict[str, Callable[[], tuple[int, float]]] = {
        f"c) local interleave({files}cycle_length=8), num_parallel_calls=None":
            lambda: _record_bytes(_tfrecord_pipeline(pattern, FILES, None, gzip)),
        f"c) 2 plain threads reading 4 {'GZIP ' if gzip else ''}files each (TFRecordReader, no "
        "interleave): what the machine gives": lambda: _threads(pattern, gzip)}
    for calls in (2, FILES):
        reads[f"c) local interleave({files}cycle_length={FILES}), num_parallel_calls={calls}"] = \
            lambda c=calls: _record_bytes(_tfrecord_pipeline(pattern, FILES, c, gzip))
    results = {name: (read(), []) for name, read in reads.items()}
    faults: dict[str, list[float]] = {name: [] for name in reads}
    for _ in range(runs):
        for name, read in reads.items():
            cpu = _cpu_seconds()
            minor = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            total, first = read()
            results[name][1].append(
                (time.perf_counter() - start, first - start, _cpu_seconds() - cpu))
            faults[name].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - minor)
                                / (total / MIB))
            if total != results[name][0][0]:
                raise RuntimeError(f"{name}: a read gave {total} bytes, the warm-up "
                                   f"{results[name][0][0]}")
    names = list(reads)
    sequential = _rates(results[names[0]][0][0], results[names[0]][1])
    rows = [_row(names[0], sequential)]
    rounds = []
    for name in names[1:]:
        (total, _), times = results[name]
        rows.append(_row(name, _rates(total, times), sequential,
                         None if "plain threads" in name else TARGETS["c"]))
        ratios = [base[0] / run[0] for base, run in
                  zip(results[names[0]][1], times, strict=True)]
        rounds.append(f"{name[3:]}: {', '.join(f'{r:.2f}x' for r in ratios)} (min "
                      f"{min(ratios):.2f}x, median {statistics.median(ratios):.2f}x, max "
                      f"{max(ratios):.2f}x)")
    rounds.append("minor page faults per MiB read (medians; a record allocated on one thread "
                  "and freed on another can make glibc trim and fault its pages in again): "
                  + ", ".join(f"{name[3:].split(':')[0]} {statistics.median(faults[name]):.1f}"
                              for name in names))
    return rows, rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--records-per-file", type=int, default=64,
                        help="1 MiB records in each of the 8 TFRecord files")
    parser.add_argument("--parts", default="abc",
                        help="which reads to time, of a (TFRecord service), b (Parquet "
                             "service), c (local interleave)")
    parser.add_argument("--gzip", action="store_true",
                        help="c) reads GZIP-compressed TFRecord files (inflating is the work)")
    parser.add_argument("--tf-python", default=os.environ.get("CLUSTERWIRE_TF_PYTHON"),
                        help="a Python with tensorflow for the tf.data service rows")
    args = parser.parse_args()
    local = "grpc+local" if "grpc+local" in get_plugin_manager().protocols() else None
    print(f"machine: {cpu_model()}, {os.cpu_count()} cpus; pyarrow {pa.__version__}; "
          f"{args.runs} runs after a warm-up; MB/s over the whole read; load average "
          "{:.1f} {:.1f} {:.1f} at the start\n".format(*os.getloadavg()))
    parts = set(args.parts)
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as root:
        tf_bytes = _write_tfrecords(root, args.records_per_file)
        parquet, parquet_bytes = _write_parquet(root) if "b" in parts else ([], 0)
        pattern = os.path.join(root, "*.tfrecord")
        if "a" in parts or "b" in parts:
            with data.LocalDataService(2, local, imports=["_file_workload"],
                                       readable_dirs=[root]) as service:
                if "a" in parts:
                    rows += _service_tfrecord_rows(args, service.target, local, pattern,
                                                   tf_bytes)
                if "b" in parts:
                    parquet_ours = {batch: _time(lambda b=batch: _column_bytes(_through(
                        data.Dataset.from_parquet(parquet, batch_rows=b), service.target,
                        local)), args.runs) for batch in (BATCH_ROWS, ROW_GROUP_ROWS)}
            if "b" in parts:
                base = _rates(*_time(lambda: _pyarrow(parquet), args.runs))
                rows.append(_row("b) pyarrow.parquet.read_table in the client", base))
                for batch, result in parquet_ours.items():
                    rows.append(_row(
                        f"b) clusterwire service from_parquet(batch_rows={batch}), over "
                        f"{local or 'grpc'}", _rates(*result), base,
                        TARGETS["b"] if batch == BATCH_ROWS else None))
        rounds: list[str] = []
        if "c" in parts:
            if args.gzip:
                pattern = _write_gzip_tfrecords(root, args.records_per_file)
            interleave_rows, rounds = _interleave_rows(pattern, args.runs, args.gzip)
            rows += interleave_rows
    print("load average {:.1f} {:.1f} {:.1f} at the end".format(*os.getloadavg()))
    print(f"TFRecord: {FILES} files x {args.records_per_file} x 1 MiB ({tf_bytes / 1e6:,.0f} "
          f"MB); Parquet: {PARQUET_FILES} files x "
          f"{PARQUET_ROWS:,} rows x 8 numeric columns ({parquet_bytes / 1e6:,.0f} MB, row "
          f"groups of {ROW_GROUP_ROWS:,} rows); page cache warm\n")
    print("| read | best MB/s | median MB/s | first element s | MB/s after it | CPU ms/MB "
          "| ratio (medians) | target |\n|---|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    if rounds:
        print("\nc) each round's ratio to the sequential read of the same round; faults:")
        print("\n".join(f"- {line}" for line in rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
