"""How long an emulated host (clusterwire.testing.hosts) takes to start n tasks: forked from
the host's zygote (``Host.serve``) against a Python of their own each (``Host.popen`` of
``python -m clusterwire serve``, what ``serve`` did before).

Run from the repository root, as root::

    python bench/bench_hosts.py                     # n = 16, 64; 2 rounds
    python bench/bench_hosts.py --tasks 16 --rounds 1 --json

For every n and round, each on a fresh one-host test bed (its making not timed), n tasks of
one job (``clusterwire serve``, grpc, port 0 on the host's address) are started and the
time until every one printed its ready line is taken, three ways, interleaved:

- ``zygote, cold``: the host's first ``serve`` also starts its zygote (an interpreter
  started in the namespace that imports clusterwire once);
- ``zygote, warm``: a first task has started the zygote; the n tasks after it;
- ``interpreter each``: n processes ``ip netns exec HOST python -m clusterwire serve``.

Reported: median and max over the rounds, in seconds, and each task's Pss (its share of the
pages it maps, from /proc/PID/smaps_rollup) right after all serve, the median of the rounds'
means; ``--json`` prints one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from clusterwire.local_cluster import await_ready
from clusterwire.testing.hosts import EmulatedHosts, Host, netns_available

TIMEOUT_S = 300.0


def serve_args(host: Host, tasks: int, index: int) -> list[str]:
    cluster = json.dumps({"w": [f"{host.address}:0"] * tasks})
    return ["serve", "--cluster", cluster, "--job-name", "w", "--task-index", str(index)]


def forked(host: Host, tasks: int) -> list[int]:
    started = [host.serve(*serve_args(host, tasks, i)) for i in range(tasks)]
    for served in started:
        served.wait_ready(TIMEOUT_S)
    return [served.process.pid for served in started]


def interpreters(host: Host, tasks: int) -> list[int]:
    started = [host.popen([sys.executable, "-m", "clusterwire", *serve_args(host, tasks, i),
                           "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) for i in range(tasks)]
    for process in started:
        if await_ready(process, TIMEOUT_S) is None:
            raise RuntimeError(f"a task exited with {process.poll()} before it served")
    return [process.pid for process in started]  # ip netns exec execs the Python


def pss_mib(pid: int) -> float:
    """The process's proportional set size (its share of the pages it maps), in MiB."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Pss line for pid {pid}")


def timed(tasks: int, start: Callable[[Host, int], list[int]],
          warm: bool) -> tuple[float, float]:
    """Seconds until the tasks serve, and their mean Pss (MiB) right after."""
    with EmulatedHosts(1) as hosts:
        if warm:
            hosts[0].serve(*serve_args(hosts[0], 1, 0)).wait_ready(TIMEOUT_S)
        began = time.perf_counter()
        pids = start(hosts[0], tasks)
        took = time.perf_counter() - began
        return took, statistics.mean(pss_mib(pid) for pid in pids)


WAYS = {"zygote, cold": (forked, False), "zygote, warm": (forked, True),
        "interpreter each": (interpreters, False)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="16,64", help="comma-separated task counts")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    available, reason = netns_available()
    if not available:
        print(f"bench_hosts: {reason}", file=sys.stderr)
        return 2
    counts = [int(n) for n in args.tasks.split(",")]
    times: dict[int, dict[str, list[float]]] = {n: {way: [] for way in WAYS} for n in counts}
    pss: dict[int, dict[str, list[float]]] = {n: {way: [] for way in WAYS} for n in counts}
    for n in counts:
        for _ in range(args.rounds):
            for way, (start, warm) in WAYS.items():
                took, mib = timed(n, start, warm)
                times[n][way].append(took)
                pss[n][way].append(mib)
    if args.json:
        print(json.dumps({str(n): {way: {"median_s": statistics.median(times[n][way]),
                                         "max_s": max(times[n][way]),
                                         "pss_mib_per_task": statistics.median(pss[n][way])}
                                   for way in WAYS}
                          for n in counts}))
        return 0
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{args.rounds} rounds; seconds until n tasks on one emulated host serve, "
          "median / max; a task's Pss right after (MiB, median of the rounds' means)\n")
    print("| n | " + " | ".join(f"{way} (s)" for way in WAYS) + " | "
          + " | ".join(f"Pss, {way}" for way in WAYS) + " |")
    print("|---:|" + "---:|" * 2 * len(WAYS))
    for n in counts:
        cells = [f"{statistics.median(t):.2f} / {max(t):.2f}" for t in times[n].values()]
        cells += [f"{statistics.median(m):.1f}" for m in pss[n].values()]
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
