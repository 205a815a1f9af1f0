"""A standby dispatcher's takeover as a client sees it (issue 33: gap < 5 s, nothing lost).

    python bench/bench_standby.py [--runs 5] [--count 2000] [--slow-ms 2] [--json]

A fault-tolerant primary dispatcher, a standby on the same work_dir and 2 workers given both
addresses run as processes of their own; this process reads a distributed_epoch job of
``range(count).map(pause)`` (``--slow-ms`` per element on a worker) through
``service="grpc://PRIMARY,STANDBY"`` and SIGKILLs the primary after a quarter of the
elements. Per run: the longest gap between two elements after the kill, the longest before
it (the steady reading's own), the time from the kill to the standby's ready line (it serves:
lease taken, journal replayed), how long a dispatcher request sent through both addresses at
the moment of the kill waited for its answer (what a client needing a split right then
waits: the worst case the read-ahead hides from the gap), whether
every element arrived exactly once, and the splits the standby handed out after the kill
(>0: the client did need the new dispatcher). Then the median and the worst over the runs.
Every process started here is stopped at the end, also on error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

from clusterwire import data
from clusterwire.data import worker_auth
from clusterwire.data.cli import await_ready
from clusterwire.testing.ports import free_ports

HERE = os.path.dirname(os.path.abspath(__file__))


@data.function
def pause(x):
    """x, after ``BENCH_STANDBY_SLOW_S`` seconds (a worker's per-element work)."""
    time.sleep(float(os.environ.get("BENCH_STANDBY_SLOW_S", "0.002")))
    return x


def _run(count: int, slow_s: float) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
           worker_auth.ENV: worker_auth.new_token().decode(), "BENCH_STANDBY_SLOW_S": str(slow_s)}
    work_dir = tempfile.mkdtemp(prefix="bench-standby-")
    ft = ["--fault-tolerant-mode", "--work-dir", work_dir, "--bind-address", "127.0.0.1",
          "--quiet"]
    processes: list[subprocess.Popen] = []

    def start(*args: str, ready: bool = True) -> str | None:
        processes.append(subprocess.Popen([sys.executable, "-m", "clusterwire", *args],
                                          stdout=subprocess.PIPE, text=True, env=env,
                                          stderr=subprocess.DEVNULL))
        if not ready:
            return None
        target = await_ready(processes[-1], 60.0)
        if target is None:
            raise RuntimeError(f"{args} did not start")
        return target

    try:
        primary = start("dispatcher", "--port", "0", *ft)
        [port] = free_ports(1)
        start("dispatcher", "--port", str(port), "--standby", *ft, ready=False)
        standby = processes[-1]
        both = f"{primary.split('://')[1]},127.0.0.1:{port}"
        for _ in range(2):
            start("worker", "--dispatcher-address", both, "--heartbeat-interval-ms", "200",
                  "--worker-address", "127.0.0.1:%port%", "--import", "bench_standby",
                  "--quiet")
        service = f"grpc://{both}"
        from bench_standby import pause as by_name  # as the workers import it, not __main__'s

        data.register_dataset(service, data.Dataset.range(count).map(by_name), dataset_id="d")
        seen, before, after, last, killed = Counter(), [0.0], [0.0], None, 0.0
        served: list[float] = []  # when the standby's ready line came
        watcher = threading.Thread(target=lambda: await_ready(standby, 60.0) and served.append(
            time.monotonic()), daemon=True)
        answered: list[float] = []  # when a request sent at the kill was answered
        asker = threading.Thread(target=lambda: data.service_status(service, timeout=60) and
                                 answered.append(time.monotonic()), daemon=True)
        for index, element in enumerate(data.from_dataset_id(
                "distributed_epoch", service, "d", job_name="bench")):
            now = time.monotonic()
            if last is not None:
                (after if killed else before).append(now - last)
            last = now
            seen[int(element)] += 1
            if index + 1 == count // 4:
                [job] = data.service_status(primary).jobs
                handed = job.splits_handed
                processes[0].kill()
                killed = time.monotonic()
                watcher.start()
                asker.start()
        watcher.join(60.0)
        asker.join(60.0)
        takeover_s = served[0] - killed if served else float("nan")
        request_s = answered[0] - killed if answered else float("nan")
        [job] = data.service_status(f"grpc://127.0.0.1:{port}").jobs
        return {"gap_after_kill_s": max(after), "gap_before_kill_s": max(before),
                "standby_serving_after_kill_s": takeover_s,
                "request_at_kill_answered_s": request_s,
                "exactly_once": seen == Counter(range(count)),
                "splits_handed_by_standby": job.splits_handed - handed,
                "splits": job.splits_handed}
    finally:
        for process in processes:
            process.kill()
            process.wait()
            if process.stdout:
                process.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--slow-ms", type=float, default=2.0)
    parser.add_argument("--json", action="store_true", help="one JSON line per run and summary")
    args = parser.parse_args()
    runs = []
    for index in range(args.runs):
        runs.append(_run(args.count, args.slow_ms / 1000))
        if args.json:
            print(json.dumps({"run": index, **runs[-1]}), flush=True)
        else:
            print(f"run {index}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in runs[-1].items()), flush=True)
    gaps = [r["gap_after_kill_s"] for r in runs]
    asked = [r["request_at_kill_answered_s"] for r in runs]
    summary = {"runs": len(runs), "gap_median_s": statistics.median(gaps),
               "gap_max_s": max(gaps), "request_at_kill_median_s": statistics.median(asked),
               "request_at_kill_max_s": max(asked),
               "steady_gap_max_s": max(r["gap_before_kill_s"] for r in runs),
               "all_exactly_once": all(r["exactly_once"] for r in runs),
               "load1": os.getloadavg()[0]}
    print(json.dumps(summary) if args.json else
          f"takeover gap: median {summary['gap_median_s']:.3f} s, worst "
          f"{summary['gap_max_s']:.3f} s over {len(runs)} runs (steady reading's worst "
          f"{summary['steady_gap_max_s']:.3f} s); a request sent at the kill answered after "
          f"{summary['request_at_kill_median_s']:.3f} s (median), "
          f"{summary['request_at_kill_max_s']:.3f} s (worst); every element exactly once: "
          f"{summary['all_exactly_once']}; load {summary['load1']:.1f}", flush=True)


if __name__ == "__main__":
    main()
