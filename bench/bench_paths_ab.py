"""A/B of the 8-byte paths between two commits of clusterwire, in one run.

Run from the repository root::

    python bench/bench_paths_ab.py --before 8c7bd3e^ --pairs 6

``--before`` (and ``--after``, default: this checkout as installed) name commits; each is
made importable as ``clusterwire`` in a temporary directory (``git archive`` of its
``core``, ``transports`` and ``resolvers``, its protos compiled with grpcio-tools, the
optional C extensions of this checkout copied in) and put first on ``PYTHONPATH``. Then
``--pairs`` times, a process of the before code and one of the after code run in turn
(alternating, so a slow phase of the machine hits both), each measuring in interleaved
rounds (``bench_session.interleaved_round_trips``) the median of: a raw TCP ping-pong,
8-byte ``Session.get`` over grpc direct, forwarded and from a worker process (a 2-task
cluster; the client hosts a task of its own), in-process, and over grpc+local. Every
process it starts (the side's cluster and its client) runs that side's code.

Prints per path the median of the pairs' medians for each side, after / before, and in
how many pairs the after side was faster; ``--json`` prints one JSON line instead.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PATHS = ("tcp", "grpc direct", "grpc forwarded", "grpc worker process", "in-process",
         "grpc+local")
_REMOTE = "/job:worker/task:1"


def _measure(iterations: int) -> None:
    """One side's run (``--role side``): prints one JSON line of per-path medians (us)."""
    sys.path.insert(0, HERE)
    import _baselines
    import numpy as np
    from bench_session import interleaved_round_trips

    import clusterwire
    from clusterwire import Server, Session
    from clusterwire.local_cluster import LocalCluster

    small = np.arange(8, dtype=np.uint8)
    env = dict(os.environ)
    with contextlib.ExitStack() as stack:
        tcp_server = stack.enter_context(_baselines.ServerProcess("tcp", 1 << 16))
        tcp = _baselines.TcpClient(tcp_server.port)
        stack.callback(tcp.close)
        cluster = stack.enter_context(LocalCluster({"worker": 2}, env=env))
        session = stack.enter_context(Session(cluster.target("worker", 0)))
        workers = [cluster.target("worker", i).split("://")[1] for i in range(2)]
        trainer = Server({"worker": workers, "trainer": ["127.0.0.1:0"]},
                         job_name="trainer", task_index=0)
        stack.callback(trainer.stop)
        own = stack.enter_context(Session(trainer.target))
        same_host = stack.enter_context(LocalCluster({"worker": 1}, protocol="grpc+local",
                                                     env=env))
        local = stack.enter_context(Session(same_host.target("worker", 0)))
        with Session(cluster.target("worker", 1)) as other:
            for store in (session, other, own, local):
                store.put("small", small)
        paths = {
            "tcp": lambda: tcp.ping(bytes(8)),
            "grpc direct": lambda: session.get("small"),
            "grpc forwarded": lambda: session.get("small", task=_REMOTE),
            "grpc worker process": lambda: own.get("small", task=_REMOTE),
            "in-process": lambda: own.get("small"),
            "grpc+local": lambda: local.get("small"),
        }
        for get in paths.values():
            get()
        samples = interleaved_round_trips(paths, iterations, 200, 15)
        print(json.dumps({"clusterwire": clusterwire.__file__,
                          **{name: statistics.median(s) / 1e3 for name, s in samples.items()}}))


def _importable(commit: str, into: str) -> str:
    """A directory where ``import clusterwire`` gets ``commit``'s code."""
    source = os.path.join(into, "source")
    os.makedirs(source)
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "core", "transports",
                              "resolvers"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", source], input=archive, check=True)
    package = os.path.join(into, "pkg", "clusterwire")
    shutil.copytree(os.path.join(source, "core"), package)
    for part in ("transports", "resolvers"):
        shutil.copytree(os.path.join(source, part), os.path.join(package, part))
    for extension in glob.glob(os.path.join(ROOT, "core", "**", "*.so"), recursive=True):
        shutil.copy(extension, os.path.join(package, os.path.relpath(
            os.path.dirname(extension), os.path.join(ROOT, "core")), ""))
    from grpc_tools import protoc

    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    protos = sorted(os.path.relpath(p, os.path.dirname(package)) for p in
                    glob.glob(os.path.join(package, "protos", "*.proto")))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"-I{include}",
                    "--python_out=.", *protos], cwd=os.path.dirname(package), check=True)
    return os.path.dirname(package)


def _side(path: str | None, iterations: int) -> dict:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([path] + ([env["PYTHONPATH"]]
                                                      if env.get("PYTHONPATH") else []))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--role", "side",
                          "--iterations", str(iterations)], env=env, cwd=tempfile.gettempdir(),
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"a side's run failed:\n{out.stderr[-2000:]}")
    run = json.loads(out.stdout.strip().splitlines()[-1])
    if path is not None and not run["clusterwire"].startswith(path):
        raise SystemExit(f"a side imported {run['clusterwire']}, not the tree at {path}")
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["side"], help=argparse.SUPPRESS)
    parser.add_argument("--before", help="the commit measured against (e.g. 8c7bd3e^)")
    parser.add_argument("--after", help="a commit (default: this checkout as installed)")
    parser.add_argument("--pairs", type=int, default=6, help="alternating before/after runs")
    parser.add_argument("--iterations", type=int, default=4000,
                        help="timed round trips per path in each run")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args(argv)
    if args.role == "side":
        _measure(args.iterations)
        return 0
    if not args.before:
        parser.error("--before COMMIT is required")
    with tempfile.TemporaryDirectory() as tmp:
        before = _importable(args.before, os.path.join(tmp, "before"))
        after = _importable(args.after, os.path.join(tmp, "after")) if args.after else None
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        loads = []
        for _ in range(args.pairs):
            loads.append(os.getloadavg()[0])
            runs["before"].append(_side(before, args.iterations))
            runs["after"].append(_side(after, args.iterations))
    rows = {}
    for path in PATHS:
        b = [run[path] for run in runs["before"]]
        a = [run[path] for run in runs["after"]]
        rows[path] = {"before_us": statistics.median(b), "after_us": statistics.median(a),
                      "after_faster_in": sum(y < x for x, y in zip(b, a, strict=True))}
    if args.json:
        print(json.dumps({"before": args.before, "after": args.after or "checkout",
                          "pairs": args.pairs, "load": [round(x, 2) for x in loads],
                          "paths": rows}))
        return 0
    print(f"8-byte paths, {args.before} -> {args.after or 'this checkout'}, {args.pairs} "
          f"alternating pairs, load {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'path':22s} {'before us':>10s} {'after us':>10s} {'after/before':>13s} "
          f"{'after faster':>13s}")
    for path, row in rows.items():
        print(f"{path:22s} {row['before_us']:10.2f} {row['after_us']:10.2f} "
              f"{row['after_us'] / row['before_us']:13.3f} "
              f"{row['after_faster_in']:>8d} of {args.pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
