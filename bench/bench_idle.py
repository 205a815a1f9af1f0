"""What an idle cluster costs: each task's CPU and memory while nothing is asked of it.

Run from the repository root::

    python bench/bench_idle.py                                  # 8 tasks, 60 s each way
    python bench/bench_idle.py --membership swim --seconds 300  # memory over 5 minutes
    python bench/bench_idle.py --membership swim --threads      # where the CPU goes
    python bench/bench_idle.py --tree /tmp/before --tree installed --rounds 3  # A/B

For each size and membership, a ``LocalCluster`` of that many task processes (one job)
starts, settles (``--settle`` s), then idles ``--seconds`` s. Membership: ``off`` (the
default configuration), ``heartbeats`` (every ``--interval`` s: each task calls every peer
each interval) or ``swim`` (``membership_protocol="swim"``, one probe a task every
``--interval`` s). Each task's CPU time over the idle window is its threads' run time from
``/proc/PID/task/*/schedstat`` (nanoseconds; ``/proc/PID/stat``'s ticks are too coarse for a
0.2% target), as a share of one core, with its threads' wake-ups (runs) a second; its
``VmRSS`` is sampled every ``--sample`` s and the slope fitted by least squares (KiB a
minute: flat memory is a slope near 0, whatever the start). With ``--tree`` the tasks run
the clusterwire of each given source tree (a ``clusterwire`` package directory's parent,
put first on the tasks' ``PYTHONPATH``; ``installed``: the one this Python imports), round
by round in turn. ``--threads`` adds each kind of thread's share (by ``/proc`` thread name;
Python threads by their ``threading`` name when ``py-spy`` is installed). CPU time is what
the processes used, so other load on the machine changes it little. Target (issue 33):
< 0.2% of a core per task, memory flat.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

from clusterwire.local_cluster import LocalCluster

TARGET_CPU_PERCENT = 0.2
MEMBERSHIPS = ("off", "heartbeats", "swim")


def thread_times(pid: int) -> dict[int, tuple[int, int]]:
    """Thread id -> (run time in ns, runs) of every thread of process ``pid``."""
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                run_ns, _waited, runs = map(int, stat.read().split())
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        times[int(tid)] = (run_ns, runs)
    return times


def thread_names(pid: int) -> dict[int, str]:
    """Thread id -> a name for the kind of thread (numbers dropped, so pools add up)."""
    names = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                names[int(tid)] = comm.read().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
    if shutil.which("py-spy"):
        dump = subprocess.run(["py-spy", "dump", "--nonblocking", "--pid", str(pid)],
                              capture_output=True, text=True, check=False).stdout
        for tid, name in re.findall(r'Thread (\d+) \(\w+\): "([^"]*)"', dump):
            names[int(tid)] = name
    return {tid: re.sub(r"[-_]\d+$", "", name) for tid, name in names.items()}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def slope_per_minute(samples: list[tuple[float, int]]) -> float:
    """The least-squares slope of (seconds, KiB) samples, in KiB a minute."""
    mean_t = statistics.fmean(t for t, _ in samples)
    mean_v = statistics.fmean(v for _, v in samples)
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in samples) / spread


def config_of(membership: str, interval: float) -> dict | None:
    if membership == "heartbeats":
        return {"membership_heartbeat_seconds": interval,
                "membership_timeout_seconds": 3 * interval}
    if membership == "swim":
        return {"membership_protocol": "swim", "membership_heartbeat_seconds": interval}
    return None


def measure(tasks: int, membership: str, args: argparse.Namespace, tree: str | None
            ) -> dict:
    env = None if tree in (None, "installed") else {
        "PYTHONPATH": os.pathsep.join(filter(None, [os.path.abspath(tree),
                                                    os.environ.get("PYTHONPATH")]))}
    with LocalCluster({"worker": tasks}, config=config_of(membership, args.interval),
                      env=env, start_timeout=300) as cluster:
        pids = [cluster.process("worker", index).pid for index in range(tasks)]
        time.sleep(args.settle)  # the start's work done: connections made, rounds begun
        before = {pid: thread_times(pid) for pid in pids}
        rss = {pid: [] for pid in pids}
        started = time.monotonic()
        while True:
            now = time.monotonic() - started
            for pid in pids:
                rss[pid].append((now, rss_kib(pid)))
            if now >= args.seconds:
                break
            time.sleep(min(args.sample, args.seconds - now))
        elapsed = time.monotonic() - started
        after = {pid: thread_times(pid) for pid in pids}
        names = {pid: thread_names(pid) for pid in pids} if args.threads else {}
    cpu, runs, kinds, kind_runs = [], [], collections.Counter(), collections.Counter()
    for pid in pids:
        spent = woke = 0
        for tid, (run_ns, count) in after[pid].items():
            run_before, count_before = before[pid].get(tid, (0, 0))
            spent += run_ns - run_before
            woke += count - count_before
            if args.threads:
                kind = names[pid].get(tid, "?")
                kinds[kind] += run_ns - run_before
                kind_runs[kind] += count - count_before
        cpu.append(100 * spent / 1e9 / elapsed)
        runs.append(woke / elapsed)
    slopes = [slope_per_minute(samples) for samples in rss.values()]
    return {"cpu": cpu, "runs": runs, "slopes": slopes,
            "growth": [samples[-1][1] - samples[0][1] for samples in rss.values()],
            "rss_start": statistics.median(samples[0][1] for samples in rss.values()),
            "kinds": {kind: (100 * ns / 1e9 / elapsed / tasks, kind_runs[kind] / elapsed / tasks)
                      for kind, ns in kinds.most_common()},
            "load": os.getloadavg()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[8])
    parser.add_argument("--membership", nargs="+", choices=MEMBERSHIPS,
                        default=list(MEMBERSHIPS))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=1.0,
                        help="membership heartbeat or SWIM probe interval, seconds")
    parser.add_argument("--sample", type=float, default=10.0,
                        help="seconds between RSS samples")
    parser.add_argument("--tree", action="append",
                        help="a source tree whose clusterwire the tasks run, or 'installed' (the "
                        "default); repeat for A/B")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", action="store_true",
                        help="print each kind of thread's share of the CPU")
    args = parser.parse_args()
    print(f"idle {args.seconds:g} s after {args.settle:g} s to settle; load average "
          f"{os.getloadavg()[0]:.1f} at the start; {os.cpu_count()} cpus\n")
    print("| tree | tasks | membership | CPU % of a core per task (median / max) | runs/s "
          "per task | RSS at start (median) | RSS slope, KiB/min (median / max) | RSS growth "
          f"(median / max) | load | target < {TARGET_CPU_PERCENT}% |\n"
          "|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for _round in range(args.rounds):
        for tasks in args.tasks:
            for membership in args.membership:
                for tree in args.tree or [None]:
                    result = measure(tasks, membership, args, tree)
                    cpu = result["cpu"]
                    met = "met" if max(cpu) < TARGET_CPU_PERCENT else "**not met**"
                    print(f"| {tree or 'installed'} | {tasks} | {membership} | "
                          f"{statistics.median(cpu):.3f} / {max(cpu):.3f} | "
                          f"{statistics.median(result['runs']):.1f} | "
                          f"{result['rss_start'] / 1024:.1f} MiB | "
                          f"{statistics.median(result['slopes']):+.1f} / "
                          f"{max(result['slopes'], key=abs):+.1f} | "
                          f"{statistics.median(result['growth']):+.0f} / "
                          f"{max(result['growth'], key=abs):+.0f} KiB | "
                          f"{result['load']:.1f} | {met} |", flush=True)
                    for kind, (share, woke) in result["kinds"].items():
                        print(f"|   | | {kind} | {share:.4f} | {woke:.1f} | | | | | |")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
