"""What an idle cluster costs: each task's CPU and memory while nothing is asked of it.

Run from the repository root::

    python bench/bench_idle.py                      # 16 and 64 tasks, 60 s each
    python bench/bench_idle.py --tasks 256 --seconds 120

For each size, a ``LocalCluster`` of that many task processes (one job) starts, settles
(``--settle`` s), then idles ``--seconds`` s: each task's CPU time (user + system, from
``/proc/PID/stat``) over the idle window, as a share of one core, and its resident memory
(``VmRSS``) at the start and end of the window. Measured twice per size: with the default
configuration (membership heartbeats off) and with heartbeats every ``--heartbeat`` s (each
task then calls every peer each interval: O(n) per task, what issue 33's SWIM replaces).
CPU time is what the processes used, so other load on the machine changes it little.
Target (issue 33): < 0.2% of a core per task, memory flat (the growth printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from clusterwire.local_cluster import LocalCluster

TARGET_CPU_PERCENT = 0.2
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def measure(tasks: int, seconds: float, settle: float, heartbeat: float | None
            ) -> dict[str, float]:
    config = None if heartbeat is None else {
        "membership_heartbeat_seconds": heartbeat,
        "membership_timeout_seconds": 3 * heartbeat}
    with LocalCluster({"worker": tasks}, config=config, start_timeout=300) as cluster:
        pids = [cluster.process("worker", index).pid for index in range(tasks)]
        time.sleep(settle)  # the start's work done: connections made, heartbeats begun
        cpu_before = {pid: cpu_seconds(pid) for pid in pids}
        rss_before = {pid: rss_kib(pid) for pid in pids}
        started = time.monotonic()
        time.sleep(seconds)  # the idle window measured
        elapsed = time.monotonic() - started
        cpu = [100 * (cpu_seconds(pid) - cpu_before[pid]) / elapsed for pid in pids]
        growth = [rss_kib(pid) - rss_before[pid] for pid in pids]
    return {"cpu_median": statistics.median(cpu), "cpu_max": max(cpu),
            "rss_growth_max": max(growth), "rss_growth_median": statistics.median(growth),
            "rss_start_median": statistics.median(rss_before.values()), "elapsed": elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--heartbeat", type=float, default=1.0)
    args = parser.parse_args()
    print(f"idle {args.seconds:g} s after {args.settle:g} s to settle; load average "
          f"{os.getloadavg()[0]:.1f} at the start; {os.cpu_count()} cpus\n")
    print("| tasks | heartbeats | CPU % of a core per task (median / max) | RSS at start "
          "(median) | RSS growth over the window (median / max) | target < "
          f"{TARGET_CPU_PERCENT}% |\n|---:|---|---:|---:|---:|---|")
    for tasks in args.tasks:
        for heartbeat in (None, args.heartbeat):
            result = measure(tasks, args.seconds, args.settle, heartbeat)
            met = "met" if result["cpu_max"] < TARGET_CPU_PERCENT else "**not met**"
            print(f"| {tasks} | {'off' if heartbeat is None else f'every {heartbeat:g} s'} | "
                  f"{result['cpu_median']:.3f} / {result['cpu_max']:.3f} | "
                  f"{result['rss_start_median'] / 1024:.1f} MiB | "
                  f"{result['rss_growth_median']:+.0f} / {result['rss_growth_max']:+.0f} KiB | "
                  f"{met} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
