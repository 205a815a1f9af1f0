"""Benchmark of clusterwire's Session over loopback, next to raw TCP and bare grpcio.

Run from the repository root::

    python bench/bench_session.py

It measures, in one run (about 60 s on 2 cores):

1. 8-byte round trips: ``Session.get`` of an 8-byte array and ``Session.call``
   of an echo ``@remote`` function, next to a raw TCP ping-pong and a bare grpcio
   unary call between two processes. Topologies of ``Session.get``:

   - direct: client -> owning task (another process);
   - forwarded: client -> task 0 -> task 1 (three processes);
   - worker process: this process hosts a task and reads through it from the
     owning task (TF's ps-variable read from a worker's training loop);
   - in-process: a Session on a task of this process reads its own store;
   - same host: ``grpc+local`` between two processes;
   - grpc fast lane: ``grpc`` with ``fast_lane = true`` (a 2-task cluster of its own,
     a temporary plugins.toml): direct, forwarded and worker process.
2. 1 KiB calls per second, ``--rate-threads`` (8) client threads of this process against
   one task, each thread with a Session (a grpcio channel) of its own: ``Session.call`` of
   an echo over gRPC and over the fast lane, next to bare grpcio unary echoes (the same
   server process as above), in interleaved rounds.
3. 64 MiB ``Session.get`` throughput on the same topologies, next to raw TCP
   (``recv_into`` a preallocated buffer), one bare grpcio unary message, a
   bare grpcio chunk stream and a numpy memcpy.
4. ``import clusterwire`` time, and that it does not import grpc.
5. Local cluster start-up (ps:1, worker:2) until a status call through worker 0
   reaches the ps task.
6. A sweep of the grpc transport's ``chunk_bytes`` for the 64 MiB direct get
   fetched as a gRPC chunk stream (``bulk_plane = "grpc"``: the path under TLS)
   (``--chunk-bytes``; each size runs a fresh task with a temporary
   plugins.toml).

With tensorflow importable, rounds 1 and 2 also measure TensorFlow's own runtime
on the same machine: a TF1 graph Session reading an 8-byte and a 64 MiB
variable of a ps task, direct, forwarded and from a worker process (TF's
in-process master), as bench/_tf_baseline.py says (``--no-tensorflow`` skips
it). TensorFlow need not be in the project's environment: run the benchmark
with an interpreter that has both (e.g. a venv made with
``--system-site-packages`` and ``pip install tensorflow-cpu``).

Paths that are compared run side by side: all servers are up at once and the
round trips (and transfers) of the paths are interleaved in rounds, so a slow
phase of the machine hits every path alike. ``--cpus 0`` pins everything to
one CPU (no cross-CPU wake-ups; the numbers then add up CPU time).

The Markdown report is printed and written to bench/results/session-<time>.md.
Every process started here is stopped at the end, also on error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _baselines  # noqa: E402
import _tf_baseline  # noqa: E402
from _bench_remote import ECHO  # noqa: E402
from _machine import cpu_model  # noqa: E402

MIB = 1 << 20
REMOTE_TASK = "/job:worker/task:1"
TARGETS = {"get8_vs_grpc": 1.3, "get64_vs_tcp": 0.33, "import_s": 0.3, "cluster_up_s": 1.0,
           "worker8_vs_tf": 0.6, "worker64_vs_tf": 1.8, "worker64_vs_tcp": 0.7,
           "inproc8_vs_grpc": 0.1, "inproc64_vs_memcpy": 0.01, "local8_us": 150,
           "lane8_vs_tcp": 3.0, "lane_forwarded_vs_direct": 2.0, "lane_rate_vs_grpc": 3.0,
           "local8_vs_grpc": 0.35}
CW_GET = "clusterwire Session.get"
LANE_GET = "clusterwire Session.get, grpc fast lane"
LANE_CALL = "clusterwire Session.call (echo), grpc fast lane"
RATE_BARE = "bare grpcio unary_unary, 1 KiB echo"
RATE_CW = "clusterwire Session.call (1 KiB echo) over gRPC"
RATE_LANE = "clusterwire Session.call (1 KiB echo), grpc fast lane"
LOCAL_GET = "clusterwire Session.get, grpc+local"
TF_READ = "TensorFlow Session.run, ps variable read"
TF_TOPOLOGIES = ("direct", "forwarded", "worker process")
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


def interleaved_round_trips(variants: dict[Hashable, Callable[[], object]], iterations: int,
                            warmup: int, rounds: int) -> dict[Hashable, list[int]]:
    """Per-call wall times (ns) of every variant, measured in interleaved rounds.

    Each variant first runs ``warmup`` untimed calls. Then, ``rounds`` times,
    every variant in turn (rotating the order) runs ``iterations / rounds``
    timed calls, so slow phases of the machine hit all variants alike.
    """
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    names = list(variants)
    samples: dict[Hashable, list[int]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    per_round = max(1, iterations // rounds)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            fn, out = variants[name], samples[name]
            for _ in range(per_round):
                start = clock()
                fn()
                out.append(clock() - start)
    return samples


@dataclass
class Rate:
    name: str
    calls_per_s: list[float]  # one per round

    @property
    def median(self) -> float:
        return statistics.median(self.calls_per_s)


#: A caller of its own for one thread: (one call, what closes it).
Caller = tuple[Callable[[], object], Callable[[], None]]


def interleaved_rates(variants: dict[str, Callable[[], Caller]], threads: int,
                      seconds: float, rounds: int) -> dict[str, list[float]]:
    """Calls per second of every variant, ``threads`` threads each calling with a caller of
    its own (made once per thread by the variant's factory) for ``seconds``; ``rounds``
    rounds, every variant in turn (rotating the order), after a short untimed one."""
    callers = {name: [make() for _ in range(threads)] for name, make in variants.items()}
    try:
        names = list(variants)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(-1, rounds):  # -1: warm-up
            shift = max(round_index, 0) % len(names)
            for name in names[shift:] + names[:shift]:
                rate = _calls_per_second([call for call, _ in callers[name]],
                                         seconds if round_index >= 0 else min(seconds, 0.3))
                if round_index >= 0:
                    rates[name].append(rate)
        return rates
    finally:
        for made in callers.values():
            for _, close in made:
                close()


def _calls_per_second(calls: list[Callable[[], object]], seconds: float) -> float:
    """Every call of ``calls`` made again and again on a thread of its own for ``seconds``:
    the calls answered per second, all threads together."""
    counts = [0] * len(calls)
    failures: list[BaseException] = []
    start = threading.Barrier(len(calls) + 1)

    def work(index: int) -> None:
        call, clock, count = calls[index], time.perf_counter, 0
        start.wait()
        deadline = clock() + seconds
        try:
            while clock() < deadline:
                call()
                count += 1
        except BaseException as err:  # re-raised by the caller
            failures.append(err)
        counts[index] = count

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(calls))]
    for worker in workers:
        worker.start()
    start.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - began
    if failures:
        raise failures[0]
    return sum(counts) / elapsed


def interleaved_transfers(variants: dict[Hashable, Callable[[], object]],
                          check: Callable[[object], bool],
                          transfers: int) -> dict[Hashable, list[float]]:
    """Seconds per transfer of every variant: one checked warm-up each, then interleaved."""
    for name, fn in variants.items():
        first = fn()
        if not check(first):
            raise AssertionError(f"{name}: warm-up transfer returned wrong bytes")
        del first
    names = list(variants)
    seconds: dict[Hashable, list[float]] = {name: [] for name in names}
    for index in range(transfers):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            result = variants[name]()
            seconds[name].append(time.perf_counter() - start)
            del result
    return seconds


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"sanity check failed: {what} returned the wrong value")


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


def measure_transports(args: argparse.Namespace, payload: np.ndarray):
    """Baselines and clusterwire side by side: (latencies, throughputs, calls/s rates,
    transport info).

    All servers run at once (raw TCP, bare grpcio, a 2-task LocalCluster), each
    in its own process; this process is the client of all of them.
    """
    from clusterwire import Server, Session
    from clusterwire.local_cluster import LocalCluster

    nbytes = payload.nbytes
    eight = bytes(range(8))
    small = np.arange(8, dtype=np.uint8)
    out = np.empty(nbytes, np.uint8)
    out_view = memoryview(out)
    chunk_kib = args.baseline_chunk // 1024
    with contextlib.ExitStack() as stack:
        tcp_server = stack.enter_context(_baselines.ServerProcess("tcp", nbytes))
        grpc_server = stack.enter_context(
            _baselines.ServerProcess("grpc", nbytes, args.baseline_chunk))
        cluster = stack.enter_context(
            LocalCluster({"worker": 2}, imports=["_bench_remote"], env=child_env()))
        tcp = _baselines.TcpClient(tcp_server.port)
        stack.callback(tcp.close)
        bare = _baselines.GrpcClient(grpc_server.port)
        stack.callback(bare.close)
        session = stack.enter_context(Session(cluster.target("worker", 0)))
        # The worker-process topology: this process hosts a task of its own (job
        # "trainer") whose Session reads the owner's tensors through it, as a TF worker's
        # training loop does; the trainer's own store is the in-process topology.
        workers = [cluster.target("worker", i).split("://")[1] for i in range(2)]
        trainer = Server({"worker": workers, "trainer": ["127.0.0.1:0"]}, job_name="trainer",
                         task_index=0)
        stack.callback(trainer.stop)
        own = stack.enter_context(Session(trainer.target))
        same_host = stack.enter_context(
            LocalCluster({"worker": 1}, protocol="grpc+local", env=child_env()))
        local = stack.enter_context(Session(same_host.target("worker", 0)))
        lane, lane_own, lane_other, lane_session = _lane_sessions(stack)
        with Session(cluster.target("worker", 1)) as other:
            for store in (session, other, own, local, lane, lane_other):
                store.put("small", small)
                store.put("big", payload)
        info = session.status()["transport"]
        tf = None
        if args.tensorflow and _tf_baseline.available():
            tf = stack.enter_context(_tf_baseline.TfCluster(small, payload))

        _require(tcp.ping(eight) == eight and bare.echo(eight) == eight, "baseline echo")
        for task in (None, REMOTE_TASK):
            _require(np.array_equal(session.get("small", task=task), small), f"get {task}")
            _require(np.array_equal(session.call(ECHO, small, task=task), small),
                     f"call {task}")
        _require(np.array_equal(own.get("small", task=REMOTE_TASK), small), "worker process")
        _require(np.array_equal(own.get("small"), small), "in-process get")
        _require(np.array_equal(local.get("small"), small), "grpc+local get")
        _require(np.array_equal(lane.get("small", task=REMOTE_TASK), small), "lane forwarded")
        _require(np.array_equal(lane_own.get("small", task=REMOTE_TASK), small), "lane worker")
        round_trips = {
            ("raw TCP ping-pong", "direct"): lambda: tcp.ping(eight),
            ("bare grpcio unary_unary", "direct"): lambda: bare.echo(eight),
            ("bare grpcio unary_unary, timeout=30 s", "direct"):
                lambda: bare.echo(eight, timeout=30.0),
            ("bare grpcio unary_unary, registered method", "direct"):
                lambda: bare.echo_registered(eight),
            ("clusterwire Session.get", "direct"): lambda: session.get("small"),
            ("clusterwire Session.call (echo)", "direct"): lambda: session.call(ECHO, small),
            ("clusterwire Session.get", "forwarded"):
                lambda: session.get("small", task=REMOTE_TASK),
            ("clusterwire Session.call (echo)", "forwarded"):
                lambda: session.call(ECHO, small, task=REMOTE_TASK),
            ("clusterwire Session.get", "worker process"):
                lambda: own.get("small", task=REMOTE_TASK),
            ("clusterwire Session.get", "in-process"): lambda: own.get("small"),
            ("clusterwire Session.get, grpc+local", "same host"): lambda: local.get("small"),
            (LANE_GET, "direct"): lambda: lane.get("small"),
            (LANE_CALL, "direct"): lambda: lane.call(ECHO, small),
            (LANE_GET, "forwarded"): lambda: lane.get("small", task=REMOTE_TASK),
            (LANE_GET, "worker process"): lambda: lane_own.get("small", task=REMOTE_TASK),
        }
        if tf is not None:
            for topology in TF_TOPOLOGIES:
                _require(np.array_equal(tf.read("small", topology), small), f"TF {topology}")
                round_trips[TF_READ, topology] = lambda t=topology: tf.read("small", t)
        samples = interleaved_round_trips(round_trips, args.iterations, args.warmup,
                                          args.rounds)
        latencies = [Latency(name, topology, samples[name, topology])
                     for name, topology in round_trips]

        kib = np.arange(1024, dtype=np.uint8)
        _require(np.array_equal(lane.call(ECHO, kib), kib), "lane 1 KiB echo")

        def bare_caller() -> Caller:
            client = _baselines.GrpcClient(grpc_server.port)
            payload_kib = kib.tobytes()
            return (lambda: client.echo(payload_kib)), client.close

        def session_caller(make: Callable[[], Session]) -> Callable[[], Caller]:
            def caller() -> Caller:
                own_session = make()
                return (lambda: own_session.call(ECHO, kib)), own_session.close
            return caller

        rate_samples = interleaved_rates({
            RATE_BARE: bare_caller,
            RATE_CW: session_caller(lambda: Session(cluster.target("worker", 0))),
            RATE_LANE: session_caller(lane_session),
        }, args.rate_threads, args.rate_seconds, args.rate_rounds)
        rates = [Rate(name, values) for name, values in rate_samples.items()]

        def tcp_fetch():
            tcp.fetch_blob(out_view)
            return out

        def stream_fetch():
            bare.blob_stream_into(out_view)
            return out

        def copy_preallocated():
            np.copyto(out, payload)
            return out

        def copy_fresh():
            fresh = np.empty(nbytes, np.uint8)
            np.copyto(fresh, payload)
            return fresh

        transfers = {
            ("numpy memcpy into preallocated", "in-process"): copy_preallocated,
            ("numpy memcpy into fresh np.empty", "in-process"): copy_fresh,
            ("raw TCP, recv_into preallocated", "direct"): tcp_fetch,
            ("bare grpcio, one unary message", "direct"): lambda: bare.blob(b""),
            (f"bare grpcio, unary_stream of {chunk_kib} KiB chunks into preallocated",
             "direct"): stream_fetch,
            ("clusterwire Session.get", "direct"): lambda: session.get("big"),
            ("clusterwire Session.get", "forwarded"):
                lambda: session.get("big", task=REMOTE_TASK),
            ("clusterwire Session.get", "worker process"):
                lambda: own.get("big", task=REMOTE_TASK),
            ("clusterwire Session.get", "in-process"): lambda: own.get("big"),
            ("clusterwire Session.get, grpc+local", "same host"): lambda: local.get("big"),
            (LANE_GET, "direct"): lambda: lane.get("big"),
            (LANE_GET, "forwarded"): lambda: lane.get("big", task=REMOTE_TASK),
        }
        if tf is not None:
            for topology in TF_TOPOLOGIES:
                transfers[TF_READ, topology] = lambda t=topology: tf.read("big", t)
        seconds = interleaved_transfers(transfers, _same_bytes(payload), args.transfers)
        throughputs = [Throughput(name, topology, nbytes, seconds[name, topology])
                       for name, topology in transfers]
    return latencies, throughputs, rates, info


def _lane_sessions(stack: contextlib.ExitStack):
    """Sessions over the grpc transport with ``fast_lane = true`` (a temporary plugins.toml
    for a 2-task cluster and this process's transport): (a Session of task 0, a Session of
    a task this process hosts, of task 1, what makes another Session of task 0)."""
    from clusterwire import Server, Session
    from clusterwire.local_cluster import LocalCluster
    from clusterwire.plugins import PluginManager, set_plugin_manager

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="cw-bench-lane-"))
    path = os.path.join(tmp, "plugins.toml")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("[options.grpc]\nfast_lane = true\n")
    cluster = stack.enter_context(LocalCluster(
        {"worker": 2}, imports=["_bench_remote"], env=child_env({"CLUSTERWIRE_PLUGINS": path})))
    manager = PluginManager(path)
    old = set_plugin_manager(manager)
    try:  # the Sessions and the Server keep the transport they were created with
        session = stack.enter_context(Session(cluster.target("worker", 0)))
        other = stack.enter_context(Session(cluster.target("worker", 1)))
        workers = [cluster.target("worker", i).split("://")[1] for i in range(2)]
        trainer = Server({"worker": workers, "trainer": ["127.0.0.1:0"]}, job_name="trainer",
                         task_index=0)
        stack.callback(trainer.stop)
        own = stack.enter_context(Session(trainer.target))
    finally:
        set_plugin_manager(old)
    data = session.status()["transport"]
    _require("small_calls" in data, f"the lane cluster's transport has no lane: {data}")

    def new_session() -> Session:
        previous = set_plugin_manager(manager)
        try:
            return Session(cluster.target("worker", 0))
        finally:
            set_plugin_manager(previous)

    return session, own, other, new_session


def measure_chunk_sweep(args: argparse.Namespace, payload: np.ndarray):
    """64 MiB direct Session.get per grpc chunk_bytes: [(chunk, Throughput, task's data path)].

    Each size gets its own 1-task cluster started with a temporary plugins.toml
    (``[options.grpc] chunk_bytes``, ``bulk_plane = "grpc"``) and a Session whose
    client transport was created from the same file; transfers are interleaved
    across the sizes.
    """
    from clusterwire import Session
    from clusterwire.local_cluster import LocalCluster
    from clusterwire.plugins import PluginManager, set_plugin_manager

    sessions, data_paths = {}, {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="cw-bench-"))
        for chunk in args.chunk_bytes:
            path = os.path.join(tmp, f"plugins-{chunk}.toml")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(f"[options.grpc]\nchunk_bytes = {chunk}\nbulk_plane = \"grpc\"\n")
            cluster = stack.enter_context(LocalCluster(
                {"worker": 1}, env=child_env({"CLUSTERWIRE_PLUGINS": path})))
            old = set_plugin_manager(PluginManager(path))
            try:  # the Session keeps the transport it was created with
                session = stack.enter_context(Session(cluster.target("worker", 0)))
            finally:
                set_plugin_manager(old)
            # Shown in the report, so a plugins.toml the task ignored would be visible.
            data_paths[chunk] = session.status()["transport"].get("data", "?")
            session.put("big", payload)
            sessions[chunk] = session
        seconds = interleaved_transfers(
            {chunk: (lambda s=session: s.get("big")) for chunk, session in sessions.items()},
            _same_bytes(payload), args.transfers)
    return [(chunk, Throughput("clusterwire Session.get", "direct", payload.nbytes,
                               seconds[chunk]), data_paths[chunk]) for chunk in args.chunk_bytes]


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
    return {
        "bare_wall": statistics.median(bare),
        "wall": statistics.median(wall),
        "wall_all": wall,
        "inproc": statistics.median(p["seconds"] for p in probes),
        "grpc_loaded": any(p["grpc"] for p in probes),
        "transports_loaded": sorted({m for p in probes for m in p["transports"]}),
        "parts": import_breakdown(trace),
        "tf_wall": _tensorflow_wall(repeats),
    }


def import_breakdown(trace: str) -> dict[str, float]:
    """Seconds of ``-X importtime`` self time per top-level package, for ``import clusterwire``.

    Only the modules imported after interpreter start-up (after ``site``) count.
    """
    rows = []
    for line in trace.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if match:
            rows.append((match.group(4), int(match.group(1))))
    starts = [i for i, (name, _) in enumerate(rows) if name == "site"]
    rows = rows[starts[-1] + 1:] if starts else rows
    groups: dict[str, float] = {}
    for name, self_us in rows:
        top = name.split(".")[0]
        key = top if top in ("clusterwire", "numpy", "google", "pluggy") else "other (stdlib)"
        groups[key] = groups.get(key, 0.0) + self_us / 1e6
    return dict(sorted(groups.items(), key=lambda item: -item[1]))


def _tensorflow_wall(repeats: int) -> float | None:
    if importlib.util.find_spec("tensorflow") is None:
        return None
    return statistics.median(_wall([sys.executable, "-c", "import tensorflow"])
                             for _ in range(repeats))


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
        # Own process group: if it hangs, its cluster's task processes go with it.
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role",
                                  "cluster-up"], stdout=subprocess.PIPE, text=True,
                                 start_new_session=True)
        try:
            out, _ = child.communicate(timeout=120)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            raise
        if child.returncode != 0:
            raise RuntimeError(f"cluster start-up run failed with exit code {child.returncode}")
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return runs


# ----------------------------------------------------------------------------- report


def machine() -> dict[str, str]:
    import google.protobuf
    import grpc

    model = cpu_model()
    return {
        "cpus": f"os.cpu_count() = {os.cpu_count()}, this run on CPUs "
                f"{sorted(os.sched_getaffinity(0))}",
        "cpu": model,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": f"grpcio {grpc.__version__}, numpy {np.__version__}, "
                    f"protobuf {google.protobuf.__version__}",
    }


def git_state() -> str:
    """The commit measured, and whether core/ or transports/ differ from it."""
    root = os.path.dirname(HERE)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "core", "transports"],
                               cwd=root, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes in core/ or transports/" if dirty.strip() else "")


def _met(ok: bool) -> str:
    return "met" if ok else "**NOT met**"


def _find(rows, name: str, topology: str = "direct"):
    return next(r for r in rows if r.name == name and r.topology == topology)


def _find_rate(rates: list[Rate], name: str) -> float:
    return next(row.median for row in rates if row.name == name)


def _against_tensorflow(latencies, throughputs) -> list[str]:
    """One sentence comparing clusterwire with TF's rows of this run, if there are any."""
    if not any(row.name == TF_READ for row in latencies):
        return []
    parts = []
    for topology in TF_TOPOLOGIES:
        time_ratio = (_find(latencies, CW_GET, topology).median_us
                      / _find(latencies, TF_READ, topology).median_us)
        speed_ratio = (_find(throughputs, CW_GET, topology).median_gbs
                       / _find(throughputs, TF_READ, topology).median_gbs)
        parts.append(f"{topology}, the 8-byte get takes {time_ratio:.2f}x the time of TF's "
                     f"read and the bulk get moves {speed_ratio:.2f}x TF's GB/s")
    return ["", "Against TensorFlow in this run: " + "; ".join(parts) + "."]


def _fast_path_targets(args, latencies, throughputs) -> list[str]:
    """Target rows of the worker-process, in-process and same-host paths."""
    grpc_us = _find(latencies, "bare grpcio unary_unary").median_us
    tcp_gbs = _find(throughputs, "raw TCP, recv_into preallocated").median_gbs
    memcpy_s = statistics.median(_find(throughputs, "numpy memcpy into preallocated",
                                       "in-process").seconds)
    worker8 = _find(latencies, CW_GET, "worker process").median_us
    worker64 = _find(throughputs, CW_GET, "worker process").median_gbs
    inproc8 = _find(latencies, CW_GET, "in-process").median_us
    inproc64_s = statistics.median(_find(throughputs, CW_GET, "in-process").seconds)
    local8 = _find(latencies, LOCAL_GET, "same host").median_us
    rows = []
    if any(row.name == TF_READ for row in latencies):
        tf8 = worker8 / _find(latencies, TF_READ, "worker process").median_us
        tf64 = worker64 / _find(throughputs, TF_READ, "worker process").median_gbs
        rows += [
            f"| worker-process 8 B get <= {TARGETS['worker8_vs_tf']}x TF's worker-process "
            f"read | {tf8:.2f}x | {_met(tf8 <= TARGETS['worker8_vs_tf'])} |",
            f"| worker-process {args.size_mib} MiB get >= {TARGETS['worker64_vs_tf']}x TF's "
            f"GB/s | {tf64:.2f}x | {_met(tf64 >= TARGETS['worker64_vs_tf'])} |"]
    else:
        rows.append("| worker-process paths against TF | not measured (tensorflow not "
                    "importable) | |")
    ok_local = local8 <= TARGETS["local8_us"] or local8 / grpc_us <= TARGETS["local8_vs_grpc"]
    tcp8 = _find(latencies, "raw TCP ping-pong").median_us
    lane8 = _find(latencies, LANE_GET).median_us
    lane_forwarded = _find(latencies, LANE_GET, "forwarded").median_us / lane8
    rows += [
        f"| direct 8 B get over the grpc fast lane <= {TARGETS['lane8_vs_tcp']}x raw TCP "
        f"ping-pong | {lane8 / tcp8:.2f}x ({lane8:.0f} us) "
        f"| {_met(lane8 / tcp8 <= TARGETS['lane8_vs_tcp'])} |",
        f"| forwarded 8 B get over the fast lane <= {TARGETS['lane_forwarded_vs_direct']}x "
        f"direct | {lane_forwarded:.2f}x "
        f"| {_met(lane_forwarded <= TARGETS['lane_forwarded_vs_direct'])} |",
    ]
    rows += [
        f"| worker-process {args.size_mib} MiB get >= {TARGETS['worker64_vs_tcp']}x raw TCP "
        f"| {worker64 / tcp_gbs:.2f}x | {_met(worker64 / tcp_gbs >= TARGETS['worker64_vs_tcp'])} |",
        f"| in-process 8 B get <= {TARGETS['inproc8_vs_grpc']}x bare grpcio unary "
        f"| {inproc8 / grpc_us:.3f}x ({inproc8:.1f} us) "
        f"| {_met(inproc8 / grpc_us <= TARGETS['inproc8_vs_grpc'])} |",
        f"| in-process {args.size_mib} MiB get (no copy) <= {TARGETS['inproc64_vs_memcpy']}x "
        f"the time of a memcpy of it | {inproc64_s / memcpy_s:.4f}x ({inproc64_s * 1e6:.0f} "
        f"us) | {_met(inproc64_s / memcpy_s <= TARGETS['inproc64_vs_memcpy'])} |",
        f"| grpc+local cross-process 8 B get <= {TARGETS['local8_us']} us or <= "
        f"{TARGETS['local8_vs_grpc']}x bare grpcio | {local8:.0f} us, {local8 / grpc_us:.2f}x "
        f"| {_met(ok_local)} |",
    ]
    return rows


def render(args, env, latencies, throughputs, rates, info, sweep, imports, ups,
           elapsed) -> str:
    grpc_us = _find(latencies, "bare grpcio unary_unary").median_us
    tcp_gbs = _find(throughputs, "raw TCP, recv_into preallocated").median_gbs
    get8 = _find(latencies, CW_GET).median_us / grpc_us
    get64 = _find(throughputs, CW_GET).median_gbs / tcp_gbs
    up = statistics.median(run["up"] for run in ups)
    lines = [
        f"# clusterwire Session benchmark, {env['when']}",
        "",
        f"Command: `{env['command']}` ({elapsed:.0f} s). Loopback 127.0.0.1; every server runs "
        "in a process of its own, except the task of the worker-process and in-process "
        "topologies (and TF's worker 1), which this process (the client) hosts.",
        "",
        f"- clusterwire commit: {env['git']}",
        f"- CPU: {env['cpu']}, {env['cpus']}; load average (1 min) at start / end: "
        f"{env['load_start']:.2f} / {env['load_end']:.2f} (the end value includes this "
        "benchmark; other work on the machine adds noise)",
        f"- OS: {env['os']}; Python {env['python']}; {env['versions']}",
        f"- clusterwire grpc transport, as reported by `status()`: {info}",
        f"- Round trips: {args.warmup} warm-up calls per path, then {args.iterations} timed calls "
        f"per path in {args.rounds} interleaved rounds. {args.size_mib} MiB: one checked "
        f"warm-up per path, then {args.transfers} timed transfers per path, interleaved.",
        "",
        f"## 8-byte round trip ({args.iterations} calls per path)",
        "",
        "| Path | Topology | Median (us) | p99 (us) | x bare grpcio | Target |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in latencies:
        ratio = row.median_us / grpc_us
        target = ""
        if (row.name, row.topology) == (CW_GET, "direct"):
            target = f"<= {TARGETS['get8_vs_grpc']}x: {_met(ratio <= TARGETS['get8_vs_grpc'])}"
        lines.append(f"| {row.name} | {row.topology} | {row.median_us:.0f} | {row.p99_us:.0f} "
                     f"| {ratio:.2f}x | {target} |")
    bare_rate = _find_rate(rates, RATE_BARE)
    lines += [
        "",
        f"## 1 KiB calls per second, {args.rate_threads} client threads against one task",
        "",
        f"Each thread of this process calls with a Session (a grpcio channel) of its own for "
        f"{args.rate_seconds:g} s a round; {args.rate_rounds} interleaved rounds per path.",
        "",
        "| Path | Median calls/s | Min-max | x bare grpcio |",
        "|---|---:|---:|---:|",
    ]
    for row in rates:
        lines.append(f"| {row.name} | {row.median:,.0f} | {min(row.calls_per_s):,.0f}-"
                     f"{max(row.calls_per_s):,.0f} | {row.median / bare_rate:.2f}x |")
    lines += [
        "",
        f"## {args.size_mib} MiB transfer (GB/s = 1e9 B/s; median of {args.transfers})",
        "",
        "| Path | Topology | Median GB/s | Min-max GB/s | Median ms | x raw TCP | Target |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for row in throughputs:
        ratio = row.median_gbs / tcp_gbs
        low, high = row.range_gbs
        target = ""
        if (row.name, row.topology) == (CW_GET, "direct"):
            target = f">= {TARGETS['get64_vs_tcp']}x: {_met(ratio >= TARGETS['get64_vs_tcp'])}"
        lines.append(f"| {row.name} | {row.topology} | {row.median_gbs:.2f} | {low:.2f}-{high:.2f}"
                     f" | {statistics.median(row.seconds) * 1e3:.1f} | {ratio:.2f}x | {target} |")
    lines += _against_tensorflow(latencies, throughputs)
    if sweep:
        best = max(sweep, key=lambda item: item[1].median_gbs)[0]
        lines += [
            "",
            f"## grpc `chunk_bytes` sweep: {args.size_mib} MiB direct Session.get over a "
            "gRPC chunk stream",
            "",
            "One 1-task cluster per size, started with a temporary plugins.toml "
            "(`[options.grpc] chunk_bytes = N`, `bulk_plane = \"grpc\"`: the path a TLS "
            "listener uses; client transport from the same file); "
            f"transfers interleaved across sizes, median of {args.transfers}. Compare sizes "
            "with each other: x raw TCP is against the raw TCP row above, measured earlier.",
            "",
            "| chunk_bytes | Median GB/s | Min-max GB/s | x raw TCP | | Task reports |",
            "|---:|---:|---:|---:|---|---|",
        ]
        for chunk, row, data_path in sweep:
            low, high = row.range_gbs
            marks = [m for m, on in (("default", chunk == 1 << 20), ("best", chunk == best)) if on]
            lines.append(f"| {_size(chunk)} | {row.median_gbs:.2f} | {low:.2f}-{high:.2f} "
                         f"| {row.median_gbs / tcp_gbs:.2f}x | {', '.join(marks)} "
                         f"| {data_path} |")
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
        f"| `python -c \"import clusterwire\"` wall, median of {args.repeats} "
        f"| {imports['wall']:.3f} s | < {TARGETS['import_s']} s: "
        f"{_met(imports['wall'] < TARGETS['import_s'])} |",
        f"| `python -c pass` wall (the interpreter alone) | {imports['bare_wall']:.3f} s | |",
        "| `import clusterwire` in a fresh interpreter (perf_counter around the import) "
        f"| {imports['inproc'] * 1e3:.0f} ms | |",
        f"| `grpc` in sys.modules after `import clusterwire` | {imports['grpc_loaded']} "
        f"| False: {_met(not imports['grpc_loaded'])} |",
        f"| `python -c \"import tensorflow\"` | {tf} | |",
        f"| LocalCluster(ps:1, worker:2) until `status(task=\"/job:ps/task:0\")` through worker 0"
        f", median of {len(ups)} | {up:.3f} s | < {TARGETS['cluster_up_s']} s: "
        f"{_met(up < TARGETS['cluster_up_s'])} |",
        "",
        f"Import self time by package (`-X importtime`): {parts}.",
        "Each cluster start-up runs in a fresh interpreter after `import clusterwire` (so it "
        "pays the launcher's own grpc import); runs (up / constructor returned / close): "
        + "; ".join(f"{r['up']:.3f} / {r['constructed']:.3f} / {r['close']:.3f} s" for r in ups)
        + ".",
        "",
        "## Targets",
        "",
        "| Target | Measured | |",
        "|---|---:|---|",
        f"| direct 8 B get <= {TARGETS['get8_vs_grpc']}x bare grpcio unary | {get8:.2f}x "
        f"| {_met(get8 <= TARGETS['get8_vs_grpc'])} |",
        f"| direct {args.size_mib} MiB get >= {TARGETS['get64_vs_tcp']}x raw TCP | {get64:.2f}x "
        f"| {_met(get64 >= TARGETS['get64_vs_tcp'])} |",
        f"| `import clusterwire` < {TARGETS['import_s']} s (wall) | {imports['wall']:.3f} s "
        f"| {_met(imports['wall'] < TARGETS['import_s'])} |",
        f"| no grpc after `import clusterwire` | {not imports['grpc_loaded']} "
        f"| {_met(not imports['grpc_loaded'])} |",
        f"| local cluster up < {TARGETS['cluster_up_s']} s | {up:.3f} s "
        f"| {_met(up < TARGETS['cluster_up_s'])} |",
        *_fast_path_targets(args, latencies, throughputs),
        f"| 1 KiB calls/s over the fast lane, {args.rate_threads} threads >= "
        f"{TARGETS['lane_rate_vs_grpc']}x bare grpcio | "
        f"{_find_rate(rates, RATE_LANE) / bare_rate:.2f}x "
        f"| {_met(_find_rate(rates, RATE_LANE) / bare_rate >= TARGETS['lane_rate_vs_grpc'])} |",
        "",
        "## Reference, not measured here",
        "",
        "Observed by others on a machine of the same kind (for context only):",
        "",
        *(f"- {what}: {value}" for what, value in TF_REFERENCE),
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


def _parse_cpus(text: str) -> set[int]:
    try:
        return {int(part) for part in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad CPU list {text!r} (e.g. 0 or 0,1)") from None


def _parse_sizes(text: str) -> list[int]:
    if text.strip().lower() in ("", "none", "off"):
        return []
    return [_parse_size(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["cluster-up"], help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=2000, help="timed round trips per path")
    parser.add_argument("--warmup", type=int, default=200, help="untimed round trips per path")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds of round trips")
    parser.add_argument("--transfers", type=int, default=8, help="timed bulk transfers per path")
    parser.add_argument("--rate-threads", type=int, default=8,
                        help="client threads of the 1 KiB calls/s paths")
    parser.add_argument("--rate-seconds", type=float, default=1.0,
                        help="seconds of each calls/s round")
    parser.add_argument("--rate-rounds", type=int, default=5,
                        help="interleaved calls/s rounds per path")
    parser.add_argument("--size-mib", type=int, default=64, help="bulk transfer size in MiB")
    parser.add_argument("--repeats", type=int, default=5, help="import timing repeats")
    parser.add_argument("--cluster-repeats", type=int, default=3, help="cluster start-ups")
    parser.add_argument("--chunk-bytes", type=_parse_sizes, default="256K,1M,2M,4M,8M",
                        help="grpc chunk_bytes values to sweep for the direct get "
                             "(comma-separated, K/M suffixes; 'none' skips the sweep)")
    parser.add_argument("--baseline-chunk", type=_parse_size, default=MIB,
                        help="chunk size of the bare grpcio stream baseline")
    parser.add_argument("--cpus", type=_parse_cpus,
                        help="run this process and every process it starts on these CPUs only "
                             "(e.g. 0 or 0,1; default: no pinning)")
    parser.add_argument("--no-tensorflow", dest="tensorflow", action="store_false",
                        help="skip the TensorFlow rows (measured only where tensorflow is "
                             "importable)")
    parser.add_argument("--output", help="report path (default bench/results/session-<time>.md)")
    args = parser.parse_args(argv)
    if args.role == "cluster-up":
        _cluster_up_child()
        return 0
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)  # inherited by every child process

    started = time.perf_counter()
    now = datetime.datetime.now()
    shown = sys.argv[1:] if argv is None else argv
    env = {"when": now.strftime("%Y-%m-%d %H:%M:%S"), "git": git_state(),
           "load_start": os.getloadavg()[0],
           "command": " ".join(["python", "bench/bench_session.py", *shown]), **machine()}
    payload = np.frombuffer(_baselines.blob(args.size_mib * MIB), np.uint8)

    def step(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    step("import timings")
    imports = measure_import(args.repeats)
    step("local cluster start-up")
    ups = measure_cluster_up(args.cluster_repeats)
    step("round trips and transfers: raw TCP, bare grpcio, clusterwire direct and forwarded")
    latencies, throughputs, rates, info = measure_transports(args, payload)
    sweep = []
    if args.chunk_bytes:
        step(f"chunk_bytes sweep: {', '.join(_size(c) for c in args.chunk_bytes)}")
        sweep = measure_chunk_sweep(args, payload)
    env["load_end"] = os.getloadavg()[0]
    report = render(args, env, latencies, throughputs, rates, info, sweep, imports, ups,
                    time.perf_counter() - started)
    print(report)
    output = args.output or os.path.join(
        HERE, "results", f"session-{now.strftime('%Y%m%d-%H%M%S')}.md")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w", encoding="utf-8") as handle:
        handle.write(report)
    step(f"report written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
