"""The dispatcher at scale: its CPU and memory with N workers and M consumers (issue 33).

    nice -n 19 python bench/bench_dispatcher_scale.py [--sizes 10,100,1000] [--procs 4]
        [--threads 8] [--warmup 8] [--measure 20] [--split-every 2.0] [--fast-lane]
        [--old-consumers] [--consumer-heartbeat-rate N] [--json]

For each size n, one real dispatcher process (``DispatchServer``, default config, a worker
token file) serves n light workers and n light consumers. They are logical peers of
``--procs`` client processes (``--threads`` threads each, every thread with its own
dispatcher channel, taking turns among its peers by due time), and they speak the real
protocol at the real intervals:

* a worker registers with a ``WorkerHeartbeatRequest`` (its WorkerInfo, the worker token),
  then heartbeats every ``heartbeat_interval_ms`` (the runtime default), at a phase of its own;
* half the consumers read one named distributed_epoch job of ``range``: each gets the job
  (``GetOrCreateJobRequest``), heartbeats every ``reader.TIMINGS.heartbeat_s`` and asks for its next
  split every ``--split-every`` seconds, acknowledging the one it held (``held``/``done`` as
  the reader sends them); the other half read one named parallel_epochs job and poll its
  state with heartbeats only. As the reader's, a consumer's heartbeat names the version of
  the worker list it holds, so only a changed list is sent, and it heartbeats at the longer
  of its own interval and the dispatcher's floor (past its ``consumer_heartbeat_rate``
  limit, which ``--consumer-heartbeat-rate`` sets). ``--old-consumers``: consumers from
  before both, sending no version (every reply carries the whole list) and keeping their
  own interval. The replies' mean size is reported.

Nothing reads elements (the workers' addresses are names, never dialled): what is measured is
the dispatcher alone. After every peer is registered and ``--warmup`` seconds more, the
dispatcher's CPU time (utime + stime from /proc/PID/stat) over ``--measure`` seconds of wall
time is its share of a core; beside it its RSS, the requests the peers sent in that window
(per kind), the dispatcher's CPU per request, and the requests per second the intervals ask
for (``planned_requests_per_s``): on a loaded machine the peers may fall behind them (their
worst lag is reported), and ``cpu_pct_at_planned_rate`` is then the CPU per request measured
times the planned rate, a projection, not a measurement. ``--fast-lane``: every process runs
the grpc transport with ``fast_lane = true`` (a plugins.toml of its own, README "Fast
paths"). ``--json`` prints one line: the sizes' rows.

``--real K`` measures real processes instead, as many as the machine takes (at most 3 + 3
beside the dispatcher and this one): K ``WorkerServer`` processes and K consumer processes,
each iterating ``distribute`` of the same jobs (half distributed_epoch, half parallel_epochs)
and reading elements all along; the requests are the dispatcher's own count
(``clusterwire_requests_total``, from its status), so its CPU per request can be set beside
the light peers' at the same size.
Every process started here is stopped at the end, also on error.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

from clusterwire import data, errors
from clusterwire.data import reader, worker_auth
from clusterwire.data.config import HEARTBEAT_INTERVAL_MS, DispatcherConfig
from clusterwire.data.modes import ShardingPolicy
from clusterwire.data.quotas import ServiceLimits
from clusterwire.data.rpc import DispatcherClient
from clusterwire.protos.data_service_pb2 import (
    ClientHeartbeatRequest,
    DataRequest,
    GetOrCreateJobRequest,
    GetSplitRequest,
    WorkerHeartbeatRequest,
    WorkerInfo,
)
from clusterwire.security import load_security

_JOBS = {"distributed_epoch": ShardingPolicy.DYNAMIC, "parallel_epochs": ShardingPolicy.OFF}
_CLIENT_TIMEOUT_S = 60.0
_TICKS = os.sysconf("SC_CLK_TCK")


# ---- the dispatcher process ----

def _serve_dispatcher(protocol: str, token_file: str, rate: int) -> None:
    """Serve a dispatcher (``rate``: its consumer_heartbeat_rate limit) until stdin closes;
    print its port first."""
    server = data.DispatchServer(DispatcherConfig(
        port=0, protocol=protocol, worker_token_file=token_file, bind_address="127.0.0.1",
        limits={"consumer_heartbeat_rate": rate}))
    print(server.config.port, flush=True)
    sys.stdin.read()
    server.stop()


# ---- the peers' processes ----

class _Peers:
    """One thread's logical peers, each with its due time and what it does then."""

    def __init__(self, client: DispatcherClient, token: bytes, interval_s: float,
                 split_every: float, counts: Counter, lock: threading.Lock):
        self.client, self.token = client, token
        self.worker_s, self.split_every = interval_s, split_every
        self.counts, self.lock = counts, lock
        self.due: list[tuple[float, int, Any]] = []
        self.serial = 0
        self.lag = 0.0  # the most a request started after its due time
        self.floor_s = 0.0  # the longest heartbeat interval the dispatcher told a consumer

    def at(self, when: float, action: Any) -> None:
        self.serial += 1
        heapq.heappush(self.due, (when, self.serial, action))

    def call(self, request: DataRequest):
        kind = request.WhichOneof("kind")
        try:
            response, _ = self.client.call(request)
        except errors.OpError as err:
            with self.lock:
                self.counts[f"error:{kind}:{type(err).__name__}"] += 1
            return None
        with self.lock:
            self.counts[kind] += 1
        return response

    def run(self, stop: threading.Event) -> None:
        while self.due and not stop.is_set():
            when, _, action = self.due[0]
            wait = when - time.monotonic()
            if wait > 0 and stop.wait(wait):
                return
            heapq.heappop(self.due)
            self.lag = max(self.lag, time.monotonic() - when)
            action(when)


def _worker(peers: _Peers, index: int, protocol: str) -> Any:
    request = DataRequest(worker_heartbeat=WorkerHeartbeatRequest(
        worker=WorkerInfo(address=f"light-worker-{index}:1", protocol=protocol),
        worker_token=peers.token))

    def beat(when: float) -> None:
        peers.call(request)
        peers.at(when + peers.worker_s, beat)
    return beat


def _consumer(peers: _Peers, index: int, job: dict[str, Any], old: bool) -> list[Any]:
    """The actions of one consumer of ``job`` (its id and policy), each rescheduling itself;
    unless ``old``, its heartbeats name the worker list it holds and it heartbeats no faster
    than the dispatcher says, as the reader does."""
    consumer = f"light-consumer-{index}"
    heartbeat = ClientHeartbeatRequest(job_id=job["job_id"], consumer_id=consumer)
    held: list[int] = []
    floor_s = [0.0]

    def beat(when: float) -> None:
        response = peers.call(DataRequest(client_heartbeat=heartbeat))
        if response is not None:
            reply = response.client_heartbeat
            with peers.lock:
                peers.counts["heartbeat_reply_bytes"] += reply.ByteSize()
            if not old:
                heartbeat.workers_version = reply.workers_version
                floor_s[0] = reply.heartbeat_interval_ms / 1000
                peers.floor_s = max(peers.floor_s, floor_s[0])
        peers.at(when + max(reader.TIMINGS.heartbeat_s, floor_s[0]), beat)

    def split(when: float) -> None:
        response = peers.call(DataRequest(get_split=GetSplitRequest(
            job_id=job["job_id"], consumer_id=consumer, done=held)))
        held.clear()
        if response is not None and response.get_split.has_split:
            held.append(response.get_split.split.split_id)
        peers.at(when + peers.split_every, split)

    if job["policy"] == ShardingPolicy.DYNAMIC:
        return [beat, split]
    return [beat]


def _run_peers(args: argparse.Namespace) -> None:
    """Run this process's share of the peers until stdin closes; print their counts."""
    with open(args.token_file, "rb") as handle:
        token = handle.read().strip()
    jobs = json.loads(args.jobs)
    security = load_security({})
    counts: Counter = Counter()
    lock = threading.Lock()
    interval_s = HEARTBEAT_INTERVAL_MS / 1000
    threads = [_Peers(DispatcherClient(args.protocol, args.address, _CLIENT_TIMEOUT_S,
                                       security), token, interval_s, args.split_every,
                      counts, lock) for _ in range(args.threads)]
    rng = random.Random(args.index)
    now = time.monotonic()
    workers = range(args.index, args.workers, args.of)
    consumers = range(args.index, args.consumers, args.of)
    # Registration first (every worker's first heartbeat, every consumer's job), then each
    # action at a phase of its own within its interval, as peers started at different times.
    for slot, index in enumerate(workers):
        peers = threads[slot % len(threads)]
        action = _worker(peers, index, args.protocol)
        peers.at(now, lambda when, a=action, p=peers: a(time.monotonic() - rng.random()
                                                        * p.worker_s))
    for slot, index in enumerate(consumers):
        peers = threads[slot % len(threads)]
        job = jobs[index % len(jobs)]
        response = peers.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
            dataset_id=job["dataset_id"], sharding_policy=job["policy"], job_key=job["key"],
            named=True, consumer_id=f"light-consumer-{index}")))
        job = {**job, "job_id": response.job.job_id}
        for action, every in zip(_consumer(peers, index, job, args.old_consumers),
                                 (reader.TIMINGS.heartbeat_s, args.split_every), strict=False):
            peers.at(now + rng.random() * every, action)
    stop = threading.Event()
    running = [threading.Thread(target=p.run, args=(stop,), daemon=True) for p in threads]
    for thread in running:
        thread.start()
    print("ready", flush=True)
    sys.stdin.readline()  # "count": the window starts
    with lock:
        before = Counter(counts)
    sys.stdin.readline()  # "count": the window ends
    with lock:
        window = Counter(counts)
    window.subtract(before)
    print(json.dumps({"counts": dict(window), "lag_s": max(p.lag for p in threads),
                      "floor_s": max(p.floor_s for p in threads)}), flush=True)
    sys.stdin.read()
    stop.set()
    for thread in running:
        thread.join(5)
    for peers in threads:
        peers.client.close()


# ---- real processes (--real) ----

def _serve_worker(address: str, protocol: str, token_file: str) -> None:
    """Serve a real worker until stdin closes."""
    worker = data.WorkerServer(data.WorkerConfig(
        dispatcher_address=address, protocol=protocol, worker_token_file=token_file,
        worker_address="127.0.0.1:%port%"))
    print("ready", flush=True)
    sys.stdin.read()
    worker.stop()


def _consume(address: str, protocol: str, mode: str) -> None:
    """Read the job of ``mode`` from the service until stdin closes."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    dataset = data.Dataset.range(1 << 40).apply(data.distribute(
        mode, f"{protocol}://{address}", job_name=f"scale-{mode}"))
    print("ready", flush=True)
    for _ in dataset:
        if stop.is_set():
            break


def _requests(address: str, protocol: str) -> int:
    """The requests the dispatcher at ``address`` served (its status' own count)."""
    status = data.service_status(f"{protocol}://{address}")
    return int(sum(m.value for m in status.metrics if m.name == "clusterwire_requests_total"))


# ---- the driver ----

def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _load() -> float:
    return os.getloadavg()[0]


def _jobs(address: str, protocol: str) -> list[dict[str, Any]]:
    service = f"{protocol}://{address}"
    dataset_id = data.register_dataset(service, data.Dataset.range(1 << 40))
    return [{"dataset_id": dataset_id, "policy": int(policy), "key": f"scale-{name}/0"}
            for name, policy in _JOBS.items()]


def _measure(n: int, args: argparse.Namespace, token_file: str) -> dict[str, Any]:
    me = os.path.abspath(__file__)
    started: list[subprocess.Popen] = []
    try:
        dispatcher = subprocess.Popen(
            [sys.executable, me, "--role", "dispatcher", "--protocol", args.protocol,
             "--consumer-heartbeat-rate", str(args.consumer_heartbeat_rate),
             "--token-file", token_file], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        started.append(dispatcher)
        # An IP address: "localhost" may be ::1 to gRPC and 127.0.0.1 to the fast lane.
        address = f"127.0.0.1:{int(dispatcher.stdout.readline())}"
        if args.real:
            return _measure_real(args, me, dispatcher, address, token_file, started)
        jobs = _jobs(address, args.protocol)
        idle_cpu = _cpu_s(dispatcher.pid)
        peers = []
        for index in range(args.procs):
            peers.append(subprocess.Popen(
                [sys.executable, me, "--role", "peers", "--index", str(index),
                 "--of", str(args.procs), "--workers", str(n), "--consumers", str(n),
                 "--address", address, "--protocol", args.protocol, "--token-file",
                 token_file, "--jobs", json.dumps(jobs), "--threads", str(args.threads),
                 "--split-every", str(args.split_every),
                 *(["--old-consumers"] if args.old_consumers else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            started.append(peers[-1])
        registering = time.monotonic()
        for process in peers:
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a peer process failed (exit {process.wait()})")
        registered_s = time.monotonic() - registering
        time.sleep(args.warmup)  # the peers' phases spread; the registration burst is over
        loads = [_load()]
        for process in peers:
            process.stdin.write("count\n")
            process.stdin.flush()
        cpu0, wall0 = _cpu_s(dispatcher.pid), time.monotonic()
        time.sleep(args.measure)
        cpu1, wall1 = _cpu_s(dispatcher.pid), time.monotonic()
        for process in peers:
            process.stdin.write("count\n")
            process.stdin.flush()
        loads.append(_load())
        counts: Counter = Counter()
        lag = floor_s = 0.0
        for process in peers:
            report = json.loads(process.stdout.readline())
            counts.update(report["counts"])
            lag, floor_s = max(lag, report["lag_s"]), max(floor_s, report["floor_s"])
        rss = _rss_mib(dispatcher.pid)
        reply_bytes = counts.pop("heartbeat_reply_bytes", 0)
        requests = sum(v for k, v in counts.items() if not k.startswith("error:"))
        cpu = cpu1 - cpu0
        consumer_s = max(reader.TIMINGS.heartbeat_s, floor_s)
        planned = (n / (HEARTBEAT_INTERVAL_MS / 1000) + n / consumer_s
                   + (n + 1) // 2 / args.split_every)
        return {"workers": n, "consumers": n, "dispatcher_cpu_pct": round(
                    100 * cpu / (wall1 - wall0), 2),
                "dispatcher_rss_mib": round(rss, 1),
                "requests_per_s": round(requests / (wall1 - wall0), 1),
                "cpu_us_per_request": round(1e6 * cpu / max(requests, 1), 1),
                "planned_requests_per_s": round(planned, 1),
                "cpu_pct_at_planned_rate": round(100 * cpu / max(requests, 1) * planned, 2),
                "consumer_heartbeat_s": consumer_s,
                "heartbeat_reply_bytes": round(
                    reply_bytes / max(counts.get("client_heartbeat", 0), 1), 1),
                "per_kind": dict(sorted(counts.items())), "max_lag_s": round(lag, 3),
                "registration_s": round(registered_s, 2),
                "registration_cpu_s": round(cpu0 - idle_cpu, 2),
                "load": [round(x, 2) for x in loads]}
    finally:
        for process in reversed(started):  # the peers first, while the dispatcher answers
            with contextlib.suppress(OSError):
                process.stdin.close()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _measure_real(args: argparse.Namespace, me: str, dispatcher: subprocess.Popen,
                  address: str, token_file: str, started: list[subprocess.Popen]
                  ) -> dict[str, Any]:
    """The dispatcher's CPU with ``args.real`` real workers and consumers (``started``
    collects them, for the caller to stop)."""
    common = ["--address", address, "--protocol", args.protocol, "--token-file", token_file]
    for role, count in (("worker", args.real), ("consumer", args.real)):
        for index in range(count):
            mode = list(_JOBS)[index % len(_JOBS)]
            started.append(subprocess.Popen(
                [sys.executable, me, "--role", role, "--mode", mode, *common],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            if started[-1].stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {role} process failed (exit {started[-1].wait()})")
    time.sleep(args.warmup)
    loads = [_load()]
    requests0, cpu0, wall0 = _requests(address, args.protocol), _cpu_s(dispatcher.pid), \
        time.monotonic()
    time.sleep(args.measure)
    cpu1, wall1 = _cpu_s(dispatcher.pid), time.monotonic()
    requests = _requests(address, args.protocol) - requests0 - 1  # less the first status
    loads.append(_load())
    return {"workers": args.real, "consumers": args.real, "real": True,
            "dispatcher_cpu_pct": round(100 * (cpu1 - cpu0) / (wall1 - wall0), 2),
            "dispatcher_rss_mib": round(_rss_mib(dispatcher.pid), 1),
            "requests_per_s": round(requests / (wall1 - wall0), 1),
            "cpu_us_per_request": round(1e6 * (cpu1 - cpu0) / max(requests, 1), 1),
            "load": [round(x, 2) for x in loads]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("driver", "dispatcher", "peers", "worker", "consumer"),
                        default="driver",
                        help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="10,100,1000",
                        help="workers = consumers for each run (comma-separated)")
    parser.add_argument("--procs", type=int, default=4, help="peer processes (at most 6)")
    parser.add_argument("--threads", type=int, default=8, help="threads per peer process")
    parser.add_argument("--warmup", type=float, default=8.0)
    parser.add_argument("--measure", type=float, default=20.0)
    parser.add_argument("--split-every", type=float, default=2.0,
                        help="seconds between a distributed_epoch consumer's split requests")
    parser.add_argument("--protocol", default="grpc")
    parser.add_argument("--fast-lane", action="store_true",
                        help="grpc's fast lane on in every process (README 'Fast paths')")
    parser.add_argument("--old-consumers", action="store_true",
                        help="consumers send no worker list version (every reply carries the "
                             "whole list) and keep their own heartbeat interval")
    parser.add_argument("--consumer-heartbeat-rate", type=int,
                        default=ServiceLimits().consumer_heartbeat_rate,
                        help="the dispatcher's consumer_heartbeat_rate limit")
    parser.add_argument("--real", type=int, default=0,
                        help="K real worker and K real consumer processes (1..3) instead")
    parser.add_argument("--json", action="store_true")
    for name in ("--index", "--of", "--workers", "--consumers"):
        parser.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    for name in ("--address", "--token-file", "--jobs", "--mode"):
        parser.add_argument(name, default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "dispatcher":
        _serve_dispatcher(args.protocol, args.token_file, args.consumer_heartbeat_rate)
        return
    if args.role == "peers":
        _run_peers(args)
        return
    if args.role == "worker":
        _serve_worker(args.address, args.protocol, args.token_file)
        return
    if args.role == "consumer":
        _consume(args.address, args.protocol, args.mode)
        return
    if not 0 <= args.real <= 3:
        parser.error("--real must be 0..3 (with the dispatcher and this one, at most 8 "
                     "processes)")
    if not 1 <= args.procs <= 6:
        parser.error("--procs must be 1..6 (with the dispatcher and this one, at most 8 "
                     "processes)")
    with tempfile.TemporaryDirectory(prefix="bench-dispatcher-") as scratch:
        token = os.path.join(scratch, "worker-token")
        with open(token, "wb") as handle:
            handle.write(worker_auth.new_token())
        if args.fast_lane:
            plugins = os.path.join(scratch, "plugins.toml")
            with open(plugins, "w", encoding="utf-8") as handle:
                handle.write("[options.grpc]\nfast_lane = true\n")
            os.environ["CLUSTERWIRE_PLUGINS"] = plugins  # this process's and its children's
        sizes = [args.real] if args.real else [int(n) for n in args.sizes.split(",")]
        rows = [_measure(n, args, token) for n in sizes]
    if args.json:
        print(json.dumps({"bench": "dispatcher_scale", "procs": args.procs,
                          "fast_lane": args.fast_lane, "old_consumers": args.old_consumers,
                          "consumer_heartbeat_rate": args.consumer_heartbeat_rate,
                          "threads": args.threads, "split_every_s": args.split_every,
                          "worker_heartbeat_s": HEARTBEAT_INTERVAL_MS / 1000,
                          "reader_heartbeat_s": reader.TIMINGS.heartbeat_s, "rows": rows}))
        return
    print(f"dispatcher at scale: {args.procs} peer processes x {args.threads} threads; worker "
          f"heartbeats every {HEARTBEAT_INTERVAL_MS / 1000:g} s, the reader's heartbeat every "
          f"{reader.TIMINGS.heartbeat_s:g} s, a split every {args.split_every:g} s")
    for row in rows:
        if row.get("real"):
            print(f"  {row['workers']} real workers + {row['consumers']} real consumers: "
                  f"dispatcher {row['dispatcher_cpu_pct']:.2f}% of a core, RSS "
                  f"{row['dispatcher_rss_mib']:.0f} MiB, {row['requests_per_s']:.0f} requests/s, "
                  f"{row['cpu_us_per_request']:.0f} us CPU/request, load {row['load']}")
            continue
        print(f"  {row['workers']:>5} workers + {row['consumers']:>5} consumers: dispatcher "
              f"{row['dispatcher_cpu_pct']:6.2f}% of a core, RSS {row['dispatcher_rss_mib']:.0f}"
              f" MiB, {row['requests_per_s']:.0f} requests/s, {row['cpu_us_per_request']:.0f}"
              f" us CPU/request, peers' worst lag {row['max_lag_s']:.2f} s, load "
              f"{row['load']}")
        print(f"        consumer heartbeats every {row['consumer_heartbeat_s']:g} s, their "
              f"replies {row['heartbeat_reply_bytes']:.0f} bytes on average")
        print(f"        the intervals ask for {row['planned_requests_per_s']:.0f} requests/s: "
              f"{row['cpu_pct_at_planned_rate']:.1f}% of a core at the CPU per request measured")
        print(f"        {row['per_kind']}")


if __name__ == "__main__":
    main()
