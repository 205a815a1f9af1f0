"""What the cluster token costs: Session and the data service with a token, next to without.

Run from the repository root::

    python bench/bench_security.py [--rounds 7]

Two of each server run at once, one requiring the cluster token and one open, each in its own
processes on 127.0.0.1 over grpc; the bench process is the client of both. Each round starts
fresh server processes (new CPU placements) and measures both sides back to back, in an order
that alternates, so a slow phase of the machine hits both alike:

1. ``Session.get`` of an 8-byte array (400 round trips a round per side, in 10 alternating
   slices of 40; median latency);
2. ``Session.get`` of a 64 MiB array (4 a round per side, alternating; median time);
3. a data-service read of ``Dataset.range(200_000)`` through ``distribute("parallel_epochs")``
   (elements/s), and of 64 elements of 1 MiB each (MiB/s).

A ratio is token / open (time) or open / token (throughput), the median of the rounds' ratios;
the target (issue 15) is at most 1.05 for each. The Markdown report is printed and written to
bench/results/security-<time>.md. Every process started here is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np

import clusterwire
from clusterwire import data
from clusterwire.data import worker_auth
from clusterwire.data.cli import await_ready
from clusterwire.local_cluster import LocalCluster

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = 1.05
_SMALL_CALLS = 40      # 8-byte gets in a row, 10 times a round per side
_SMALL_SLICES = 10
_BIG_GETS = 4


@contextlib.contextmanager
def data_service(token_file: str | None) -> Iterator[str]:
    """A dispatcher and a worker process (with ``token_file``: requiring the token)."""
    security = ["--auth-token-file", token_file] if token_file else []
    procs: list[subprocess.Popen] = []
    workers = {worker_auth.ENV: worker_auth.new_token().decode()}  # the workers' own secret
    try:
        def start(*args: str) -> str:
            proc = subprocess.Popen([sys.executable, "-m", "clusterwire", *args, *security,
                                     "--quiet"], stdout=subprocess.PIPE, text=True,
                                    env={**os.environ, "PYTHONPATH": HERE, **workers})
            procs.append(proc)
            target = await_ready(proc, 30)
            if target is None:
                raise RuntimeError(f"clusterwire {args[0]} did not start")
            return target

        dispatcher = start("dispatcher", "--port", "0")
        start("worker", "--dispatcher-address", dispatcher.split("://")[1],
              "--import", "_data_workload")
        yield dispatcher
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def median_get(session: clusterwire.Session, name: str, count: int) -> float:
    """Median seconds of ``count`` gets of ``name``."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        session.get(name)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def read_rate(dispatcher: str, dataset: data.Dataset, config: dict | None,
              unit: Callable[[object], float]) -> float:
    """Units per second of one parallel_epochs read of ``dataset``."""
    reader = dataset.apply(data.distribute("parallel_epochs", dispatcher, config=config))
    started = time.perf_counter()
    total = sum(unit(element) for element in reader)
    return total / (time.perf_counter() - started)


@contextlib.contextmanager
def servers(configs: dict[str, dict | None], token_file: str) -> Iterator[tuple[dict, dict]]:
    """Fresh servers of both sides: a task with a session to it, and a data service."""
    with contextlib.ExitStack() as stack:
        sessions, dispatchers = {}, {}
        for side, config in configs.items():
            cluster = stack.enter_context(LocalCluster({"ps": 1}, config=config))
            session = stack.enter_context(clusterwire.Session(cluster.target("ps", 0),
                                                              config=config))
            session.put("small", np.arange(1, dtype=np.int64))
            session.put("big", np.ones(64 << 20, np.uint8))
            sessions[side] = session
            dispatchers[side] = stack.enter_context(data_service(
                token_file if config else None))
        yield sessions, dispatchers


def measure(rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per measure, per side ("open", "token"): one value a round.

    Every round starts fresh server processes: where the kernel places a pair of processes
    holds for their life and moves an 8-byte round trip by more than the token costs, so
    each round draws new placements (as bench_transports' forks do).
    """
    import _data_workload as workload

    directory = tempfile.mkdtemp(prefix="cw-bench-security-")
    token_file = os.path.join(directory, "token")
    with open(token_file, "w") as handle:
        handle.write(secrets.token_hex(32))
    configs = {"open": None, "token": {"auth_token_file": token_file}}
    results: dict[str, dict[str, list[float]]] = {}
    for index in range(rounds):
        with servers(configs, token_file) as (sessions, dispatchers):
            # name -> (one sample of a side, samples a side per round: they alternate)
            measures: dict[str, tuple[Callable[[str], float], int]] = {
                "Session.get 8 B (us)": (lambda side: median_get(
                    sessions[side], "small", _SMALL_CALLS) * 1e6, _SMALL_SLICES),
                "Session.get 64 MiB (ms)": (lambda side: median_get(
                    sessions[side], "big", 1) * 1e3, _BIG_GETS),
                "data range(200k) (elements/s)": (lambda side: read_rate(
                    dispatchers[side], data.Dataset.range(200_000), configs[side],
                    lambda _: 1), 1),
                "data 1 MiB elements (MiB/s)": (lambda side: read_rate(
                    dispatchers[side], data.Dataset.range(64).map(workload.fill_1m),
                    configs[side], lambda e: e.nbytes / (1 << 20)), 1),
            }
            for name, (run, slices) in measures.items():
                run("open"), run("token")  # warm-up: connections, imports, first jobs
                samples: dict[str, list[float]] = {"open": [], "token": []}
                for turn in range(slices):
                    first = "open" if (index + turn) % 2 == 0 else "token"
                    for side in (first, "token" if first == "open" else "open"):
                        samples[side].append(run(side))
                for side, values in samples.items():
                    results.setdefault(name, {"open": [], "token": []})[side].append(
                        statistics.median(values))
    return results


def report(results: dict[str, dict[str, list[float]]], rounds: int) -> str:
    lines = [
        "# Cluster token cost",
        "",
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, {rounds} rounds; "
        "`python bench/bench_security.py`",
        "",
        "| measure | open | with token | cost (token/open) | target <= "
        f"{TARGET} |",
        "|---|---:|---:|---:|---|",
    ]
    for name, sides in results.items():
        per_second = name.endswith("/s)")
        ratios = [(o / t if per_second else t / o)
                  for o, t in zip(sides["open"], sides["token"], strict=True)]
        cost = statistics.median(ratios)
        lines.append(f"| {name} | {statistics.median(sides['open']):.4g} | "
                     f"{statistics.median(sides['token']):.4g} | {cost:.3f} "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) | "
                     f"{'met' if cost <= TARGET else 'MISSED'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    text = report(measure(args.rounds), args.rounds)
    print(text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"security-{datetime.datetime.now():%Y%m%d-%H%M%S}.md")
    with open(path, "w") as handle:
        handle.write(text)


if __name__ == "__main__":
    main()
