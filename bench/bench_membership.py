"""What changing membership costs and how fast it spreads, on 16-task clusters of processes.

Run from the repository root::

    python bench/bench_membership.py

Measured in one run (``--tasks`` task processes a cluster, heartbeats every
``--heartbeat`` s, a peer down after 3 heartbeats unheard):

1. Convergence: a 17th task process starts, ``Session.update_cluster`` tells task 0, and
   every task's status is polled until all report the new version (the time from the
   update call to the last one seen).
2. Requests during the change: a client puts and gets through task 0 to the other tasks
   the whole time; the failures are counted and every acknowledged put is read back after.
3. Failure detection: one task is SIGKILLed; the time until task 0's status says it is down.
4. Steady-state cost: 8-byte ``Session.get`` round trips to a task of the heartbeating
   cluster and to a task of a second cluster of as many tasks without heartbeats,
   interleaved (target: at most 3% slower).

The Markdown report is printed and written to bench/results/membership-<time>.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _machine import cpu_model  # noqa: E402
from bench_session import interleaved_round_trips  # noqa: E402

import clusterwire  # noqa: E402
from clusterwire import errors  # noqa: E402
from clusterwire.local_cluster import LocalCluster, await_ready  # noqa: E402

TARGETS = {"converge_s": 2.0, "lost": 0, "steady": 0.03}


def _versions(sessions: list[clusterwire.Session], pool: ThreadPoolExecutor) -> list[int]:
    def version(session: clusterwire.Session) -> int:
        try:
            return session.status(timeout=2)["membership_version"]
        except errors.OpError:
            return -1
    return list(pool.map(version, sessions))


class Traffic:
    """Puts and gets through one task to the others until stopped; what was acknowledged."""

    def __init__(self, target: str, tasks: list[int]):
        self.session = clusterwire.Session(target, timeout=5)
        self.tasks, self.acknowledged, self.failures = tasks, {}, []
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        step = 0
        while not self._stop.is_set():
            task = f"/job:w/task:{self.tasks[step % len(self.tasks)]}"
            name = f"t{step}"
            try:
                self.session.put(name, np.array([step]), task=task)
                self.acknowledged[name] = (task, step)
                self.session.get(name, task=task)
            except errors.OpError as err:
                self.failures.append(f"{type(err).__name__}: {err.message[:120]}")
            self.requests += 2
            step += 1

    def stop(self) -> list[str]:
        """Stop; the acknowledged puts that cannot be read back (lost)."""
        self._stop.set()
        self._thread.join()
        lost = []
        for name, (task, step) in self.acknowledged.items():
            try:
                if int(self.session.get(name, task=task)[0]) != step:
                    lost.append(name)
            except errors.OpError:
                lost.append(name)
        return lost


def measure(args: argparse.Namespace) -> dict:
    heartbeat = {"membership_heartbeat_seconds": args.heartbeat}
    results: dict = {}
    with LocalCluster({"w": args.tasks}, config=heartbeat) as cluster, \
            LocalCluster({"w": args.tasks}) as quiet, \
            ThreadPoolExecutor(args.tasks + 1) as pool:
        addresses = [cluster.target("w", i).split("://")[1] for i in range(args.tasks)]
        newcomer = subprocess.Popen(
            [sys.executable, "-m", "clusterwire", "serve", "--quiet", "--cluster",
             json.dumps({"w": [*addresses, "127.0.0.1:0"]}), "--job-name", "w",
             "--task-index", str(args.tasks), "--config", json.dumps(heartbeat)],
            stdout=subprocess.PIPE, text=True)
        try:
            target = await_ready(newcomer, 30)
            if target is None:
                raise RuntimeError("the 17th task did not start")
            sessions = [clusterwire.Session(cluster.target("w", i))
                        for i in range(args.tasks)] + [clusterwire.Session(target)]
            time.sleep(2 * args.heartbeat)  # a steady state before the change
            traffic = Traffic(cluster.target("w", 0), list(range(1, args.tasks)))
            before = _versions(sessions[:-1], pool)[0]
            started = time.monotonic()
            version = sessions[0].update_cluster({"w": [*addresses, target.split("://")[1]]})
            while set(_versions(sessions, pool)) != {version}:
                if time.monotonic() - started > 30:
                    raise RuntimeError("no convergence within 30 s")
            results["converge_s"] = time.monotonic() - started
            results["versions"] = (before, version)
            time.sleep(args.heartbeat)  # traffic after the change too
            lost = traffic.stop()
            results.update(requests=traffic.requests, failures=traffic.failures, lost=lost)

            killed = args.tasks - 1
            cluster.process("w", killed).kill()
            killed_at = time.monotonic()
            name = f"/job:w/task:{killed}"
            while not any(p["task"] == name and p["down"]
                          for p in sessions[0].status()["peers"]):
                if time.monotonic() - killed_at > 30:
                    raise RuntimeError("the killed task was not marked down within 30 s")
                time.sleep(0.01)  # polling a status
            results["detect_s"] = time.monotonic() - killed_at

            loud = clusterwire.Session(cluster.target("w", 1))
            silent = clusterwire.Session(quiet.target("w", 1))
            for session in (loud, silent):
                session.put("x", np.arange(1, dtype=np.int64))
            samples = interleaved_round_trips(
                {"heartbeats": lambda: loud.get("x"), "none": lambda: silent.get("x")},
                args.iterations, args.iterations // 10, args.rounds)
            results["get_us"] = {k: statistics.median(v) / 1e3 for k, v in samples.items()}
        finally:
            newcomer.kill()
            newcomer.wait()
    return results


def render(args: argparse.Namespace, r: dict, seconds: float) -> str:
    heartbeats, none = r["get_us"]["heartbeats"], r["get_us"]["none"]
    steady = heartbeats / none - 1
    lines = [
        f"# Membership ({datetime.datetime.now():%Y-%m-%d %H:%M})", "",
        f"Machine: {cpu_model()}, {os.cpu_count()} CPUs. Command: `python "
        f"bench/bench_membership.py {' '.join(sys.argv[1:])}`. {seconds:.0f} s. Clusters of "
        f"{args.tasks} task processes, heartbeat {args.heartbeat:g} s.", "",
        "| Measure | Value | Target | Verdict |", "|---|---|---|---|",
        f"| Convergence of {args.tasks + 1} tasks on a new version (update to the last "
        f"task seen at it; versions {r['versions'][0]} -> {r['versions'][1]}) | "
        f"{r['converge_s']:.3f} s | < {TARGETS['converge_s']:g} s | "
        f"{'met' if r['converge_s'] < TARGETS['converge_s'] else 'NOT met'} |",
        f"| Acknowledged puts lost across the change ({r['requests']} requests, "
        f"{len(r['failures'])} failed) | {len(r['lost'])} | {TARGETS['lost']} | "
        f"{'met' if not r['lost'] else 'NOT met'} |",
        f"| A SIGKILLed task marked down (timeout {3 * args.heartbeat:g} s) | "
        f"{r['detect_s']:.2f} s | - | - |",
        f"| 8 B get, heartbeating cluster / one without ({heartbeats:.1f} / {none:.1f} us) | "
        f"{steady:+.1%} | <= +3% | {'met' if steady <= TARGETS['steady'] else 'NOT met'} |",
    ]
    if r["failures"]:
        lines += ["", "Failed requests: " + "; ".join(sorted(set(r["failures"])))[:600]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--heartbeat", type=float, default=1.0)
    parser.add_argument("--iterations", type=int, default=4000, help="timed gets a side")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    started = time.monotonic()
    text = render(args, measure(args), time.monotonic() - started)
    print(text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    name = f"membership-{datetime.datetime.now():%Y%m%d-%H%M%S}.md"
    with open(os.path.join(HERE, "results", name), "w") as out:
        out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
