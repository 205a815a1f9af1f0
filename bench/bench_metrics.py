"""What metrics cost: the same work with recording off and with metrics on, in one run.

Run from the repository root::

    python bench/bench_metrics.py

"Off" is a process started with ``CLUSTERWIRE_METRICS=0`` (no recording at all); "on" is
the default recording plus an open metrics endpoint that a scraper in this process reads
every second (``--scrape-interval``) while the work runs, as Prometheus would. Both sides
run at the same time and their rounds are interleaved, so a slow phase of the machine hits
both alike. Measured:

1. 8-byte ``Session.get`` round trips from this process to a task process, over ``grpc``
   and over ``grpc+local`` (bench_session's direct and same-host paths), and in-process
   (a Session on its own task, in three child processes a side, each pinned to CPU 0: the
   cheapest path, where the per-request bookkeeping weighs most);
2. 2 KiB elements/s of a data-service job (bench_data's 2 KiB cell, parallel_epochs, two
   workers): a dispatcher, two workers and the consumer, each its own process, per side.

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
from bench_session import interleaved_round_trips  # noqa: E402

from clusterwire.local_cluster import READY_PREFIX, await_ready  # noqa: E402

TARGET = 0.03
#: Child processes a side for the in-process gets: a process's layout alone moves the time of
#: a path this short by a few percent, so each side is several processes.
IN_PROCESS_CHILDREN = 3


def _env(side: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
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

def _task_main(protocol: str, metrics_port: int | None) -> None:
    import clusterwire

    config = {} if metrics_port is None else {"metrics_port": metrics_port}
    server = clusterwire.Server({"w": ["127.0.0.1:0"]}, job_name="w", task_index=0,
                                protocol=protocol, config=config)
    clusterwire.Session(server.target).put("x", np.arange(1, dtype=np.int64))
    print(READY_PREFIX + server.target, flush=True)
    sys.stdin.read()
    server.stop()


def measure_gets(args: argparse.Namespace, processes: Processes) -> list[dict]:
    import clusterwire

    variants, urls = {}, []
    for protocol in ("grpc", "grpc+local"):
        for side in ("off", "on"):
            command = [sys.executable, __file__, "--role", "task", "--protocol", protocol]
            if side == "on":
                port = _free_port()
                command += ["--metrics-port", str(port)]
                urls.append(f"http://127.0.0.1:{port}/metrics")
            target = processes.start(command, _env(side))
            session = clusterwire.Session(target)
            variants[(protocol, side)] = (lambda s=session: s.get("x"))
    scraper = Scraper(urls, args.scrape_interval)
    try:
        samples = interleaved_round_trips(variants, args.iterations, args.warmup, args.rounds)
    finally:
        scraper.close()
    rows = []
    for protocol in ("grpc", "grpc+local"):
        off = statistics.median(samples[(protocol, "off")]) / 1e3
        on = statistics.median(samples[(protocol, "on")]) / 1e3
        rows.append({"what": f"8 B Session.get, {protocol}", "off": off, "on": on,
                     "unit": "us", "change": on / off - 1, "scrapes": scraper.scrapes})
    return rows


def _in_process_main(metrics_port: int | None, per_round: int) -> None:
    """Time in-process gets (a Session on this process's own task) ``per_round`` at a
    time, a round per line read; print each round's median in us. Pinned to CPU 0: an
    in-process get runs in the caller's thread, and moving between CPUs is noise only."""
    import clusterwire

    os.sched_setaffinity(0, {0})
    config = {} if metrics_port is None else {"metrics_port": metrics_port}
    server = clusterwire.Server({"w": ["127.0.0.1:0"]}, job_name="w", task_index=0,
                                config=config)
    session = clusterwire.Session(server.target)
    session.put("x", np.arange(1, dtype=np.int64))
    for _ in range(per_round):
        session.get("x")
    print("ready", flush=True)
    clock = time.perf_counter_ns
    for _ in sys.stdin:
        times = []
        for _ in range(per_round):
            start = clock()
            session.get("x")
            times.append(clock() - start)
        print(statistics.median(times) / 1e3, flush=True)
    server.stop()


def _child(command: list[str], env: dict[str, str], processes: Processes) -> subprocess.Popen:
    """A child that answers one number per line it reads, after a "ready" line."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True,
                             env=env)
    processes.children.append(child)
    if child.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{command} did not start")
    return child


def alternate(children: dict[tuple[str, int], subprocess.Popen], runs: int
              ) -> dict[str, list[float]]:
    """Ask each child, keyed by (side, number), for a number ``runs`` times, alternating
    which goes first; the numbers of each side."""
    values: dict[str, list[float]] = {side: [] for side, _ in children}
    for run in range(runs):
        for key in (list(children) if run % 2 == 0 else list(children)[::-1]):
            children[key].stdin.write("go\n")
            children[key].stdin.flush()
            values[key[0]].append(float(children[key].stdout.readline()))
    return values


def compare(children: dict[tuple[str, int], subprocess.Popen], urls: list[str],
            args: argparse.Namespace, runs: int, what: str, unit: str) -> dict:
    """A report row: each side's median of ``runs`` numbers from each of its children,
    asked in turn while the "on" side's endpoints are scraped."""
    scraper = Scraper(urls, args.scrape_interval)
    try:
        values = alternate(children, runs)
    finally:
        scraper.close()
    off, on = statistics.median(values["off"]), statistics.median(values["on"])
    return {"what": what, "off": off, "on": on, "unit": unit, "change": on / off - 1,
            "scrapes": scraper.scrapes}


def measure_in_process(args: argparse.Namespace, processes: Processes) -> list[dict]:
    urls: list[str] = []
    children = {}
    for number in range(IN_PROCESS_CHILDREN):
        for side in ("off", "on"):
            command = [sys.executable, __file__, "--role", "in-process", "--count",
                       str(args.iterations)]
            if side == "on":
                port = _free_port()
                command += ["--metrics-port", str(port)]
                urls.append(f"http://127.0.0.1:{port}/metrics")
            children[side, number] = _child(command, _env(side), processes)
    return [compare(children, urls, args, args.rounds // IN_PROCESS_CHILDREN,
                    "8 B Session.get, in-process (a Session on its own task)", "us")]


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
                   "--count", str(count), *metrics()], env, processes)


def measure_data(args: argparse.Namespace, processes: Processes) -> list[dict]:
    urls: list[str] = []
    consumers = {(side, 0): _data_side(side, args.elements, processes, urls)
                 for side in ("off", "on")}
    return [compare(consumers, urls, args, args.data_runs,
                    "2 KiB elements/s, parallel_epochs, 2 workers", "el/s")]


def render(args: argparse.Namespace, rows: list[dict], seconds: float) -> str:
    lines = [f"# Metrics overhead ({datetime.datetime.now():%Y-%m-%d %H:%M})", "",
             f"Machine: {cpu_model()}, {os.cpu_count()} CPUs. Command: "
             f"`python bench/bench_metrics.py {' '.join(sys.argv[1:])}`. {seconds:.0f} s.", "",
             "| Work | Metrics off | Metrics on (scraped every "
             f"{args.scrape_interval:g} s) | Change | Scrapes | Within 3% |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        # For latency a positive change is a cost; for el/s a negative one is.
        cost = row["change"] if row["unit"] == "us" else -row["change"]
        lines.append(f"| {row['what']} | {row['off']:,.1f} {row['unit']} | "
                     f"{row['on']:,.1f} {row['unit']} | {row['change']:+.1%} | "
                     f"{row['scrapes']} | {'met' if cost <= TARGET else 'NOT met'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["task", "in-process", "consume"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--protocol", default="grpc", help=argparse.SUPPRESS)
    parser.add_argument("--metrics-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=4000, help="timed gets per path")
    parser.add_argument("--warmup", type=int, default=300, help="untimed gets per path")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds of gets")
    parser.add_argument("--elements", type=int, default=20000, help="elements per data job")
    parser.add_argument("--data-runs", type=int, default=6, help="data jobs per side")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--section", choices=["gets", "data", "all"], default="all",
                        help="what to measure (default: both)")
    args = parser.parse_args()
    if args.role == "task":
        _task_main(args.protocol, args.metrics_port)
        return 0
    if args.role == "in-process":
        _in_process_main(args.metrics_port, args.count)
        return 0
    if args.role == "consume":
        _consume_main(args.target, args.count, args.metrics_port)
        return 0
    started = time.monotonic()
    processes = Processes()
    try:
        rows = (measure_gets(args, processes) + measure_in_process(args, processes)
                if args.section in ("gets", "all") else []) + (
            measure_data(args, processes) if args.section in ("data", "all") else [])
    finally:
        processes.close()
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
