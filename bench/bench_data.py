"""Benchmark of clusterwire.data next to tf.data service (same workloads as the TF anchor).

Run from the repository root::

    python bench/bench_data.py [--runs 3] [--quick] [--workload "1 MiB"] [--mode parallel]
        [--compression None] [--transfer grpc+local] [--no-ten] [--no-torch | --only-torch]

A dispatcher and 2 workers run as separate processes (``python -m clusterwire
dispatcher|worker``); this process is the client. Workloads are TF's:
``range(N).map(fill)`` with int64 elements of 2 KiB (N=20000) and 1 MiB
(N=1000), read with a plain Python loop through ``distribute`` in both
processing modes, compression "AUTO" and None, over the workers' "grpc"
endpoint and (when installed) their "grpc+local" data-transfer endpoint.
Per cell: 1 warm-up and ``--runs`` measured jobs, medians of

* first ms: from ``apply(distribute(...))`` (registration included) to the
  first element;
* el/s, MB/s: the steady rate between the first and the last element;
* end s: until StopIteration.

Then the end time of 10-element jobs. With torch importable, the PyTorch rows: the 1 MiB
workload (distributed_epoch, no compression, over grpc+local) read through the PyTorch
adapter (``ServiceDataset`` in a ``DataLoader``, without and with 2 loader workers) and
through the service's numpy iterator, beside a plain ``DataLoader(num_workers=2)`` over the
same elements made locally (``_data_workload.LocalFill``); 1 warm-up and ``--runs`` rounds,
each reading once in every way (interleaved), medians of el/s. With tensorflow importable the same
matrix runs on tf.data service (dispatcher and workers in own processes) and
the ratios are measured ones; otherwise the ratios use the TF 2.21 numbers
recorded on this machine kind (shared/research/tensorflow.md, "own processes").
The Markdown report is printed and written to bench/results/data-<time>.md.
Every process started here is stopped at the end, also on error.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _data_workload  # noqa: E402

from clusterwire.data import worker_auth  # noqa: E402
from clusterwire.data.cli import await_ready  # noqa: E402
from clusterwire.ready_line import say_ready  # noqa: E402

WORKLOADS = {"2 KiB": ("fill_2k", 256, 20000), "1 MiB": ("fill_1m", 131072, 1000)}
MODES = ("parallel_epochs", "distributed_epoch")
COMPRESSIONS = ("AUTO", None)
# tf.data service 2.21, dispatcher and 2 workers in own processes, this machine kind:
# (workload, mode, compression) -> (first ms, el/s, MB/s).
TF_REFERENCE = {
    ("2 KiB", "parallel_epochs", "AUTO"): (79, 1306, 2.7),
    ("2 KiB", "parallel_epochs", None): (60, 2517, 5.2),
    ("2 KiB", "distributed_epoch", "AUTO"): (78, 1610, 3.3),
    ("2 KiB", "distributed_epoch", None): (63, 1733, 3.5),
    ("1 MiB", "parallel_epochs", "AUTO"): (67, 997, 1045),
    ("1 MiB", "parallel_epochs", None): (51, 953, 1000),
    ("1 MiB", "distributed_epoch", "AUTO"): (93, 817, 856),
    ("1 MiB", "distributed_epoch", None): (57, 861, 902),
}
TF_TEN_ELEMENT_S = 1.02
TARGETS = {"2 KiB el/s ratio": 3.0, "1 MiB MB/s ratio": 1.5, "first ms": 50.0,
           "10-element job ms": 100.0}
# The PyTorch rows: (name, what it reads through, loader workers or None for the numpy loop).
TORCH_ROWS = (
    ("plain", "plain DataLoader(num_workers=2), elements made locally", 2),
    ("numpy", "service, numpy iterator (distribute)", None),
    ("adapter", "service, ServiceDataset + DataLoader(num_workers=0)", 0),
    ("adapter-2", "service, ServiceDataset + DataLoader(num_workers=2)", 2),
)
# adapter el/s over the plain DataLoader's (at least); over the numpy iterator's (at least).
TORCH_TARGETS = {"plain": 0.9, "numpy": 0.95}


class Servers:
    """A dispatcher and ``workers`` workers in own processes (clusterwire or TF)."""

    def __init__(self, kind: str, workers: int = 2, transfer: str | None = None):
        self.processes: list[subprocess.Popen] = []
        env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
               worker_auth.ENV: worker_auth.new_token().decode()}  # the workers' own secret
        try:
            if kind == "clusterwire":
                self.target = self._start([sys.executable, "-m", "clusterwire", "dispatcher",
                                           "--quiet"], env)
                address = self.target.split("://")[1]
                extra = ["--data-transfer-protocol", transfer] if transfer else []
                for _ in range(workers):
                    self._start([sys.executable, "-m", "clusterwire", "worker", "--quiet",
                                 "--dispatcher-address", address, "--import", "_data_workload",
                                 *extra], env)
            else:
                script = os.path.abspath(__file__)
                self.target = self._start([sys.executable, script, "_tf_dispatcher"], env)
                for _ in range(workers):
                    self._start([sys.executable, script, "_tf_worker", self.target], env)
        except BaseException:
            self.close()
            raise

    def _start(self, command: list[str], env: dict[str, str]) -> str:
        self.processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                                               env=env))
        target = await_ready(self.processes[-1], 60.0)
        if target is None:
            raise RuntimeError(f"{command} did not start")
        return target

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()
            if process.stdout:
                process.stdout.close()


# ---- the client loops ----

def clusterwire_job(target: str, workload: str, count: int, mode: str, compression: Any,
                    transfer: str | None) -> dict[str, float]:
    from clusterwire import data

    fill = getattr(_data_workload, WORKLOADS[workload][0])
    started = time.perf_counter()
    ds = data.Dataset.range(count).map(fill).apply(data.distribute(
        mode, target, compression=compression, data_transfer_protocol=transfer))
    return _consume(iter(ds), started)


def tf_job(target: str, workload: str, count: int, mode: str, compression: Any,
           transfer: str | None) -> dict[str, float]:
    import tensorflow as tf

    del transfer
    size = WORKLOADS[workload][1]
    started = time.perf_counter()
    ds = tf.data.Dataset.range(count).map(lambda x: tf.fill([size], x)).apply(
        tf.data.experimental.service.distribute(mode, target, compression=compression))
    return _consume(iter(ds), started)


def _consume(iterator: Any, started: float) -> dict[str, float]:
    next(iterator)
    first = last = time.perf_counter()
    count = 1
    for _ in iterator:
        count += 1
        last = time.perf_counter()
    end = time.perf_counter()
    return {"first_ms": (first - started) * 1e3, "end_s": end - started, "elements": count,
            "el_s": (count - 1) / (last - first) if count > 1 else 0.0}


def torch_job(target: str, way: str, workers: int | None) -> dict[str, float]:
    """One read of the 1 MiB workload (distributed_epoch, no compression, grpc+local), ``way``
    being a name of TORCH_ROWS."""
    from torch.utils.data import DataLoader

    from clusterwire import data
    from clusterwire.data.torch_dataset import ServiceDataset

    count = WORKLOADS["1 MiB"][2]
    read = {"processing_mode": "distributed_epoch", "service": target, "compression": None,
            "data_transfer_protocol": "grpc+local"}
    # Loader workers start from a fork server: this process has used gRPC (see torch_dataset).
    loader = {"batch_size": None, "num_workers": workers or 0, "in_order": False,
              **({"multiprocessing_context": "forkserver"} if workers else {})}
    started = time.perf_counter()
    pipeline = data.Dataset.range(count).map(_data_workload.fill_1m)
    if way == "plain":
        iterator = iter(DataLoader(_data_workload.LocalFill(count), **loader))
    elif way == "numpy":
        iterator = iter(pipeline.apply(data.distribute(**read)))
    else:
        iterator = iter(DataLoader(ServiceDataset(pipeline, **read), **loader))
    return _consume(iterator, started)


def run_torch(target: str, runs: int) -> list[dict[str, Any]]:
    """The PyTorch rows: a warm-up round, then ``runs`` rounds reading once in every way."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in TORCH_ROWS}
    for round_ in range(runs + 1):
        for name, _, workers in TORCH_ROWS:
            result = torch_job(target, name, workers)
            if round_:
                results[name].append(result)
    rows = []
    size = WORKLOADS["1 MiB"][1] * 8
    for name, what, _ in TORCH_ROWS:
        row = {key: statistics.median(r[key] for r in results[name])
               for key in results[name][0]}
        row.update(name=name, what=what, MB_s=row["el_s"] * size / 1e6,
                   runs=[r["el_s"] for r in results[name]])
        rows.append(row)
        print(f"{what}: {row['el_s']:.0f} el/s", file=sys.stderr, flush=True)
    return rows


def torch_report(rows: list[dict[str, Any]], runs: int, load: float) -> str:
    """The PyTorch rows' table, ratios and verdicts."""
    rate = {row["name"]: row["el_s"] for row in rows}
    lines = [
        f"PyTorch rows: 1 MiB int64 elements, distributed_epoch, compression None, service "
        f"elements over grpc+local; {runs} interleaved rounds (medians); load average "
        f"{load:.2f} at the start.", "",
        "| read through | elements | el/s | MB/s | x plain DataLoader | x numpy iterator "
        "| el/s of each round |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['what']} | {row['elements']:.0f} | {row['el_s']:.0f} | {row['MB_s']:.0f} "
            f"| {row['el_s'] / rate['plain']:.2f}x | {row['el_s'] / rate['numpy']:.2f}x | "
            f"{', '.join(f'{r:.0f}' for r in row['runs'])} |")
    lines.append("")
    for baseline, line in TORCH_TARGETS.items():
        ratio = rate["adapter"] / rate[baseline]
        lines.append(f"Target: adapter (num_workers=0) / {baseline} >= {line}x: {ratio:.2f}x, "
                     f"{'met' if ratio >= line else 'NOT MET'}")
    return "\n".join(lines)


def ten_element_job(job: Callable[..., dict[str, float]], target: str, mode: str) -> float:
    return job(target, "2 KiB", 10, mode, "AUTO", None)["end_s"]


def run_matrix(job: Callable[..., dict[str, float]], target: str, runs: int,
               transfers: list[str | None], cells: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for workload, (_, size, count) in WORKLOADS.items():
        for transfer in transfers:
            for mode in MODES:
                for compression in COMPRESSIONS:
                    if not _selected(cells, workload, mode, compression, transfer):
                        continue
                    job(target, workload, max(count // 10, 10), mode, compression, transfer)
                    results = [job(target, workload, count, mode, compression, transfer)
                               for _ in range(runs)]
                    row = {key: statistics.median(r[key] for r in results)
                           for key in results[0]}
                    row.update(workload=workload, mode=mode, compression=compression,
                               transfer=transfer or "grpc", MB_s=row["el_s"] * size * 8 / 1e6)
                    rows.append(row)
                    print(_row_text(row), file=sys.stderr, flush=True)
    for mode in MODES if cells.ten else ():
        ten = [ten_element_job(job, target, mode) for _ in range(max(runs, 5))]
        rows.append({"ten": True, "mode": mode, "end_s": statistics.median(ten),
                     "max_s": max(ten)})
    return rows


def _selected(cells: argparse.Namespace, workload: str, mode: str, compression: Any,
              transfer: str | None) -> bool:
    return ((not cells.workload or workload in cells.workload)
            and (not cells.mode or mode.split("_")[0] in cells.mode)
            and (not cells.compression or str(compression) in cells.compression)
            and (not cells.transfer or (transfer or "grpc") in cells.transfer))


def _row_text(row: dict[str, Any]) -> str:
    return (f"{row['workload']} {row['mode']} {row['compression']} {row['transfer']}: "
            f"first {row['first_ms']:.1f} ms, {row['el_s']:.0f} el/s, {row['MB_s']:.0f} MB/s")


# ---- report ----

def report(rows: list[dict[str, Any]], tf_rows: list[dict[str, Any]] | None, runs: int) -> str:
    tf_cells = {(r["workload"], r["mode"], r["compression"]): (r["first_ms"], r["el_s"],
                                                               r["MB_s"])
                for r in tf_rows or [] if "ten" not in r}
    reference = tf_cells or TF_REFERENCE
    source = "measured in this run" if tf_rows else "TF 2.21 reference (tensorflow.md)"
    lines = [
        f"clusterwire.data vs tf.data service; {platform.node()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, {datetime.datetime.now():%Y-%m-%d %H:%M}; "
        f"{runs} runs per cell (medians). TF: {source}.", "",
        "| elem | mode | compr. | transfer | first ms | el/s | MB/s | end s | TF first ms "
        "| TF el/s | TF MB/s | el/s ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "ten" in row:
            continue
        tf_first, tf_rate, tf_mbs = reference[row["workload"], row["mode"], row["compression"]]
        lines.append(
            f"| {row['workload']} | {row['mode'].split('_')[0]} | {row['compression']} | "
            f"{row['transfer']} | {row['first_ms']:.0f} | {row['el_s']:.0f} | "
            f"{row['MB_s']:.0f} | {row['end_s']:.2f} | {tf_first:.0f} | {tf_rate:.0f} | "
            f"{tf_mbs:.0f} | {row['el_s'] / tf_rate:.1f}x |")
    tf_ten = {r["mode"]: r["end_s"] for r in tf_rows or [] if "ten" in r}
    lines += ["", "| 10-element job | clusterwire median ms | max ms | TF s |", "|---|---|---|---|"]
    for row in (r for r in rows if "ten" in r):
        lines.append(f"| {row['mode']} | {row['end_s'] * 1e3:.1f} | {row['max_s'] * 1e3:.1f} | "
                     f"{tf_ten.get(row['mode'], TF_TEN_ELEMENT_S):.2f} |")
    lines += ["", f"Targets: {TARGETS}"]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_tf_"):
        return _tf_server(sys.argv[1], sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 run per cell")
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS),
                        help="only this element size (repeatable; default: all)")
    parser.add_argument("--mode", action="append", choices=["parallel", "distributed"],
                        help="only this processing mode (repeatable)")
    parser.add_argument("--compression", action="append", choices=["AUTO", "None"],
                        help="only this compression (repeatable)")
    parser.add_argument("--transfer", action="append", choices=["grpc", "grpc+local"],
                        help="only this element transfer (repeatable)")
    parser.add_argument("--no-ten", dest="ten", action="store_false",
                        help="skip the 10-element jobs")
    torch_rows = parser.add_mutually_exclusive_group()
    torch_rows.add_argument("--no-torch", dest="torch", action="store_false",
                            help="skip the PyTorch rows")
    torch_rows.add_argument("--only-torch", action="store_true",
                            help="only the PyTorch rows")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    from clusterwire.plugins import get_plugin_manager

    load = os.getloadavg()[0]
    local = "grpc+local" in get_plugin_manager().protocols()
    with_torch = args.torch and local and importlib.util.find_spec("torch") is not None
    if args.torch and not with_torch:
        print("PyTorch rows: skipped (they need torch and grpc+local)", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    parts = []
    servers = Servers("clusterwire", transfer="grpc+local" if local else None)
    try:
        if not args.only_torch:
            rows = run_matrix(clusterwire_job, servers.target, runs,
                              [None, "grpc+local"] if local else [None], args)
        if with_torch:
            parts.append(torch_report(run_torch(servers.target, runs), runs, load))
    finally:
        servers.close()
    if not args.only_torch:
        parts.insert(0, report(rows, run_tf(runs, args), runs))
    text = "\n\n".join(parts)
    print(text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"data-{datetime.datetime.now():%Y%m%d-%H%M%S}.md")
    with open(path, "w") as handle:
        handle.write(text + "\n")
    print(f"\nwritten to {path}", file=sys.stderr)
    return 0


def run_tf(runs: int, cells: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The matrix on tf.data service; None when tensorflow is not installed."""
    if importlib.util.find_spec("tensorflow") is None:
        print("tensorflow: not installed (ratios use the recorded TF 2.21 numbers)",
              file=sys.stderr)
        return None
    servers = Servers("tensorflow")
    try:
        return run_matrix(tf_job, servers.target, runs, [None], cells)
    finally:
        servers.close()


def _tf_server(role: str, argv: list[str]) -> int:
    import tensorflow as tf

    service = tf.data.experimental.service
    if role == "_tf_dispatcher":
        server = service.DispatchServer()
        say_ready(server.target)
    else:
        address = argv[0].split("://")[1]
        server = service.WorkerServer(service.WorkerConfig(dispatcher_address=address))
        say_ready(address)
    server.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
