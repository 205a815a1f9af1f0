"""What metrics cost: the same work with recording off and with metrics on, in one run.

Run from the repository root::

    python bench/bench_metrics.py

"Off" is no recording at all (what ``CLUSTERWIRE_METRICS=0`` gives); "on" is the default
recording plus an open metrics endpoint that a scraper in this process reads every second
(``--scrape-interval``) while the work runs, as Prometheus would. The sides' rounds are
interleaved, so a slow phase of the machine hits both alike. Measured:

1. 8-byte ``Session.get`` round trips over ``grpc`` and ``grpc+local`` from this process to
   a task process (bench_session's direct and same-host paths), and in-process (a Session
   on its own task, in a task process pinned to CPU 0: the cheapest path, where the
   per-request bookkeeping weighs most). Each path's task process has metrics on and
   switches its recording off and on between rounds: two processes of the same code differ
   by more than the cost (an off/off comparison of three processes a side moves by up to
   1.5%), one process against itself does not. Its endpoint is scraped throughout (both
   sides alike), so what scrapes take is measured apart and added to "on": a scrape's CPU
   time in that process, at the scrape rate. The sides' rounds come in pairs; the change
   is the median of the pairs' on/off ratios of round medians (a same-host get's latency
   has two modes, whose mix moves a pooled median by more than the cost);
2. 2 KiB elements/s of a data-service job (bench_data's 2 KiB cell, parallel_epochs, two
   workers): a dispatcher, two workers and the consumer, each its own process, a set with
   recording off (``CLUSTERWIRE_METRICS=0``) against a set with metrics on, their jobs
   interleaved, over several fresh pairs of sets.

The target (issue "Observability"): "on" within 3% of "off". The Markdown report is printed
and written to bench/results/metrics-<time>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _machine import cpu_model  # noqa: E402

from clusterwire.data import worker_auth  # noqa: E402
from clusterwire.local_cluster import await_ready  # noqa: E402

TARGET = 0.03


_WORKER_TOKEN = worker_auth.new_token().decode()


def _env(side: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
           worker_auth.ENV: _WORKER_TOKEN}  # the data service's workers' own secret
    if side == "off":
        env["CLUSTERWIRE_METRICS"] = "0"
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Scraper:
    """Reads every URL every ``interval`` s until closed; counts the scrapes."""

    def __init__(self, urls: list[str], interval: float):
        self.urls, self.interval, self.scrapes = urls, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for url in self.urls:
                with urllib.request.urlopen(url, timeout=10) as answer:
                    answer.read()
                self.scrapes += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Processes:
    """Child processes, killed at the end."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []

    def start(self, command: list[str], env: dict[str, str]) -> str:
        """Start a server process; its target (from its ready line)."""
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                                 text=True, env=env)
        self.children.append(child)
        line = await_ready(child, 60.0)
        if line is None:
            raise RuntimeError(f"{command} did not start")
        return line

    def close(self) -> None:
        for child in self.children:
            child.kill()
            child.wait()


# ---- 1. 8-byte gets ----

#: The paths of the gets section: name -> (protocol, whether the gets are in-process).
PATHS = {"grpc": ("grpc", False), "grpc+local": ("grpc+local", False),
         "in-process": ("grpc", True)}


def _task_main(protocol: str, metrics_port: int, in_process_gets: int) -> None:
    """A task with metrics on and its endpoint open. Per line read: "on" / "off" switches
    its shell's recording (answering 0), or with ``in_process_gets``, times that many gets
    of a Session on its own task with the recording so switched and prints their median in
    us; "cpu" prints the process's CPU seconds so far.

    Switched, the recording is what ``CLUSTERWIRE_METRICS=0`` leaves at construction (no
    request statistics) or the default: so both sides run in one process, with one layout.
    An in-process get runs in the caller's thread: that process is pinned to CPU 0 (moving
    between CPUs is noise only)."""
    import clusterwire

    if in_process_gets:
        os.sched_setaffinity(0, {0})
    server = clusterwire.Server({"w": ["127.0.0.1:0"]}, job_name="w", task_index=0,
                                protocol=protocol, config={"metrics_port": metrics_port})
    session = clusterwire.Session(server.target)
    session.put("x", np.arange(1, dtype=np.int64))
    shell = server._shell
    recording = {"on": shell._stats, "off": None}
    for _ in range(in_process_gets):
        session.get("x")
    print("ready", server.target, flush=True)
    clock = time.perf_counter_ns
    for line in sys.stdin:
        command = line.strip()
        if command == "cpu":
            print(time.process_time(), flush=True)
            continue
        shell._stats = recording[command]
        times = []
        for _ in range(in_process_gets):
            start = clock()
            session.get("x")
            times.append(clock() - start)
        print(statistics.median(times) / 1e3 if times else 0, flush=True)
    server.stop()


def _child(command: list[str], env: dict[str, str], processes: Processes
           ) -> tuple[subprocess.Popen, str]:
    """A child of this benchmark that answers one line per line it reads, after a "ready"
    line; the rest of that line (a target, or nothing)."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True,
                             env=env)
    processes.children.append(child)
    first = child.stdout.readline().split()
    if first[:1] != ["ready"]:
        raise RuntimeError(f"{command} did not start")
    return child, " ".join(first[1:])


def _ask(child: subprocess.Popen, line: str) -> float:
    child.stdin.write(line + "\n")
    child.stdin.flush()
    return float(child.stdout.readline())


def scrape_cpu_seconds(child: subprocess.Popen, url: str, scrapes: int = 40) -> float:
    """The CPU time ``child`` spends on one scrape of ``url`` (while it does nothing else)."""
    before = _ask(child, "cpu")
    for _ in range(scrapes):
        with urllib.request.urlopen(url, timeout=10) as answer:
            answer.read()
    return (_ask(child, "cpu") - before) / scrapes


def measure_gets(args: argparse.Namespace, processes: Processes) -> list[dict]:
    """8-byte gets on each path, recording off and on in the same task process (switched
    per round; its endpoint scraped throughout, both sides alike), the scrapes' share of
    that process added to "on": a scrape's CPU time at the scrape rate."""
    import clusterwire

    children, urls, gets = {}, {}, {}
    for path, (protocol, in_process) in PATHS.items():
        port = _free_port()
        urls[path] = f"http://127.0.0.1:{port}/metrics"
        children[path], target = _child(
            [sys.executable, __file__, "--role", "task", "--protocol", protocol,
             "--metrics-port", str(port), "--in-process-gets",
             str(args.in_process_gets_per_round if in_process else 0)], _env("on"), processes)
        if not in_process:
            session = clusterwire.Session(target)
            gets[path] = lambda session=session: session.get("x")
            for _ in range(args.warmup):
                gets[path]()
    rounds: dict[tuple[str, str], list[float]] = {
        (path, side): [] for path in PATHS for side in ("off", "on")}
    clock = time.perf_counter_ns
    scraper = Scraper(list(urls.values()), args.scrape_interval)
    try:
        for number in range(args.rounds):
            for path in PATHS:
                for side in ("off", "on") if number % 2 == 0 else ("on", "off"):
                    median_us = _ask(children[path], "off" if args.control else side)
                    if path in gets:
                        get, times = gets[path], []
                        for _ in range(args.gets_per_round):
                            start = clock()
                            get()
                            times.append(clock() - start)
                        median_us = statistics.median(times) / 1e3
                    rounds[path, side].append(median_us)
    finally:
        scraper.close()
    rows = []
    for path in PATHS:
        scrape = scrape_cpu_seconds(children[path], urls[path])
        off, on = np.array(rounds[path, "off"]), np.array(rounds[path, "on"])
        # Each round against the other side's round of the same pair: a slow phase of the
        # machine hits both; the scrapes' share of the process is added to "on" (not in a
        # control run, where both sides are the same).
        share = 0.0 if args.control else scrape / args.scrape_interval
        changes = on / off * (1 + share) - 1
        rows.append({"what": f"8 B Session.get, {path}", "off": float(np.median(off)),
                     "on": float(np.median(on)), "unit": "us",
                     "change": float(np.median(changes)),
                     "quartiles": tuple(np.percentile(changes, [25, 75])),
                     "scrapes": scraper.scrapes, "scrape_ms": scrape * 1e3})
    return rows


def alternate(children: dict[str, subprocess.Popen], runs: int) -> dict[str, list[float]]:
    """Ask each side's child for a number ``runs`` times, alternating which goes first."""
    values: dict[str, list[float]] = {side: [] for side in children}
    for run in range(runs):
        for side in (list(children) if run % 2 == 0 else list(children)[::-1]):
            values[side].append(_ask(children[side], "go"))
    return values


# ---- 2. 2 KiB elements ----

def _consume_main(target: str, count: int, metrics_port: int | None) -> None:
    import _data_workload

    from clusterwire import data

    endpoint = None
    if metrics_port is not None:
        from clusterwire.metrics.endpoint import serve_metrics
        endpoint = serve_metrics(metrics_port)
    print("ready", flush=True)
    for _ in sys.stdin:  # a job per line read
        ds = data.Dataset.range(count).map(_data_workload.fill_2k).apply(
            data.distribute("parallel_epochs", target))
        iterator = iter(ds)
        next(iterator)
        first = last = time.perf_counter()
        elements = 1
        for _element in iterator:
            elements += 1
            last = time.perf_counter()
        print((elements - 1) / (last - first), flush=True)
    if endpoint is not None:
        endpoint.close()


def _data_side(side: str, count: int, processes: Processes, urls: list[str]
               ) -> subprocess.Popen:
    def metrics() -> list[str]:
        if side == "off":
            return []
        port = _free_port()
        urls.append(f"http://127.0.0.1:{port}/metrics")
        return ["--metrics-port", str(port)]

    env = _env(side)
    target = processes.start([sys.executable, "-m", "clusterwire", "dispatcher", "--port", "0",
                              "--quiet", *metrics()], env)
    for _ in range(2):
        processes.start([sys.executable, "-m", "clusterwire", "worker", "--port", "0",
                         "--quiet", "--dispatcher-address", target.split("://")[1],
                         "--import", "_data_workload", *metrics()], env)
    return _child([sys.executable, __file__, "--role", "consume", "--target", target,
                   "--count", str(count), *metrics()], env, processes)[0]


def measure_data(args: argparse.Namespace) -> list[dict]:
    """Jobs of a set of processes with recording off against a set with metrics on,
    interleaved; ``--data-sets`` fresh pairs of sets, their jobs pooled (two sets of the same
    processes differ by a few percent, which pairs average out)."""
    values: dict[str, list[float]] = {"off": [], "on": []}
    scrapes = 0
    for _pair in range(args.data_sets):
        processes, urls = Processes(), []
        try:
            consumers = {side: _data_side(side, args.elements, processes, urls)
                         for side in ("off", "on")}
            scraper = Scraper(urls, args.scrape_interval)
            try:
                for side, numbers in alternate(consumers, args.data_runs).items():
                    values[side] += numbers
            finally:
                scraper.close()
                scrapes += scraper.scrapes
        finally:
            processes.close()
    off, on = statistics.median(values["off"]), statistics.median(values["on"])
    return [{"what": f"2 KiB elements/s, parallel_epochs, 2 workers ({args.data_sets} pairs "
                     f"of process sets, {args.data_runs} jobs each a side)",
             "off": off, "on": on, "unit": "el/s", "change": on / off - 1, "scrapes": scrapes}]


def render(args: argparse.Namespace, rows: list[dict], seconds: float) -> str:
    from clusterwire.metrics import requests

    cells = ("C (clusterwire.metrics._request_cells)"
             if requests.RequestCells is not requests.PythonRequestCells
             else "the Python fallback (the C cells were not built)")
    lines = [f"# Metrics overhead ({datetime.datetime.now():%Y-%m-%d %H:%M})", "",
             f"Machine: {cpu_model()}, {os.cpu_count()} CPUs. Command: "
             f"`python bench/bench_metrics.py {' '.join(sys.argv[1:])}`. {seconds:.0f} s. "
             f"Request counts recorded in {cells}. Gets: {args.rounds} rounds a side "
             f"({args.gets_per_round} gets each, in-process {args.in_process_gets_per_round}), "
             "the change the median of each pair's on/off ratio (quartiles beside it)."
             + (" **Control run: recording off on both sides.**" if args.control else ""), "",
             "| Work | Recording off | Metrics on (scraped every "
             f"{args.scrape_interval:g} s) | Change | A scrape's CPU | Scrapes | Within 3% |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        # For latency a positive change is a cost; for el/s a negative one is.
        cost = row["change"] if row["unit"] == "us" else -row["change"]
        scrape = "in the run"
        if "scrape_ms" in row:
            scrape = f"{row['scrape_ms']:.2f} ms{'' if args.control else ', added'}"
        change = f"{row['change']:+.1%}"
        if "quartiles" in row:
            change += " ({:+.1%} to {:+.1%})".format(*row["quartiles"])
        lines.append(f"| {row['what']} | {row['off']:,.1f} {row['unit']} | "
                     f"{row['on']:,.1f} {row['unit']} | {change} | {scrape} | "
                     f"{row['scrapes']} | {'met' if cost <= TARGET else 'NOT met'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["task", "consume"], help=argparse.SUPPRESS)
    parser.add_argument("--protocol", default="grpc", help=argparse.SUPPRESS)
    parser.add_argument("--metrics-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--in-process-gets", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--gets-per-round", type=int, default=100,
                        help="timed gets of a round, over grpc and grpc+local")
    parser.add_argument("--in-process-gets-per-round", type=int, default=1000,
                        help="timed gets of a round, in-process")
    parser.add_argument("--warmup", type=int, default=300, help="untimed gets per path")
    parser.add_argument("--rounds", type=int, default=200,
                        help="rounds of gets a side, the sides' rounds in pairs")
    parser.add_argument("--elements", type=int, default=20000, help="elements per data job")
    parser.add_argument("--data-runs", type=int, default=4,
                        help="data jobs a side per pair of process sets")
    parser.add_argument("--data-sets", type=int, default=3,
                        help="pairs of process sets (off, on) for the data jobs")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--control", action="store_true",
                        help="gets with recording off on both sides: what a change of "
                             "nothing measures as (the method's noise)")
    parser.add_argument("--section", choices=["gets", "data", "all"], default="all",
                        help="what to measure (default: both)")
    args = parser.parse_args()
    if args.role == "task":
        _task_main(args.protocol, args.metrics_port, args.in_process_gets)
        return 0
    if args.role == "consume":
        _consume_main(args.target, args.count, args.metrics_port)
        return 0
    started = time.monotonic()
    rows = []
    if args.section in ("gets", "all"):
        processes = Processes()
        try:
            rows += measure_gets(args, processes)
        finally:
            processes.close()
    if args.section in ("data", "all"):
        rows += measure_data(args)
    text = render(args, rows, time.monotonic() - started)
    print(text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"metrics-{datetime.datetime.now():%Y%m%d-%H%M%S}.md")
    with open(path, "w") as out:
        out.write(text)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
