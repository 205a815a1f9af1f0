"""Benchmark of clusterwire's Session over loopback, next to raw TCP and bare grpcio.

Run from the repository root::

    python bench/bench_session.py

It measures, in one run (about a minute on 2 cores):

1. 8-byte round trips: ``Session.get`` of an 8-byte array and ``Session.call``
   of an echo ``@remote`` function, direct (client -> owning task) and
   forwarded (client -> task 0 -> task 1), next to a raw TCP ping-pong and a
   bare grpcio unary call between two processes.
2. 64 MiB ``Session.get`` throughput, direct and forwarded, next to raw TCP
   (``recv_into`` a preallocated buffer), one bare grpcio unary message, a
   bare grpcio chunk stream and a numpy memcpy.
3. ``import clusterwire`` time, and that it does not import grpc.
4. Local cluster start-up (ps:1, worker:2) until a status call through worker 0
   reaches the ps task.
5. A sweep of the grpc transport's ``chunk_bytes`` for the 64 MiB direct get
   (``--chunk-bytes``; each size runs a fresh task with a temporary
   plugins.toml).

The Markdown report is printed and written to bench/results/session-<time>.md.
Every process started here is stopped at the end, also on error.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _baselines  # noqa: E402
from _bench_remote import ECHO  # noqa: E402

MIB = 1 << 20
REMOTE_TASK = "/job:worker/task:1"
TARGETS = {"get8_vs_grpc": 1.3, "get64_vs_tcp": 0.33, "import_s": 0.3, "cluster_up_s": 1.0}
TF_REFERENCE = [
    ("TensorFlow 2.21 ps->worker 8-byte read", "1.29 ms"),
    ("TensorFlow 2.21 ps->worker 64 MiB read", "0.98 GB/s"),
    ("import tensorflow", "~3 s"),
    ("3-process TF cluster up", "3.4 s"),
    ("raw TCP 8 B round trip / 64 MiB", "~10 us / ~2.95 GB/s"),
    ("bare grpcio 8 B round trip / 64 MiB", "~337 us / 0.32 GB/s"),
]


# ----------------------------------------------------------------------------- measuring


@dataclass
class Latency:
    name: str
    topology: str
    samples_ns: list[int]

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_ns) / 1e3

    @property
    def p99_us(self) -> float:
        return float(np.percentile(self.samples_ns, 99)) / 1e3


@dataclass
class Throughput:
    name: str
    topology: str
    nbytes: int
    seconds: list[float]

    @property
    def median_gbs(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9

    @property
    def range_gbs(self) -> tuple[float, float]:
        return self.nbytes / max(self.seconds) / 1e9, self.nbytes / min(self.seconds) / 1e9


def time_round_trips(fn: Callable[[], object], iterations: int, warmup: int) -> list[int]:
    """Per-call wall times in ns of ``iterations`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(iterations):
        start = clock()
        fn()
        samples.append(clock() - start)
    return samples


def time_transfers(fn: Callable[[], object], check: Callable[[object], bool],
                   transfers: int) -> list[float]:
    """Seconds per transfer of ``transfers`` runs after one checked warm-up run."""
    first = fn()
    if not check(first):
        raise AssertionError("warm-up transfer returned wrong bytes")
    del first
    seconds = []
    for _ in range(transfers):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
        del result
    return seconds


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment additions for task processes: bench/ importable (for _bench_remote)."""
    paths = [HERE] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return {"PYTHONPATH": os.pathsep.join(paths), **(extra or {})}


def _same_bytes(expected: np.ndarray) -> Callable[[object], bool]:
    def check(got: object) -> bool:
        array = np.frombuffer(got, np.uint8) if not isinstance(got, np.ndarray) else got
        return array.nbytes == expected.nbytes and bool(
            np.array_equal(array.reshape(-1).view(np.uint8), expected))
    return check


# ----------------------------------------------------------------------------- sections


def measure_baselines(args: argparse.Namespace, payload: np.ndarray):
    """Raw TCP, bare grpcio and memcpy: (latencies, throughputs)."""
    latencies, throughputs = [], []
    nbytes = payload.nbytes
    eight = bytes(range(8))
    out = np.empty(nbytes, np.uint8)
    out_view = memoryview(out)
    check = _same_bytes(payload)

    with _baselines.ServerProcess("tcp", nbytes) as server:
        client = _baselines.TcpClient(server.port)
        try:
            assert client.ping(eight) == eight
            latencies.append(Latency("raw TCP ping-pong", "direct", time_round_trips(
                lambda: client.ping(eight), args.iterations, args.warmup)))

            def tcp_fetch():
                client.fetch_blob(out_view)
                return out
            throughputs.append(Throughput("raw TCP, recv_into preallocated", "direct", nbytes,
                                          time_transfers(tcp_fetch, check, args.transfers)))
        finally:
            client.close()

    with _baselines.ServerProcess("grpc", nbytes, args.baseline_chunk) as server:
        client = _baselines.GrpcClient(server.port)
        try:
            assert client.echo(eight) == eight
            latencies.append(Latency("bare grpcio unary_unary", "direct", time_round_trips(
                lambda: client.echo(eight), args.iterations, args.warmup)))
            throughputs.append(Throughput(
                "bare grpcio, one unary message", "direct", nbytes,
                time_transfers(lambda: client.blob(b""), check, args.transfers)))

            def stream_fetch():
                client.blob_stream_into(out_view)
                return out
            throughputs.append(Throughput(
                f"bare grpcio, unary_stream of {args.baseline_chunk // 1024} KiB chunks "
                "into preallocated", "direct", nbytes,
                time_transfers(stream_fetch, check, args.transfers)))
        finally:
            client.close()

    def copy_preallocated():
        np.copyto(out, payload)
        return out

    def copy_fresh():
        fresh = np.empty(nbytes, np.uint8)
        np.copyto(fresh, payload)
        return fresh
    throughputs.append(Throughput("numpy memcpy into preallocated", "in-process", nbytes,
                                  time_transfers(copy_preallocated, check, args.transfers)))
    throughputs.append(Throughput("numpy memcpy into fresh np.empty", "in-process", nbytes,
                                  time_transfers(copy_fresh, check, args.transfers)))
    return latencies, throughputs


def measure_clusterwire(args: argparse.Namespace, payload: np.ndarray):
    """Session.get / Session.call on a 2-task LocalCluster: (latencies, throughputs, info)."""
    from clusterwire import Session
    from clusterwire.local_cluster import LocalCluster

    latencies, throughputs = [], []
    small = np.arange(8, dtype=np.uint8)
    check = _same_bytes(payload)
    with LocalCluster({"worker": 2}, imports=["_bench_remote"], env=child_env()) as cluster, \
            Session(cluster.target("worker", 0)) as session, \
            Session(cluster.target("worker", 1)) as other:
        info = session.status()["transport"]
        for store in (session, other):
            store.put("small", small)
            store.put("big", payload)
        for topology, task in (("direct", None), ("forwarded", REMOTE_TASK)):
            assert np.array_equal(session.get("small", task=task), small)
            assert np.array_equal(session.call(ECHO, small, task=task), small)
            latencies.append(Latency("clusterwire Session.get", topology, time_round_trips(
                lambda t=task: session.get("small", task=t), args.iterations, args.warmup)))
            latencies.append(Latency("clusterwire Session.call (echo)", topology,
                                     time_round_trips(
                                         lambda t=task: session.call(ECHO, small, task=t),
                                         args.iterations, args.warmup)))
        for topology, task in (("direct", None), ("forwarded", REMOTE_TASK)):
            throughputs.append(Throughput(
                "clusterwire Session.get", topology, payload.nbytes,
                time_transfers(lambda t=task: session.get("big", task=t), check,
                               args.transfers)))
    return latencies, throughputs, info


def measure_chunk_sweep(args: argparse.Namespace, payload: np.ndarray):
    """64 MiB direct Session.get with each grpc chunk_bytes: [(chunk, Throughput, info)]."""
    from clusterwire import Session
    from clusterwire.local_cluster import LocalCluster
    from clusterwire.plugins import PluginManager, set_plugin_manager

    results = []
    check = _same_bytes(payload)
    for chunk in args.chunk_bytes:
        with tempfile.TemporaryDirectory(prefix="cw-bench-") as tmp:
            path = os.path.join(tmp, "plugins.toml")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(f"[options.grpc]\nchunk_bytes = {chunk}\n")
            old = set_plugin_manager(PluginManager(path))
            try:
                with LocalCluster({"worker": 1}, env=child_env({"CLUSTERWIRE_PLUGINS": path})) \
                        as cluster, Session(cluster.target("worker", 0)) as session:
                    info = session.status()["transport"].get("data", "?")
                    if str(chunk) not in info:
                        raise AssertionError(f"task did not take chunk_bytes={chunk}: {info}")
                    session.put("big", payload)
                    seconds = time_transfers(lambda s=session: s.get("big"), check,
                                             args.transfers)
            finally:
                set_plugin_manager(old)
        results.append((chunk, Throughput("clusterwire Session.get", "direct",
                                          payload.nbytes, seconds), info))
    return results


_IMPORT_PROBE = (
    "import sys, time\n"
    "start = time.perf_counter()\n"
    "import clusterwire\n"
    "elapsed = time.perf_counter() - start\n"
    "import json\n"
    "print(json.dumps({'seconds': elapsed, 'grpc': 'grpc' in sys.modules,"
    " 'transports': sorted(m for m in sys.modules if m.startswith('clusterwire.transports.'))}))\n"
)


def _wall(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def measure_import(repeats: int) -> dict:
    """Wall time of ``python -c 'import clusterwire'``, in-process import time, breakdown."""
    python = sys.executable
    bare = [_wall([python, "-c", "pass"]) for _ in range(repeats)]
    wall = [_wall([python, "-c", "import clusterwire"]) for _ in range(repeats)]
    probes = [json.loads(subprocess.run([python, "-c", _IMPORT_PROBE], check=True,
                                        capture_output=True, text=True).stdout)
              for _ in range(repeats)]
    trace = subprocess.run([python, "-X", "importtime", "-c", "import clusterwire"],
                           check=True, capture_output=True, text=True).stderr
    cumulative: dict[str, int] = {}
    for line in trace.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if match:
            cumulative.setdefault(match.group(4), int(match.group(2)))
    parts = {name: cumulative[name] / 1e6 for name in (
        "numpy", "google.protobuf", "clusterwire.protos.service_pb2", "pluggy", "tomllib")
        if name in cumulative}
    tf = importlib.util.find_spec("tensorflow") is not None
    return {
        "bare_wall": statistics.median(bare),
        "wall": statistics.median(wall),
        "wall_all": wall,
        "inproc": statistics.median(p["seconds"] for p in probes),
        "grpc_loaded": any(p["grpc"] for p in probes),
        "transports_loaded": sorted({m for p in probes for m in p["transports"]}),
        "parts": parts,
        "tf_wall": statistics.median(_wall([python, "-c", "import tensorflow"])
                                     for _ in range(repeats)) if tf else None,
    }


def _cluster_up_child() -> None:
    """--role cluster-up: one cold start in a fresh interpreter; prints JSON timings."""
    import clusterwire
    from clusterwire.local_cluster import LocalCluster

    start = time.perf_counter()
    cluster = LocalCluster({"ps": 1, "worker": 2})
    try:
        constructed = time.perf_counter()
        with clusterwire.Session(cluster.target("worker", 0)) as session:
            status = session.status(task="/job:ps/task:0")
        up = time.perf_counter()
        if (status["job"], status["task_index"]) != ("ps", 0):
            raise AssertionError(f"status reached the wrong task: {status}")
    finally:
        closing = time.perf_counter()
        cluster.close()
        closed = time.perf_counter()
    print(json.dumps({"up": up - start, "constructed": constructed - start,
                      "close": closed - closing}))


def measure_cluster_up(repeats: int) -> list[dict]:
    """Cold local-cluster start-ups, each in a fresh interpreter (it pays its grpc import)."""
    runs = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--role",
                               "cluster-up"], check=True, capture_output=True, text=True,
                              timeout=120)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


# ----------------------------------------------------------------------------- report


def machine() -> dict[str, str]:
    import google.protobuf
    import grpc

    model = "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpus": f"{len(os.sched_getaffinity(0))} usable (os.cpu_count() = {os.cpu_count()})",
        "cpu": model,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": f"grpcio {grpc.__version__}, numpy {np.__version__}, "
                    f"protobuf {google.protobuf.__version__}",
    }


def _met(ok: bool) -> str:
    return "met" if ok else "**NOT met**"


def render(args, env, base_lat, base_tp, cw_lat, cw_tp, info, sweep, imports, ups,
           elapsed) -> str:
    grpc_us = next(r.median_us for r in base_lat if r.name.startswith("bare grpcio"))
    tcp_gbs = next(r.median_gbs for r in base_tp if r.name.startswith("raw TCP"))
    lines = [
        f"# clusterwire Session benchmark, {env['when']}",
        "",
        f"Command: `{env['command']}` (took {elapsed:.0f} s). All traffic on 127.0.0.1; "
        "client and every server in separate processes.",
        "",
        f"- CPU: {env['cpu']}, {env['cpus']}",
        f"- OS: {env['os']}; Python {env['python']}; {env['versions']}",
        f"- clusterwire transport as reported by `status()`: {info}",
        f"- round trips: {args.iterations} timed after {args.warmup} warm-up; "
        f"{args.size_mib} MiB transfers: median of {args.transfers} after 1 checked warm-up",
        "",
        f"## 8-byte round trip ({args.iterations} calls)",
        "",
        "| Path | Topology | Median (us) | p99 (us) | x bare grpcio | Target |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in base_lat + cw_lat:
        ratio = row.median_us / grpc_us
        target = ""
        if row.name == "clusterwire Session.get" and row.topology == "direct":
            target = f"<= {TARGETS['get8_vs_grpc']}x: {_met(ratio <= TARGETS['get8_vs_grpc'])}"
        lines.append(f"| {row.name} | {row.topology} | {row.median_us:.1f} | {row.p99_us:.1f} "
                     f"| {ratio:.2f}x | {target} |")
    lines += [
        "",
        f"## {args.size_mib} MiB transfer (GB/s = 1e9 B/s)",
        "",
        "| Path | Topology | Median GB/s | Min-max GB/s | Median ms | x raw TCP | Target |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for row in base_tp + cw_tp:
        ratio = row.median_gbs / tcp_gbs
        low, high = row.range_gbs
        target = ""
        if row.name == "clusterwire Session.get" and row.topology == "direct":
            target = f">= {TARGETS['get64_vs_tcp']}x: {_met(ratio >= TARGETS['get64_vs_tcp'])}"
        lines.append(f"| {row.name} | {row.topology} | {row.median_gbs:.2f} | {low:.2f}-{high:.2f}"
                     f" | {statistics.median(row.seconds) * 1e3:.1f} | {ratio:.2f}x | {target} |")
    if sweep:
        best = max(sweep, key=lambda item: item[1].median_gbs)[0]
        lines += [
            "",
            f"## grpc `chunk_bytes` sweep, {args.size_mib} MiB direct Session.get",
            "",
            "Each row is a fresh 1-task cluster whose task (and this client) read a temporary "
            "plugins.toml with `[options.grpc] chunk_bytes = N`.",
            "",
            "| chunk_bytes | Median GB/s | Min-max GB/s | x raw TCP | |",
            "|---:|---:|---:|---:|---|",
        ]
        for chunk, row, _info in sweep:
            low, high = row.range_gbs
            mark = "best" if chunk == best else ""
            lines.append(f"| {_size(chunk)} | {row.median_gbs:.2f} | {low:.2f}-{high:.2f} "
                         f"| {row.median_gbs / tcp_gbs:.2f}x | {mark} |")
    up = statistics.median(run["up"] for run in ups)
    parts = ", ".join(f"{name} {seconds * 1e3:.0f} ms"
                      for name, seconds in imports["parts"].items())
    tf = ("not installed" if imports["tf_wall"] is None
          else f"{imports['tf_wall']:.2f} s (median of {args.repeats})")
    lines += [
        "",
        "## Import and start-up",
        "",
        "| Measurement | Value | Target |",
        "|---|---:|---|",
        f"| `python -c \"import clusterwire\"` wall (median of {args.repeats}) "
        f"| {imports['wall']:.3f} s | < {TARGETS['import_s']} s: "
        f"{_met(imports['wall'] < TARGETS['import_s'])} |",
        f"| `python -c pass` wall (interpreter alone) | {imports['bare_wall']:.3f} s | |",
        f"| in-process `import clusterwire` (perf_counter, fresh interpreter) "
        f"| {imports['inproc'] * 1e3:.0f} ms | |",
        f"| `grpc` in sys.modules after `import clusterwire` | {imports['grpc_loaded']} "
        f"| False: {_met(not imports['grpc_loaded'])} |",
        f"| `python -c \"import tensorflow\"` | {tf} | |",
        f"| LocalCluster(ps:1, worker:2) until status(ps) via worker 0 (median of "
        f"{len(ups)}, each in a fresh interpreter) | {up:.3f} s | < {TARGETS['cluster_up_s']} s: "
        f"{_met(up < TARGETS['cluster_up_s'])} |",
        "",
        f"Import breakdown (`-X importtime`, cumulative): {parts}.",
        "Cluster start-up runs (up / constructor returned / close): "
        + "; ".join(f"{r['up']:.3f} / {r['constructed']:.3f} / {r['close']:.3f} s" for r in ups)
        + ".",
        "",
        "## Targets",
        "",
        "| Target | Measured | |",
        "|---|---:|---|",
    ]
    get8 = next(r for r in cw_lat if r.name == "clusterwire Session.get"
                and r.topology == "direct").median_us / grpc_us
    get64 = next(r for r in cw_tp if r.topology == "direct").median_gbs / tcp_gbs
    lines += [
        f"| direct 8 B get <= {TARGETS['get8_vs_grpc']}x bare grpcio unary | {get8:.2f}x "
        f"| {_met(get8 <= TARGETS['get8_vs_grpc'])} |",
        f"| direct {args.size_mib} MiB get >= {TARGETS['get64_vs_tcp']}x raw TCP | {get64:.2f}x "
        f"| {_met(get64 >= TARGETS['get64_vs_tcp'])} |",
        f"| import clusterwire < {TARGETS['import_s']} s | {imports['wall']:.3f} s "
        f"| {_met(imports['wall'] < TARGETS['import_s'])} |",
        f"| no grpc after import | {not imports['grpc_loaded']} "
        f"| {_met(not imports['grpc_loaded'])} |",
        f"| local cluster up < {TARGETS['cluster_up_s']} s | {up:.3f} s "
        f"| {_met(up < TARGETS['cluster_up_s'])} |",
        "",
    ]
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes % MIB == 0 else f"{nbytes // 1024} KiB"


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([kKmM]?)(i?[bB])?", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 262144, 256K, 1M)")
    factor = {"": 1, "k": 1024, "m": MIB}[match.group(2).lower()]
    return int(match.group(1)) * factor


def _parse_sizes(text: str) -> list[int]:
    if text.strip().lower() in ("", "none", "off"):
        return []
    return [_parse_size(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["cluster-up"], help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=2000, help="timed round trips")
    parser.add_argument("--warmup", type=int, default=200, help="untimed round trips first")
    parser.add_argument("--transfers", type=int, default=8, help="timed bulk transfers")
    parser.add_argument("--size-mib", type=int, default=64, help="bulk transfer size")
    parser.add_argument("--repeats", type=int, default=5, help="import timing repeats")
    parser.add_argument("--cluster-repeats", type=int, default=3, help="cluster start-ups")
    parser.add_argument("--chunk-bytes", type=_parse_sizes, default="256K,1M,2M,4M,8M",
                        help="grpc chunk_bytes values to sweep for the direct get "
                             "(comma-separated, K/M suffixes; 'none' skips the sweep)")
    parser.add_argument("--baseline-chunk", type=_parse_size, default=MIB,
                        help="chunk size of the bare grpcio stream baseline")
    parser.add_argument("--output", help="report path (default bench/results/session-<time>.md)")
    args = parser.parse_args(argv)
    if args.role == "cluster-up":
        _cluster_up_child()
        return 0

    started = time.perf_counter()
    now = datetime.datetime.now()
    env = {"when": now.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python", os.path.relpath(__file__)] + sys.argv[1:]),
           **machine()}
    nbytes = args.size_mib * MIB
    payload = np.frombuffer(_baselines.blob(nbytes), np.uint8)

    def step(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    step("import timings")
    imports = measure_import(args.repeats)
    step("local cluster start-up")
    ups = measure_cluster_up(args.cluster_repeats)
    step("baselines: raw TCP, bare grpcio, memcpy")
    base_lat, base_tp = measure_baselines(args, payload)
    step("clusterwire Session: direct and forwarded")
    cw_lat, cw_tp, info = measure_clusterwire(args, payload)
    sweep = []
    if args.chunk_bytes:
        step(f"chunk_bytes sweep: {', '.join(_size(c) for c in args.chunk_bytes)}")
        sweep = measure_chunk_sweep(args, payload)
    elapsed = time.perf_counter() - started
    report = render(args, env, base_lat, base_tp, cw_lat, cw_tp, info, sweep, imports, ups,
                    elapsed)
    print(report)
    output = args.output or os.path.join(
        HERE, "results", f"session-{now.strftime('%Y%m%d-%H%M%S')}.md")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w", encoding="utf-8") as handle:
        handle.write(report)
    step(f"report written to {os.path.relpath(output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
