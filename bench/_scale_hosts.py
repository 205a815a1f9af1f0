"""``bench_scale.py --hosts H``: one job of n tasks spread over H emulated hosts, with SWIM.

Run as root from the repository root::

    nice -n 19 python bench/bench_scale.py --hosts 16 --tasks 1024 --json
    nice -n 19 python bench/bench_scale.py --hosts 4 --tasks 16 --false-down-seconds 10

H + 1 emulated hosts (``clusterwire.testing.hosts``): task i serves on host i % H at port
2222 + i // H (addresses known at start, as a Slurm or Kubernetes resolver gives them, so
no ``complete_cluster``), forked from its host's zygote, with the server config
``{"membership_protocol": "swim", "membership_heartbeat_seconds": --probe-interval}``; a
client interpreter on host H holds one ``Session`` per task. Measured, in this order:

- ``up_s``: from the first ``Host.serve`` (the zygotes' starts included; the hosts' start
  their tasks in parallel) until every task printed its ready line: serving, with the
  whole cluster it was given;
- ``idle_cpu_pct_per_task`` (mean; ``idle_cpu_pct_max``): after ``--settle`` s, the tasks'
  CPU time (utime + stime, /proc/PID/stat) over ``--idle-seconds`` s of no requests, as a
  share of one core; ``pss_mib_per_task``: the mean Pss (smaps_rollup) at its end of 64
  tasks evenly spread (all, up to 127 tasks), and ``threads_per_task``;
- ``barrier_ms``: ``--barrier-rounds`` rounds of ``barrier("b")`` of every task at once
  (a thread per task in the client, as bench_barrier_hosts.py): the first round and the
  median / max of the others ("steady"); and the busiest task's barrier calls a round;
- ``false_down``: while two CPU hogs run (as ``.ci/busy 2``) for ``--false-down-seconds``,
  the client asks every task's ``status()`` over and over (a pass: every task once, 32 at a
  time) and counts the tasks that any task's ``peers`` said were down (all are alive);
- ``down_detect_s``: every task of the last host SIGKILLed; the client polls the
  survivors' ``status()`` in passes (a task that marked all the killed down is not asked
  again) until each marks every killed task down; the time from the kill until the last
  survivor was seen doing so (an answer's arrival: the figure is late by at most one
  poll of that task, ``down_poll_pass_s`` says how long a pass took).

Prints one JSON line a task count (``--json``), or a Markdown table row. Progress, and the
machine's memory, threads and load every 30 s, go to stderr. Every process and namespace
is removed at the end, also on error, ``--run-timeout``, SIGTERM or when MemAvailable
falls below ``--min-free-mib`` (before the OOM killer would pick one of the machine's
other processes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench_hosts import pss_mib

from clusterwire.testing.hosts import EmulatedHosts, Served, netns_available

PORT = 2222
JOB = "w"
POLLERS = 32
#: Pss is read from about this many tasks, evenly spread (reading smaps_rollup walks a
#: process's page tables: on a saturated machine, minutes for hundreds of tasks).
PSS_SAMPLE = 64
#: How long one step waits: a task to serve, the client's set-up, a sweep of statuses.
START_TIMEOUT_S = 600.0
#: The two CPU hogs of the false-down window: .ci/busy's, ending once their parent is gone.
HOG = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""

CLIENT = """
import time, clusterwire
from concurrent.futures import ThreadPoolExecutor
from clusterwire import errors
to = [clusterwire.Session(t, timeout=STATUS_TIMEOUT) for t in TARGETS]
pool = ThreadPoolExecutor(POLLERS)
arrivals = None

def connect():
    return list(pool.map(lambda s: s.status()["task_index"], to))

def barrier_calls():
    return list(pool.map(lambda s: sum(
        m["value"] for m in s.status()["metrics"]
        if m["name"] == "clusterwire_requests_total"
        and m["labels"].get("method", "").startswith("barrier")), to))

def rounds(count, timeout):
    global arrivals
    arrivals = arrivals or ThreadPoolExecutor(len(to))
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        list(arrivals.map(lambda s: s.barrier("b", timeout=timeout), to))
        seconds.append(time.perf_counter() - started)
    return seconds

def down_of(index):
    try:
        peers = to[index].status()["peers"]
    except errors.OpError as err:
        return index, None, type(err).__name__
    return index, {p["task"] for p in peers if p["down"]}, None

def watch_false_down(seconds):
    marked, failures, passes = set(), {}, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for index, down, error in pool.map(down_of, range(len(to))):
            if error:
                failures[error] = failures.get(error, 0) + 1
            else:
                marked |= down
        passes += 1
    return sorted(marked), passes, failures

def watch_down(survivors, victims, deadline):
    victims, left, seen, passes = set(victims), set(survivors), {}, []
    failures = {}
    while left and time.monotonic() < deadline:
        started = time.monotonic()
        for index, down, error in pool.map(down_of, sorted(left)):
            if error:
                failures[error] = failures.get(error, 0) + 1
            elif victims <= down:
                seen[index] = time.monotonic()
                left.discard(index)
        passes.append(time.monotonic() - started)
    return seen, sorted(left), passes, failures
"""


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


class TimedOut(BaseException):
    """SIGTERM or SIGALRM: the run ends, and the test bed is removed on the way out (a
    BaseException, so that no measure's ``except Exception`` takes it for its failure)."""


def _raise(signum: int, _frame: Any) -> None:
    raise TimedOut(f"signal {signal.Signals(signum).name}")


#: The machine's state is logged this often (memory, threads, load, tasks started).
WATCH_LOG_S = 30.0
_bed: list[EmulatedHosts] = []  # the test bed of the run under way, for the watch's log


def _watch_machine(min_free_mib: float, step: Callable[[str], None]) -> None:
    """End the run (SIGTERM to this process: the test bed is removed) if the machine's
    available memory falls below ``min_free_mib``, before its OOM killer picks a victim;
    log the machine's state every WATCH_LOG_S."""
    logged = time.monotonic()
    while True:
        free = mem_available_mib()
        if free < min_free_mib:
            step(f"MemAvailable {free:.0f} MiB < --min-free-mib {min_free_mib:g}: ending the run")
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if time.monotonic() - logged > WATCH_LOG_S:
            logged = time.monotonic()
            with open("/proc/loadavg") as loadavg:
                load = loadavg.read().split()
            started = len(_bed[-1].tasks) if _bed else 0
            step(f"machine: MemAvailable {free:.0f} MiB, threads running/all {load[3]}, "
                 f"load {load[0]}; {started} tasks started")
        time.sleep(0.5)


def _task_args(cluster: str, index: int, config: str) -> list[str]:
    return ["serve", "--cluster", cluster, "--job-name", JOB, "--task-index", str(index),
            "--config", config]


def mem_available_mib() -> float:
    """The machine's MemAvailable (/proc/meminfo), in MiB."""
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) for line in meminfo
                    if line.startswith("MemAvailable:")) / 1024


def start_tasks(bed: EmulatedHosts, hosts: int, tasks: int, config: str,
                env: dict[str, str]) -> list[Served]:
    """Every task started (each host forks its own, the hosts in parallel) and serving."""
    layout = [f"{bed[i % hosts].address}:{PORT + i // hosts}" for i in range(tasks)]
    cluster = json.dumps({JOB: layout})
    abandoned = threading.Event()

    def serve(host: int, index: int) -> Served:
        if abandoned.is_set():
            raise TimedOut("the start-up was abandoned")
        return bed[host].serve(*_task_args(cluster, index, config), env=env)

    def host_tasks(host: int) -> list[tuple[int, Served]]:
        started = [(i, serve(host, i)) for i in range(host, tasks, hosts)]
        for _, served in started:
            served.wait_ready(START_TIMEOUT_S)
        return started

    # Not a with-block: on an error or a timeout the hosts' threads, still forking and
    # waiting, are left to end once the tasks are killed, not waited for.
    pool = ThreadPoolExecutor(hosts)
    try:
        by_index = dict(pair for started in pool.map(host_tasks, range(hosts))
                        for pair in started)
    except BaseException:
        abandoned.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return [by_index[i] for i in range(tasks)]


def idle_cost(pids: list[int], seconds: float) -> dict[str, float]:
    """The tasks' CPU over ``seconds`` idle (% of a core each) and their Pss and threads."""
    before = {pid: cpu_seconds(pid) for pid in pids}
    started = time.monotonic()
    time.sleep(seconds)  # the idle window measured
    elapsed = time.monotonic() - started
    cpu = [100 * (cpu_seconds(pid) - before[pid]) / elapsed for pid in pids]
    threads = []
    for pid in pids:
        with open(f"/proc/{pid}/status") as status:
            threads.append(next(int(line.split()[1]) for line in status
                                if line.startswith("Threads:")))
    return {"idle_cpu_pct_per_task": round(statistics.fmean(cpu), 4),
            "idle_cpu_pct_max": round(max(cpu), 4), "idle_s": round(elapsed, 1),
            "pss_mib_per_task": round(statistics.fmean(
                pss_mib(pid) for pid in pids[::max(1, len(pids) // PSS_SAMPLE)]), 2),
            "threads_per_task": round(statistics.fmean(threads), 1)}


@contextlib.contextmanager
def _killing_tasks(bed: EmulatedHosts) -> Iterator[None]:
    """SIGKILL every task from here on the way out, before the test bed's teardown: its
    zygotes, one host after another, would each have to be scheduled first to kill theirs."""
    try:
        yield
    finally:
        for task in bed.tasks:
            task.kill()


def measure(args: argparse.Namespace, tasks: int, step: Callable[[str], None]) -> dict:
    """One run of ``tasks`` tasks over ``args.hosts`` hosts; the JSON line's fields."""
    hosts = args.hosts
    config = json.dumps({"membership_protocol": "swim",
                         "membership_heartbeat_seconds": args.probe_interval})
    env = dict(os.environ)
    result: dict[str, Any] = {"tasks": tasks, "hosts": hosts,
                              "probe_interval_s": args.probe_interval,
                              "load_start": round(os.getloadavg()[0], 1)}
    with EmulatedHosts(hosts + 1) as bed, _killing_tasks(bed):
        _bed.append(bed)
        step(f"n={tasks}: starting {tasks} tasks on {hosts} hosts")
        began = time.perf_counter()
        result["mem_available_mib_before"] = round(mem_available_mib())
        served = start_tasks(bed, hosts, tasks, config, env)
        result["mem_available_mib_up"] = round(mem_available_mib())
        result["up_s"] = round(time.perf_counter() - began, 2)
        step(f"n={tasks}: up in {result['up_s']} s; settling {args.settle:g} s, then idle "
             f"{args.idle_seconds:g} s")
        time.sleep(args.settle)  # SWIM's first rounds and the start's work done
        result.update(idle_cost([s.process.pid for s in served], args.idle_seconds))
        result["load_idle"] = round(os.getloadavg()[0], 1)
        step(f"n={tasks}: idle {result['idle_cpu_pct_per_task']}% of a core a task, Pss "
             f"{result['pss_mib_per_task']} MiB, load {result['load_idle']}")

        client = bed[hosts].interpreter(env)
        client.exec(CLIENT.replace("TARGETS", repr([s.target for s in served]))
                    .replace("POLLERS", str(POLLERS))
                    .replace("STATUS_TIMEOUT", repr(args.status_timeout)), START_TIMEOUT_S)
        if client.eval("connect()", START_TIMEOUT_S) != list(range(tasks)):
            raise RuntimeError("a task answered as another task")
        step(f"n={tasks}: {args.barrier_rounds} barrier rounds")
        result.update(barrier(client, args))
        step(f"n={tasks}: barrier {result['barrier_ms'] or result.get('barrier_error')}")
        step(f"n={tasks}: {args.false_down_seconds:g} s beside two CPU hogs")
        result.update(false_down(client, args.false_down_seconds))
        step(f"n={tasks}: {result['false_down']} marked down falsely in "
             f"{result['false_down_passes']} passes, load {result['load_hogs']}")
        victims = list(range(hosts - 1, tasks, hosts))
        step(f"n={tasks}: SIGKILL the {len(victims)} tasks of host {hosts - 1}")
        result.update(down_detect(client, served, victims, args.down_timeout))
    result["load_end"] = round(os.getloadavg()[0], 1)
    return result


def barrier(client: Any, args: argparse.Namespace) -> dict[str, Any]:
    before = client.eval("barrier_calls()", START_TIMEOUT_S)
    try:
        seconds = client.eval(f"rounds({args.barrier_rounds}, {args.barrier_timeout})",
                              args.barrier_rounds * (args.barrier_timeout + 30))
    except Exception as err:  # noqa: BLE001 - reported in the line; the other measures go on
        return {"barrier_ms": None, "barrier_error": f"{type(err).__name__}: {err}"[:300]}
    after = client.eval("barrier_calls()", START_TIMEOUT_S)
    steady = seconds[1:]
    return {"barrier_ms": {"first": round(seconds[0] * 1e3, 1),
                           "steady": round(statistics.median(steady) * 1e3, 1),
                           "max": round(max(steady) * 1e3, 1), "rounds": len(seconds)},
            "barrier_busiest_calls_per_round": max(
                b - a for a, b in zip(before, after, strict=True)) / len(seconds)}


def false_down(client: Any, seconds: float) -> dict[str, Any]:
    hogs = [subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.DEVNULL)
            for _ in range(2)]
    try:
        marked, passes, failures = client.eval(f"watch_false_down({seconds})",
                                               seconds + START_TIMEOUT_S)
        load = os.getloadavg()[0]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    return {"false_down": len(marked), "false_down_tasks": marked[:10],
            "false_down_passes": passes, "false_down_status_failures": failures,
            "load_hogs": round(load, 1)}


def down_detect(client: Any, served: list[Served], victims: list[int],
                timeout: float) -> dict[str, Any]:
    survivors = [i for i in range(len(served)) if i not in set(victims)]
    names = [f"/job:{JOB}/task:{i}" for i in victims]
    for index in victims:
        served[index].process.kill()
    killed = time.monotonic()  # one clock for every process of the machine
    seen, left, passes, failures = client.eval(
        f"watch_down({survivors!r}, {names!r}, {killed + timeout!r})", timeout + 120)
    delays = sorted(at - killed for at in seen.values())
    return {"down_detect_s": round(delays[-1], 2) if not left and delays else None,
            "down_detect_median_s": round(statistics.median(delays), 2) if delays else None,
            "down_not_seen": len(left), "down_poll_passes": len(passes),
            "down_poll_pass_s": round(statistics.median(passes), 2) if passes else None,
            "down_status_failures": failures, "killed": len(victims)}


def main(args: argparse.Namespace, step: Callable[[str], None]) -> int:
    """Run every task count of ``args.tasks``; one JSON line (or table row) each."""
    available, reason = netns_available()
    if not available:
        print(f"bench_scale --hosts: {reason}", file=sys.stderr)
        return 2
    for tasks in args.tasks:
        if tasks < 2 * args.hosts:
            print(f"bench_scale --hosts {args.hosts}: --tasks {tasks} leaves a host with "
                  "fewer than 2 tasks; give at least twice as many tasks as hosts",
                  file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGALRM, _raise)
    threading.Thread(target=_watch_machine, args=(args.min_free_mib, step), daemon=True,
                     name="bench-memory-watch").start()
    for tasks in args.tasks:
        signal.alarm(int(args.run_timeout))
        try:
            result = measure(args, tasks, step)
        except TimedOut as err:
            step(f"n={tasks}: ended by {err} (--run-timeout {args.run_timeout:g} s, or "
                 "--min-free-mib); every task and namespace removed")
            return 1
        finally:
            signal.alarm(0)
        line = json.dumps(result)
        if args.json:
            print(line, flush=True)
            if isinstance(args.json, str):
                with open(args.json, "a", encoding="utf-8") as out:
                    out.write(line + "\n")
        else:
            print(row(result), flush=True)
    return 0


def row(r: dict[str, Any]) -> str:
    """The run as a row of BENCHMARKS.md's "16 emulated hosts" table, from its n column."""
    b = r["barrier_ms"]
    barrier = (f"{b['first']} / {b['steady']}; {r['barrier_busiest_calls_per_round']:g}"
               if b else r["barrier_error"][:80])
    down = (f"{r['killed']} killed: {r['down_detect_s']} ({r['down_detect_median_s']})"
            if r["down_detect_s"] is not None else
            f"{r['killed']} killed: {r['down_not_seen']} survivors did not see it")
    return (f"| {r['tasks']} ({r['hosts']}) | {r['up_s']} | {barrier} | {down} | "
            f"{r['false_down']} ({r['false_down_passes']}) | {r['idle_cpu_pct_per_task']} "
            f"({r['idle_cpu_pct_max']}) | {r['pss_mib_per_task']} | {r['threads_per_task']} | "
            f"{r['load_start']} / {r['load_idle']} / {r['load_hogs']} / {r['load_end']} |")
