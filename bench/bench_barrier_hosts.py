"""Barrier rounds of one job spread over emulated hosts (``clusterwire.testing.hosts``).

Run as root from the repository root::

    python bench/bench_barrier_hosts.py --hosts 4 --per-host 32      # 128 tasks, 20 rounds
    PYTHONPATH=/path/to/other/checkout/core-as-clusterwire python bench/bench_barrier_hosts.py

Task i serves on host i % --hosts (``clusterwire serve``, forked from the host's zygote);
a client on one more host holds one ``Session`` per task and, per round, calls
``barrier("b")`` for every task at once from a thread each; a round's latency is from the
first call until the last returns. Prints one JSON line: tasks, hosts, the first round and
the median / p90 / max of the others (ms), the busiest task's barrier requests per round
(``clusterwire_requests_total`` of the barrier methods), and the load average. The tasks
and the client import clusterwire as this process's environment says (PYTHONPATH), so
two checkouts can be compared on the same machine. Every host and process is removed at
the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import clusterwire
from clusterwire.testing.hosts import EmulatedHosts

PORT = 2222

CLIENT = """
import time, clusterwire
from concurrent.futures import ThreadPoolExecutor
to = [clusterwire.Session(t, timeout=30) for t in TARGETS]
for s in to:
    s.status()
pool = ThreadPoolExecutor(len(to))

def barrier_calls():
    return [sum(m["value"] for m in s.status()["metrics"]
                if m["name"] == "clusterwire_requests_total"
                and m["labels"].get("method", "").startswith("barrier")) for s in to]

def rounds(count, timeout):
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        list(pool.map(lambda s: s.barrier("b", timeout=timeout), to))
        seconds.append(time.perf_counter() - started)
    return seconds
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--per-host", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds a barrier arrival waits")
    args = parser.parse_args(argv)
    tasks = args.hosts * args.per_host
    env = dict(os.environ)
    with EmulatedHosts(args.hosts + 1) as hosts:
        layout = [f"{hosts[i % args.hosts].address}:{PORT + i // args.hosts}"
                  for i in range(tasks)]
        cluster = json.dumps({"w": layout})
        served = [hosts[i % args.hosts].serve("serve", "--cluster", cluster, "--job-name", "w",
                                              "--task-index", str(i), env=env)
                  for i in range(tasks)]
        for task in served:
            task.wait_ready(300)
        client = hosts[args.hosts].interpreter(env)
        client.exec(CLIENT.replace("TARGETS", repr([task.target for task in served])), 300)
        before = client.eval("barrier_calls()", 300)
        seconds = client.eval(f"rounds({args.rounds}, {args.timeout})",
                              args.rounds * (args.timeout + 30))
        after = client.eval("barrier_calls()", 300)
        busiest = max(b - a for a, b in zip(before, after, strict=True)) / args.rounds
        steady = sorted(seconds[1:])
        print(json.dumps({
            "tasks": tasks, "hosts": args.hosts, "clusterwire": os.path.dirname(
                clusterwire.__file__), "first_ms": round(seconds[0] * 1e3, 1),
            "median_ms": round(statistics.median(steady) * 1e3, 1),
            "p90_ms": round(steady[int(0.9 * (len(steady) - 1))] * 1e3, 1),
            "max_ms": round(steady[-1] * 1e3, 1),
            "busiest_task_calls_per_round": busiest,
            "load": round(os.getloadavg()[0], 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
