"""How clusterwire scales with the number of tasks on one machine, and the data service with
many workers and consumers.

Run from the repository root::

    python bench/bench_scale.py                  # n = 4, 16, 64 tasks; about 3 minutes on 2 cores
    python bench/bench_scale.py --quick          # n = 4, 16; a smoke run (under a minute)
    python bench/bench_scale.py --tasks 4,8,32 --json scale.json
    python bench/bench_scale.py --tasks 64,256 --barrier-only   # cluster-up and barrier only
    nice -n 19 python bench/bench_scale.py --hosts 16 --tasks 1024 --json   # as root

``--hosts H`` runs one job over H emulated hosts with SWIM membership instead (start-up,
idle cost, barrier, false downs beside CPU hogs, a killed host's detection): see
bench/_scale_hosts.py, which runs it. What follows is the one-host mode.

For every n of ``--tasks`` (one job "worker" of n tasks, each its own process on 127.0.0.1,
grpc) it measures:

1. cluster-up: wall time of ``LocalCluster({"worker": n})`` until the constructor returns
   (every task printed its ready line and was told the completed cluster);
   ``--repeats`` start-ups (median, max), and the time ``close()`` takes. This process
   imports grpc before the first start-up, so no run pays the client side's import; each
   pays whatever LocalCluster does to start its tasks. The last start-up's cluster is kept
   for 2-4.
2. barrier latency: n client threads, one ``Session`` per task (connected before timing),
   released together by a ``threading.Barrier``, each calls ``session.barrier("b")``; a
   round's latency is from the release until the last call returns. ``--barrier-rounds``
   rounds reuse the name (each release starts a new round); the first round (which also
   pays each Session's one-time route set-up), then median, p90, max of the others. A round in
   which any arrival fails (e.g. DeadlineExceededError after ``--barrier-timeout``) ends
   the barrier measure of that n: it is reported as "never (timed out)". Also the busiest
   task's barrier requests per round (``clusterwire_requests_total`` of the barrier methods,
   read from every task before and after the rounds).
3. status fan-out: the time for one client to have ``status()`` of every task: sequential
   (one Session per task, one call after another), concurrent (a pool of
   ``min(n, --status-threads)`` threads over the same Sessions) and, where ``Session`` has
   it, ``cluster_status()`` through task 0 (which forwards to every task). The variants run
   in ``--status-rounds`` interleaved rounds; median and max.
4. idle memory: after ``--idle-seconds`` without requests, Rss, Pss and USS (private
   pages) of every task from /proc/PID/smaps_rollup, mean and max in MiB, and the threads
   of each task; next to two baseline processes started while the cluster is up (so they
   share pages with the tasks alike): ``python -c`` with nothing imported, and with
   ``import grpc, numpy``; and the tasks' parent process if it is not this one (a launcher
   that forks the tasks). Pss splits a page shared by k processes into k parts, so a
   task's Pss falls as n grows; the cluster's total Pss is what n tasks cost together.

Then the data service: a dispatcher and ``--data-workers`` (8) workers as processes
(``python -m clusterwire dispatcher|worker``, as bench_data.py starts them) and
``--data-consumers`` (8) consumer processes (this script, ``--role consumer``) reading one
shared job of ``Dataset.range(--data-elements)`` (int64 scalars): "distributed_epoch" with
a shared ``job_name`` (every element read once in total) and "parallel_epochs" with a shared
``job_name`` (every worker produces the whole range, the consumers share each worker's
stream: every element read once per worker in total). The consumers import and register
first, then start at one signal; total el/s is all elements over (last end - signal),
per-consumer el/s its own elements over its own time. Every element received is checked:
the multiset of all consumers' elements must be the expected one (nothing lost or repeated).

Growth per task: for each measure, (v(n_max) - v(n_min)) / (n_max - n_min), and the
least-squares slope over every n measured.

The Markdown report is printed and written to bench/results/scale-<time>.md (``--output``);
``--json PATH`` also writes every sample. Progress goes to stderr. Every process started
here is stopped at the end, also on error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from _machine import cpu_model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 1 << 20
BASELINES = {
    "python, nothing imported": "import sys, time",
    "python + import grpc, numpy": "import sys, time, grpc, numpy",
}
DATA_MODES = ("distributed_epoch", "parallel_epochs")


# ----------------------------------------------------------------------------- small helpers


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def slope(points: dict[int, float]) -> tuple[float, float]:
    """(endpoint slope, least-squares slope) of value per task over ``points`` {n: value}."""
    points = {n: v for n, v in points.items() if v is not None and v == v}
    if len(points) < 2:
        return float("nan"), float("nan")
    ns = sorted(points)
    endpoint = (points[ns[-1]] - points[ns[0]]) / (ns[-1] - ns[0])
    fit = float(np.polyfit(ns, [points[n] for n in ns], 1)[0])
    return endpoint, fit


def read_smaps(pid: int) -> dict[str, float]:
    """Rss, Pss, USS (Private_Clean + Private_Dirty) in MiB and the thread count of ``pid``."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    threads = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
    return {"rss": fields["Rss"] / 1024, "pss": fields["Pss"] / 1024,
            "uss": (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024,
            "threads": threads}


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; reap and close its pipes."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


# ----------------------------------------------------------------------------- tasks


def cluster_up(n: int) -> tuple[Any, float]:
    """A started ``LocalCluster({"worker": n})`` and the seconds its constructor took."""
    from clusterwire.local_cluster import LocalCluster

    started = time.perf_counter()
    cluster = LocalCluster({"worker": n}, start_timeout=120.0)
    return cluster, time.perf_counter() - started


def closed(cluster: Any) -> float:
    started = time.perf_counter()
    cluster.close()
    return time.perf_counter() - started


def barrier_rounds(sessions: list, rounds: int, timeout: float) -> dict[str, Any]:
    """Latencies (s) of ``rounds`` barrier rounds of every session's task at once.

    Stops at the first round in which an arrival fails; the failure is reported.
    """
    from clusterwire import errors

    n = len(sessions)
    starts: list[float] = []
    ends = [[0.0] * n for _ in range(rounds)]
    failures: list[str] = []
    failed_rounds: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()
    gate = threading.Barrier(n, action=lambda: starts.append(time.perf_counter()))

    def arrive(index: int) -> None:
        session = sessions[index]
        for round_index in range(rounds):
            try:
                gate.wait(timeout + 60.0)  # every arrival of the round before returned
            except threading.BrokenBarrierError:
                return
            if stop.is_set():
                return
            try:
                session.barrier("b", timeout=timeout)
                ends[round_index][index] = time.perf_counter()
            except Exception as err:  # noqa: BLE001 - reported, and ends the measure
                kind = ("DeadlineExceededError" if isinstance(err, errors.DeadlineExceededError)
                        else type(err).__name__)
                with lock:
                    failures.append(f"round {round_index + 1}, task {index}: {kind}")
                    failed_rounds.append(round_index)
                stop.set()

    threads = [threading.Thread(target=arrive, args=(i,), name=f"bench-barrier-{i}")
               for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    completed = [max(ends[r]) - starts[r] for r in range(rounds)
                 if r < len(starts) and all(ends[r])]
    if failed_rounds:  # the failed round and later ones count as not completed
        completed = completed[:min(failed_rounds)]
    timed_out = any("DeadlineExceeded" in f for f in failures)
    return {"rounds": rounds, "completed": len(completed), "seconds": completed,
            "failures": failures[:5], "n_failures": len(failures), "timed_out": timed_out,
            "timeout": timeout}


def barrier_calls(sessions: list) -> list[float]:
    """Barrier requests (any barrier method) each task has served so far, from its
    ``clusterwire_requests_total``."""
    return [sum(m["value"] for m in session.status()["metrics"]
                if m["name"] == "clusterwire_requests_total"
                and m["labels"].get("method", "").startswith("barrier"))
            for session in sessions]


def status_fanout(sessions: list, rounds: int, threads: int) -> dict[str, Any]:
    """Seconds for one client to get every task's status: sequential, pool, cluster_status."""
    n = len(sessions)

    def check(status: dict, index: int) -> None:
        if (status["job"], status["task_index"]) != ("worker", index):
            raise AssertionError(f"status of task {index} came from {status}")

    def sequential() -> None:
        for index, session in enumerate(sessions):
            check(session.status(), index)

    pool = ThreadPoolExecutor(min(n, threads), thread_name_prefix="bench-status")

    def concurrent() -> None:
        for index, status in enumerate(pool.map(lambda s: s.status(), sessions)):
            check(status, index)

    variants: dict[str, Callable[[], None]] = {"sequential": sequential,
                                               "concurrent": concurrent}
    if hasattr(sessions[0], "cluster_status"):
        def cluster_status() -> None:
            found = sessions[0].cluster_status()
            bad = {task: s for task, s in found.items() if "error" in s}
            if len(found) != n or bad:
                raise AssertionError(f"cluster_status: {len(found)} tasks, errors {bad}")

        variants["cluster_status"] = cluster_status
    try:
        for fn in variants.values():  # warm-up (and checked)
            fn()
        samples: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                variants[name]()
                samples[name].append(time.perf_counter() - started)
    finally:
        pool.shutdown()
    return {"threads": min(n, threads), "seconds": samples}


@contextlib.contextmanager
def baseline_processes():
    """The baseline processes of BASELINES, each printing a line once imported, then idle."""
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, imports in BASELINES.items():
            proc = subprocess.Popen(
                [sys.executable, "-c", f"{imports}; print('ready', flush=True); "
                 "sys.stdin.read()"],  # exits when its stdin closes (or on SIGTERM)
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs[name] = proc
            if proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError(f"baseline {name!r} did not start")
        yield procs
    finally:
        for proc in procs.values():
            stop_process(proc, 5.0)


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def memory(cluster: Any, n: int, idle_seconds: float) -> dict[str, Any]:
    """Per-task Rss/Pss/USS/threads after ``idle_seconds`` idle, the baselines', and those of
    the tasks' parent processes other than this one (a launcher that forks the tasks)."""
    with baseline_processes() as baselines:
        time.sleep(idle_seconds)  # no requests meanwhile: let the tasks settle after the load
        pids = [cluster.process("worker", i).pid for i in range(n)]
        tasks = [read_smaps(pid) for pid in pids]
        parents = sorted({parent_pid(pid) for pid in pids} - {os.getpid()})
        launchers = [read_smaps(pid) for pid in parents]
        base = {name: read_smaps(proc.pid) for name, proc in baselines.items()}
    summary = {}
    for key in ("rss", "pss", "uss", "threads"):
        values = [t[key] for t in tasks]
        summary[key] = {"mean": statistics.fmean(values), "max": max(values),
                        "total": sum(values)}
    summary["pss_with_launchers"] = summary["pss"]["total"] + sum(p["pss"] for p in launchers)
    return {"tasks": tasks, "summary": summary, "baselines": base, "launchers": launchers}


def measure_n(n: int, args: argparse.Namespace, step: Callable[[str], None]) -> dict[str, Any]:
    from clusterwire import Session

    result: dict[str, Any] = {"n": n, "up": [], "close": []}
    for repeat in range(args.repeats):
        step(f"n={n}: cluster start-up {repeat + 1}/{args.repeats}")
        cluster, seconds = cluster_up(n)
        result["up"].append(seconds)
        if repeat + 1 < args.repeats:
            result["close"].append(closed(cluster))
    # The last start-up's cluster serves the other measures of this n.
    try:
        with contextlib.ExitStack() as stack:
            sessions = [stack.enter_context(Session(cluster.target("worker", i),
                                                    timeout=args.client_timeout))
                        for i in range(n)]
            for index, session in enumerate(sessions):  # connect before any timing
                if session.status()["task_index"] != index:
                    raise AssertionError(f"task {index} answers as another task")
            step(f"n={n}: {args.barrier_rounds} barrier rounds")
            before = barrier_calls(sessions)
            result["barrier"] = barrier_rounds(sessions, args.barrier_rounds,
                                               args.barrier_timeout)
            served = [b - a for a, b in zip(before, barrier_calls(sessions), strict=True)]
            result["barrier"]["busiest_task_calls_per_round"] = (
                max(served) / args.barrier_rounds)
            if args.barrier_only:
                return result
            step(f"n={n}: status fan-out, {args.status_rounds} rounds")
            result["status"] = status_fanout(sessions, args.status_rounds, args.status_threads)
            step(f"n={n}: idle memory (after {args.idle_seconds:g} s idle)")
            result["memory"] = memory(cluster, n, args.idle_seconds)
    finally:
        step(f"n={n}: closing the cluster")
        result["close"].append(closed(cluster))
    return result


# ----------------------------------------------------------------------------- data service


def consumer_main(args: argparse.Namespace) -> int:
    """--role consumer: read the shared job after "go" on stdin; elements to --out (.npy)."""
    from clusterwire import data

    ds = data.Dataset.range(args.elements).apply(data.distribute(
        args.mode, args.target, job_name=args.job_name))
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    started = time.perf_counter()
    iterator = iter(ds)
    received = [int(x) for x in itertools.islice(iterator, 1)]
    first = time.perf_counter()
    received += [int(x) for x in iterator]
    ended = time.perf_counter()
    values = np.asarray(received, dtype=np.int64)
    np.save(args.out, values)
    print(json.dumps({"started": started, "first": first, "ended": ended,
                      "count": int(values.size)}), flush=True)
    return 0


def data_round(target: str, mode: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """One shared job of ``mode`` read by ``args.data_consumers`` consumer processes."""
    job_name = f"scale-{uuid.uuid4().hex[:8]}"
    # Every worker produces the whole dataset in parallel_epochs: a range of 1/W the size
    # keeps the elements delivered (and the run time) the same as distributed_epoch's.
    copies = 1 if mode == "distributed_epoch" else args.data_workers
    size = args.data_elements // copies
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    outs = [os.path.join(tmp, f"{job_name}-{i}.npy") for i in range(args.data_consumers)]
    procs: list[subprocess.Popen] = []
    try:
        for out in outs:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--role", "consumer", "--target",
                 target, "--mode", mode, "--job-name", job_name, "--elements",
                 str(size), "--out", out],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError(f"a data consumer did not start (exit {proc.poll()})")
        go = time.perf_counter()
        for proc in procs:
            proc.stdin.write("go\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        reports = []
        deadline = time.monotonic() + args.data_timeout
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"a data consumer failed with exit code {proc.returncode}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            stop_process(proc)
    received = [np.load(out) for out in outs]
    for out in outs:
        os.unlink(out)
    counts = np.bincount(np.concatenate(received), minlength=size)
    total = int(counts.sum())
    end = max(r["ended"] for r in reports)
    return {
        "mode": mode, "job_name": job_name, "range": size, "expected_copies": copies,
        "total": total, "expected": copies * size,
        "lost": int(np.clip(copies - counts, 0, None).sum()),
        "repeated": int(np.clip(counts - copies, 0, None).sum()),
        "out_of_range": int(sum(((r < 0) | (r >= size)).sum() for r in received)),
        "exact": bool(np.array_equal(counts, np.full(size, copies))),
        "seconds": end - go, "el_s": total / (end - go),
        "consumers": [{"count": r["count"], "seconds": r["ended"] - go,
                       "start_lag": r["started"] - go, "first": r["first"] - go,
                       "el_s": r["count"] / (r["ended"] - go)} for r in reports],
    }


def measure_data(args: argparse.Namespace, step: Callable[[str], None]) -> list[dict[str, Any]]:
    sys.path.insert(0, HERE)
    from bench_data import Servers  # the data benchmark's dispatcher and worker processes

    step(f"data service: dispatcher and {args.data_workers} workers")
    servers = Servers("clusterwire", workers=args.data_workers)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="cw-bench-scale-") as tmp:
            for run in range(args.data_runs):
                for mode in DATA_MODES:
                    step(f"data service: {mode}, {args.data_consumers} consumers x "
                         f"{args.data_elements} elements, run {run + 1}/{args.data_runs}")
                    row = data_round(servers.target, mode, args, tmp)
                    row["run"] = run
                    rows.append(row)
    finally:
        servers.close()
    return rows


# ----------------------------------------------------------------------------- report


def environment(argv: Sequence[str]) -> dict[str, Any]:
    import grpc

    model = cpu_model()
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "core", "transports"],
                               cwd=ROOT, check=True, capture_output=True, text=True).stdout
        git = head + (" + uncommitted changes in core/ or transports/" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        git = "unknown (not a git checkout)"
    return {"when": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(["python", "bench/bench_scale.py", *argv]), "git": git,
            "cpu": model, "cpus": os.cpu_count(), "os": f"{platform.system()} "
            f"{platform.release()}", "python": platform.python_version(),
            "grpcio": grpc.__version__, "numpy": np.__version__,
            "load_start": os.getloadavg()[0]}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _growth(points: dict[int, float], unit: str, scale: float = 1.0) -> str:
    endpoint, fit = slope(points)
    if endpoint != endpoint:
        return "n/a"
    return f"{endpoint * scale:+.3g} {unit} (fit {fit * scale:+.3g})"


def barrier_line(result: dict[str, Any]) -> dict[str, Any]:
    """One n's barrier measure (``--barrier-only``): ms of the first round and the others."""
    b = result["barrier"]
    steady = sorted(_after_first(b["seconds"]))
    ms = [round(s * 1e3, 1) for s in steady]
    return {"tasks": result["n"], "up_s": round(result["up"][-1], 2),
            "first_ms": round(b["seconds"][0] * 1e3, 1) if b["seconds"] else None,
            "median_ms": round(statistics.median(steady) * 1e3, 1) if steady else None,
            "p90_ms": ms[int(0.9 * (len(ms) - 1))] if ms else None,
            "max_ms": ms[-1] if ms else None, "completed": b["completed"],
            "busiest_task_calls_per_round": b["busiest_task_calls_per_round"],
            "rounds": b["rounds"], "failures": b["failures"][:1],
            "load": round(os.getloadavg()[0], 1)}


def render(env: dict[str, Any], args: argparse.Namespace, results: list[dict[str, Any]],
           data_rows: list[dict[str, Any]], elapsed: float) -> str:
    ns = [r["n"] for r in results]
    lines = [
        f"# clusterwire scale benchmark, {env['when']}",
        "",
        f"Command: `{env['command']}` ({elapsed:.0f} s). One job \"worker\" of n tasks, each "
        "its own process (`LocalCluster`, grpc, 127.0.0.1); this process is the client.",
        "",
        f"- clusterwire commit: {env['git']}",
        f"- CPU: {env['cpu']}, os.cpu_count() = {env['cpus']}; load average (1 min) at start "
        f"/ end: {env['load_start']:.2f} / {env['load_end']:.2f}",
        f"- {env['os']}; Python {env['python']}; grpcio {env['grpcio']}, numpy {env['numpy']}",
        "",
        f"## Cluster up (LocalCluster constructor; {args.repeats} start-ups per n)",
        "",
        "| n | median s | max s | all runs s | close() median s |",
        "|---:|---:|---:|---|---:|",
    ]
    for r in results:
        lines.append(f"| {r['n']} | {statistics.median(r['up']):.2f} | {max(r['up']):.2f} | "
                     f"{', '.join(f'{s:.2f}' for s in r['up'])} | "
                     f"{statistics.median(r['close']):.2f} |")
    lines += [
        "",
        f"## Barrier latency (n threads, one Session per task, {args.barrier_rounds} rounds, "
        f"timeout {args.barrier_timeout:g} s)",
        "",
        "The first round also pays each Session's one-time set-up (it asks its target for the "
        "cluster and checks that it reaches the barrier's coordinator) and the first "
        "connections; median, p90 and max are of the rounds after it.",
        "",
        "| n | first round ms | median ms | p90 ms | max ms | rounds completed | busiest task's "
        "barrier calls / round | |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        b = r["barrier"]
        s = b["seconds"]
        if b["failures"] and not s:
            what = "never (timed out)" if b["timed_out"] else "never (failed)"
            lines.append(f"| {r['n']} | {what} | | | | {b['completed']}/{b['rounds']} | | "
                         f"{b['n_failures']} arrivals failed, e.g. {b['failures'][0]} |")
            continue
        note = ""
        if b["failures"]:
            note = (f"then timed out: {b['failures'][0]}" if b["timed_out"]
                    else f"then failed: {b['failures'][0]}")
        steady = _after_first(s)
        lines.append(f"| {r['n']} | {_ms(s[0])} | {_ms(statistics.median(steady))} | "
                     f"{_ms(percentile(steady, 90))} | {_ms(max(steady))} | "
                     f"{b['completed']}/{b['rounds']} | "
                     f"{b['busiest_task_calls_per_round']:.1f} | {note} |")
    variants = list(dict.fromkeys(v for r in results for v in r["status"]["seconds"]))
    lines += [
        "",
        f"## Status fan-out: status() of every task (median / max ms of {args.status_rounds} "
        "interleaved rounds)",
        "",
        "sequential: one call after another over n Sessions; concurrent: a pool of "
        f"min(n, {args.status_threads}) threads over the same Sessions; cluster_status: "
        "`Session.cluster_status()` through task 0 (it forwards to every task)"
        + ("" if "cluster_status" in variants else "; not measured: Session has no "
           "cluster_status in this checkout") + ".",
        "",
        "| n | " + " | ".join(variants) + " |",
        "|---:|" + "---:|" * len(variants),
    ]
    for r in results:
        cells = []
        for v in variants:
            s = r["status"]["seconds"].get(v)
            cells.append(f"{_ms(statistics.median(s))} / {_ms(max(s))}" if s else "-")
        lines.append(f"| {r['n']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## Idle memory per task (MiB, after {args.idle_seconds:g} s without requests)",
        "",
        "| n | Rss mean / max | Pss mean / max | USS mean / max | tasks' total Pss "
        "| + launcher Pss | threads mean / max |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = r["memory"]["summary"]
        lines.append(
            f"| {r['n']} | {m['rss']['mean']:.1f} / {m['rss']['max']:.1f} | "
            f"{m['pss']['mean']:.1f} / {m['pss']['max']:.1f} | "
            f"{m['uss']['mean']:.1f} / {m['uss']['max']:.1f} | {m['pss']['total']:.0f} | "
            f"{m['pss_with_launchers']:.0f} | "
            f"{m['threads']['mean']:.1f} / {m['threads']['max']:.0f} |")
    lines += ["", "\"+ launcher\": with the Pss of the tasks' parent processes other than this "
              "one (a launcher that forks the tasks and lives as long as the cluster), if any. "
              "Baselines and launchers, read at the same time as the tasks:", "",
              "| n | process | Rss | Pss | USS | threads |", "|---:|---|---:|---:|---:|---:|"]
    for r in results:
        rows = [(f"baseline `{name}`", b) for name, b in r["memory"]["baselines"].items()]
        rows += [("launcher (the tasks' parent)", p) for p in r["memory"]["launchers"]]
        for name, b in rows:
            lines.append(f"| {r['n']} | {name} | {b['rss']:.1f} | {b['pss']:.1f} | "
                         f"{b['uss']:.1f} | {b['threads']} |")
    lines += _growth_table(results, ns)
    lines += _charts(results)
    if data_rows:
        lines += _data_table(args, data_rows)
    lines.append("")
    return "\n".join(lines)


def _after_first(seconds: list[float]) -> list[float]:
    """The rounds after the first (all of them if there is only one)."""
    return seconds[1:] or seconds


def _growth_table(results: list[dict[str, Any]], ns: list[int]) -> list[str]:
    if len(ns) < 2:
        return []

    def per_n(get: Callable[[dict[str, Any]], float | None]) -> dict[int, float]:
        return {r["n"]: get(r) for r in results}

    def barrier_median(r: dict[str, Any]) -> float | None:
        s = r["barrier"]["seconds"]
        return (statistics.median(_after_first(s)) if s and not r["barrier"]["failures"]
                else None)

    def status_median(name: str) -> Callable[[dict[str, Any]], float | None]:
        def get(r: dict[str, Any]) -> float | None:
            s = r["status"]["seconds"].get(name)
            return statistics.median(s) if s else None
        return get

    rows = [
        ("cluster up, median", per_n(lambda r: statistics.median(r["up"])), "ms/task", 1e3),
        ("cluster close(), median", per_n(lambda r: statistics.median(r["close"])),
         "ms/task", 1e3),
        ("barrier latency, median after the first round", per_n(barrier_median), "ms/task",
         1e3),
        ("status, sequential", per_n(status_median("sequential")), "ms/task", 1e3),
        ("status, concurrent", per_n(status_median("concurrent")), "ms/task", 1e3),
        ("status, cluster_status()", per_n(status_median("cluster_status")), "ms/task", 1e3),
        ("Pss per task, mean", per_n(lambda r: r["memory"]["summary"]["pss"]["mean"]),
         "MiB per added task", 1.0),
        ("tasks' total Pss", per_n(lambda r: r["memory"]["summary"]["pss"]["total"]),
         "MiB/task", 1.0),
        ("tasks' + launcher total Pss",
         per_n(lambda r: r["memory"]["summary"]["pss_with_launchers"]), "MiB/task", 1.0),
        ("USS per task, mean", per_n(lambda r: r["memory"]["summary"]["uss"]["mean"]),
         "MiB per added task", 1.0),
        ("threads per task, mean", per_n(lambda r: r["memory"]["summary"]["threads"]["mean"]),
         "per added task", 1.0),
    ]
    lines = ["", f"## Growth per task (endpoints n={ns[0]} and n={ns[-1]}; fit: least-squares "
             "slope over every n)", "", "| measure | growth |", "|---|---|"]
    for name, points, unit, scale in rows:
        if sum(v is not None for v in points.values()) < 2:
            growth = "n/a (not measured, or not completed, at two n)"
        elif any(v is None for v in points.values()):
            known = {n: v for n, v in points.items() if v is not None}
            growth = _growth(known, unit, scale) + " (only n = " + ", ".join(
                map(str, known)) + ")"
        else:
            growth = _growth(points, unit, scale)
        lines.append(f"| {name} | {growth} |")
    return lines


def _charts(results: list[dict[str, Any]]) -> list[str]:
    """How each measure grows with n, as Mermaid line charts (GitHub renders them)."""
    if len(results) < 2:
        return []
    ns = [r["n"] for r in results]

    def median_ms(values: Sequence[float] | None) -> float | None:
        return round(statistics.median(values) * 1e3, 1) if values else None

    charts = [
        ("cluster up (s)", [round(statistics.median(r["up"]), 2) for r in results]),
        ("barrier latency, median (ms)",
         [None if r["barrier"]["failures"] else median_ms(_after_first(r["barrier"]["seconds"]))
          for r in results]),
        ("status of every task, concurrent (ms)",
         [median_ms(r["status"]["seconds"].get("concurrent")) for r in results]),
        ("tasks' total Pss (MiB)",
         [round(r["memory"]["summary"]["pss"]["total"]) for r in results]),
    ]
    lines = ["", "## Growth with n", ""]
    for title, values in charts:
        if any(v is None for v in values):
            continue
        top = max(values) * 1.1 or 1
        lines += ["```mermaid", "xychart-beta", f'    title "{title} against tasks n"',
                  f"    x-axis [{', '.join(map(str, ns))}]",
                  f'    y-axis "{title}" 0 --> {top:.3g}',
                  f"    line [{', '.join(map(str, values))}]", "```", ""]
    return lines


def _data_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        f"## Data service: {args.data_workers} workers x {args.data_consumers} consumers, one "
        "shared job",
        "",
        "Dispatcher, workers and consumers are processes; the consumers start at one signal. "
        "Per-consumer el/s: its elements over its own time since the signal. parallel_epochs "
        f"reads range({args.data_elements} / {args.data_workers}): every worker produces all "
        "of it, so as many elements are delivered as in distributed_epoch.",
        "",
        "| mode (shared job_name) | dataset | run | elements (expected) | total el/s | s "
        "| per-consumer el/s median (min-max) | per-consumer elements min-max "
        "| first element max ms | exactly as expected | lost | repeated |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in rows:
        rates = [c["el_s"] for c in r["consumers"]]
        counts = [c["count"] for c in r["consumers"]]
        lag = max(c["first"] for c in r["consumers"])
        each = "once" if r["expected_copies"] == 1 else f"{r['expected_copies']}x"
        lines.append(
            f"| {r['mode']} (each element {each}) | range({r['range']}) | {r['run'] + 1} | "
            f"{r['total']} "
            f"({r['expected']}) | {r['el_s']:,.0f} | {r['seconds']:.2f} | "
            f"{statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) | "
            f"{min(counts)}-{max(counts)} | {lag * 1e3:.0f} | "
            f"{'yes' if r['exact'] and not r['out_of_range'] else '**NO**'} | {r['lost']} | "
            f"{r['repeated']} |")
    return lines


# ----------------------------------------------------------------------------- main


def _parse_tasks(text: str) -> list[int]:
    try:
        tasks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad task list {text!r} (e.g. 4,16,64)") from None
    if not tasks or tasks[0] < 1:
        raise argparse.ArgumentTypeError("task counts must be >= 1")
    return tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--role", choices=["consumer"], help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--job-name", help=argparse.SUPPRESS)
    parser.add_argument("--elements", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--tasks", type=_parse_tasks, help="task counts (default 4,16,64; "
                        "--quick: 4,16)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: n = 4, 16, 2 start-ups, fewer rounds, less data")
    parser.add_argument("--repeats", type=int, help="cluster start-ups per n (default 3; "
                        "--quick 2)")
    parser.add_argument("--barrier-rounds", type=int,
                        help="default 20 (--quick 10; --hosts 10)")
    parser.add_argument("--barrier-timeout", type=float,
                        help="seconds a barrier arrival waits (default 10; --hosts 60)")
    parser.add_argument("--barrier-only", action="store_true",
                        help="measure cluster-up and the barrier only; one JSON line per n")
    parser.add_argument("--client-timeout", type=float, default=5.0,
                        help="the Sessions' request deadline on top of the barrier timeout")
    parser.add_argument("--status-rounds", type=int, help="default 10 (--quick 5)")
    parser.add_argument("--status-threads", type=int, default=16,
                        help="threads of the concurrent status fan-out (at most n)")
    parser.add_argument("--idle-seconds", type=float,
                        help="idle time before the memory is read (default 1; --hosts: "
                        "the idle CPU window, default 20)")
    hosts = parser.add_argument_group("emulated hosts (as root; bench/_scale_hosts.py)")
    hosts.add_argument("--hosts", type=int,
                       help="spread one job with SWIM over this many emulated hosts "
                       "(default n: 1024)")
    hosts.add_argument("--probe-interval", type=float, default=1.0,
                       help="SWIM's round, membership_heartbeat_seconds (default 1)")
    hosts.add_argument("--settle", type=float, default=10.0,
                       help="seconds after start-up before the idle window (default 10)")
    hosts.add_argument("--false-down-seconds", type=float, default=60.0,
                       help="seconds beside two CPU hogs, counting false downs (default 60)")
    hosts.add_argument("--down-timeout", type=float, default=120.0,
                       help="seconds a killed host's tasks may take to be down everywhere")
    hosts.add_argument("--status-timeout", type=float, default=30.0,
                       help="the client's status() deadline (default 30)")
    hosts.add_argument("--min-free-mib", type=float, default=2048.0,
                       help="end the run (every task killed) when the machine's "
                       "MemAvailable falls below this (default 2048)")
    hosts.add_argument("--run-timeout", type=float, default=3600.0,
                       help="seconds one task count's run may take, then it is ended and "
                       "cleaned up (default 3600)")
    parser.add_argument("--data-workers", type=int, default=8)
    parser.add_argument("--data-consumers", type=int, default=8)
    parser.add_argument("--data-elements", type=int,
                        help="range(N) read by the shared job (default 300000; --quick 50000)")
    parser.add_argument("--data-runs", type=int, default=1, help="runs of each data mode")
    parser.add_argument("--data-timeout", type=float, default=120.0,
                        help="seconds a data round may take before it counts as hung")
    parser.add_argument("--no-data", dest="data", action="store_false",
                        help="skip the data-service section")
    parser.add_argument("--output", help="report path (default bench/results/scale-<time>.md)")
    parser.add_argument("--json", nargs="?", const=True,
                        help="also write every sample to this JSON file; with --hosts, "
                        "print one JSON line a task count (and append it to the file)")
    args = parser.parse_args(argv)
    if args.role == "consumer":
        return consumer_main(args)
    if args.hosts is not None:
        return hosts_main(args)
    if args.json is True:
        parser.error("--json takes a file name (a bare --json is for --hosts)")
    args.idle_seconds = 1.0 if args.idle_seconds is None else args.idle_seconds
    args.barrier_timeout = args.barrier_timeout or 10.0
    quick = args.quick
    args.tasks = args.tasks or ([4, 16] if quick else [4, 16, 64])
    args.repeats = args.repeats or (2 if quick else 3)
    args.barrier_rounds = args.barrier_rounds or (10 if quick else 20)
    args.status_rounds = args.status_rounds or (5 if quick else 10)
    args.data_elements = args.data_elements or (50_000 if quick else 300_000)

    started = time.perf_counter()
    shown = sys.argv[1:] if argv is None else argv
    env = environment(shown)

    def step(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    import clusterwire.transports.grpc  # noqa: F401 - the launcher's grpc import, paid once

    if args.barrier_only:
        for n in args.tasks:
            print(json.dumps(barrier_line(measure_n(n, args, step))), flush=True)
        return 0
    results = [measure_n(n, args, step) for n in args.tasks]
    data_rows = measure_data(args, step) if args.data else []
    env["load_end"] = os.getloadavg()[0]
    elapsed = time.perf_counter() - started
    report = render(env, args, results, data_rows, elapsed)
    print(report)
    now = datetime.datetime.now()
    output = args.output or os.path.join(HERE, "results",
                                         f"scale-{now.strftime('%Y%m%d-%H%M%S')}.md")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w", encoding="utf-8") as handle:
        handle.write(report)
    step(f"report written to {output}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"env": env, "args": {k: v for k, v in vars(args).items()
                                            if not k.startswith("_")},
                       "tasks": results, "data": data_rows, "elapsed": elapsed}, handle,
                      indent=1)
        step(f"samples written to {args.json}")
    return 0


def hosts_main(args: argparse.Namespace) -> int:
    """``--hosts``: bench/_scale_hosts.py with this mode's defaults."""
    import _scale_hosts

    args.tasks = args.tasks or [1024]
    args.idle_seconds = 20.0 if args.idle_seconds is None else args.idle_seconds
    args.barrier_rounds = args.barrier_rounds or 10
    args.barrier_timeout = args.barrier_timeout or 60.0
    started = time.perf_counter()

    def step(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    return _scale_hosts.main(args, step)


if __name__ == "__main__":
    sys.exit(main())
