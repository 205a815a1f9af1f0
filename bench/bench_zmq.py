"""Benchmark of the "zmq" transport (plugins/clusterwire-zmq) next to bare pyzmq, in one run.

Run from the repository root, with the plugin installed::

    python bench/bench_zmq.py

Every server runs in its own process on 127.0.0.1; this process is the client (and
starts the 8 client processes of the concurrency section). Measured in one run:

1. 8-byte round trip, median and p99, interleaved: bare pyzmq REQ/REP and DEALER/ROUTER,
   the transport's raw channel (``Channel.call`` of an 8-byte frame to a listener that
   echoes it), and a Server through a Session (``get`` of an 8-byte array, ``call`` of an
   echo function).
2. 64 MiB transfer, interleaved: bare pyzmq PAIR (sent ``copy=False``, received as a zmq
   frame), the channel (a listener answering with a 64 MiB buffer) and ``Session.get``.
3. 1 KiB calls/s with 8 concurrent clients (8 processes, one connection each, for
   ``--seconds``): bare pyzmq DEALER/ROUTER, the channel, ``Session.call`` of the echo.

Targets (issue 3): the 64 MiB Session.get >= 0.9x bare pyzmq PAIR; the 8-byte round trip
<= 1.5x bare pyzmq's (REQ/REP, the faster bare pattern). The report is printed and
written to bench/results/zmq-<time>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _baselines import ServerProcess, blob  # noqa: E402
from _bench_remote import ECHO  # noqa: E402
from bench_session import (  # noqa: E402
    MIB,
    Latency,
    Throughput,
    child_env,
    git_state,
    interleaved_round_trips,
    interleaved_transfers,
)

HOST = "127.0.0.1"
EIGHT = bytes(range(8))
KIB = bytes(1024)
TARGETS = {"get64_vs_pair": 0.9, "rtt8_vs_bare": 1.5}


# ----------------------------------------------------------------------------- servers


def _serve(role: str, blob_bytes: int) -> None:
    """A bare pyzmq server or a zmq-transport listener; prints ``READY <address>``."""
    import zmq

    if role == "listener":
        from clusterwire.plugins import get_plugin_manager
        from clusterwire.transport import Frame, ListenOptions

        payload = np.frombuffer(blob(blob_bytes), np.uint8)

        def handler(frame: Frame) -> Frame:
            if frame.header == b"blob":
                return Frame(b"", [payload])
            return Frame(frame.header, list(frame.buffers))

        listener = get_plugin_manager().transport("zmq").listen(
            f"{HOST}:0", handler, ListenOptions())
        listener.start()
        print(f"READY {listener.address}", flush=True)
        sys.stdin.read()  # serve until the benchmark closes our stdin
        listener.stop(0)
        return
    context = zmq.Context(io_threads=1)
    kind = {"bare-rep": zmq.REP, "bare-router": zmq.ROUTER, "bare-pair": zmq.PAIR}[role]
    sock = context.socket(kind)
    sock.linger = 0
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    print(f"READY {HOST}:{port}", flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    if role == "bare-rep":
        while True:
            sock.send(sock.recv())
    elif role == "bare-router":
        while True:
            sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
    else:
        payload = blob(blob_bytes)
        while True:
            sock.recv()
            sock.send(payload, copy=False)


class Process(ServerProcess):
    """A child process of this script; ``address`` is what it printed after READY."""

    def __init__(self, *args: str, timeout: float = 60):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        if not lines or not lines[0].startswith("READY "):
            self.close()
            raise RuntimeError(f"{args} did not start: {lines}")
        self.address = lines[0].split()[1]


# ----------------------------------------------------------------------------- clients


def _bare_socket(context, kind: int, address: str):
    sock = context.socket(kind)
    sock.linger = 0
    sock.connect(f"tcp://{address}")
    return sock


def _load_client(kind: str, address: str, seconds: float, start_at: float) -> None:
    """One of the concurrent clients: 1 KiB calls until ``start_at + seconds``; prints N."""
    import zmq

    from clusterwire import Session
    from clusterwire.plugins import get_plugin_manager
    from clusterwire.transport import Frame

    if kind == "bare":
        sock = _bare_socket(zmq.Context(), zmq.DEALER, address)

        def one() -> None:
            sock.send(KIB)
            sock.recv()
    elif kind == "channel":
        channel = get_plugin_manager().transport("zmq").connect(address)

        def one() -> None:
            channel.call(Frame(b"", [KIB]), timeout=30)
    else:
        session = Session(address, timeout=30)

        def one() -> None:
            session.call(ECHO, KIB)
    for _ in range(50):
        one()
    time.sleep(max(0.0, start_at - time.time()))  # all clients start together
    count, end = 0, start_at + seconds
    while time.time() < end:
        one()
        count += 1
    print(f"COUNT {count}", flush=True)
    os._exit(0)


def calls_per_second(kind: str, address: str, clients: int, seconds: float) -> float:
    """Total calls/s of ``clients`` processes calling ``address`` at once."""
    start_at = time.time() + 3.0  # time for every client to start and warm up
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "load",
                               "--kind", kind, "--address", address, "--seconds",
                               str(seconds), "--start-at", str(start_at)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ,
                                                                      **child_env()})
             for _ in range(clients)]
    total = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 60)
        counts = [int(line.split()[1]) for line in out.splitlines() if line.startswith("COUNT")]
        if proc.returncode != 0 or not counts:
            raise RuntimeError(f"load client ({kind}) failed: {out!r}")
        total += counts[0]
    return total / seconds


# ----------------------------------------------------------------------------- the run


def measure(args: argparse.Namespace) -> tuple[list[Latency], list[Throughput], dict, dict]:
    import zmq

    from clusterwire import Session
    from clusterwire.local_cluster import LocalCluster
    from clusterwire.plugins import get_plugin_manager
    from clusterwire.transport import Frame

    nbytes = args.size_mib * MIB
    expected = np.frombuffer(blob(nbytes), np.uint8)
    with contextlib.ExitStack() as stack:
        servers = {role: Process("--role", role, "--blob-bytes", str(nbytes))
                   for role in ("bare-rep", "bare-router", "bare-pair", "listener")}
        for server in servers.values():
            stack.callback(server.close)
        cluster = stack.enter_context(LocalCluster(
            {"worker": 1}, protocol="zmq", imports=["_bench_remote"], env=child_env()))
        context = zmq.Context(io_threads=1)
        stack.callback(context.term)
        rep = _bare_socket(context, zmq.REQ, servers["bare-rep"].address)
        router = _bare_socket(context, zmq.DEALER, servers["bare-router"].address)
        pair = _bare_socket(context, zmq.PAIR, servers["bare-pair"].address)
        for sock in (rep, router, pair):
            stack.callback(sock.close)
        channel = get_plugin_manager().transport("zmq").connect(servers["listener"].address)
        stack.callback(channel.close)
        session = stack.enter_context(Session(cluster.target("worker", 0), timeout=60))
        session.put("small", np.frombuffer(EIGHT, np.uint8))
        session.put("big", expected)
        info = session.status()["transport"]

        def bare_rep() -> bytes:
            rep.send(EIGHT)
            return rep.recv()

        def bare_router() -> bytes:
            router.send(EIGHT)
            return router.recv()

        def bare_pair():
            pair.send(b"B")
            return pair.recv(copy=False).buffer

        small = {
            ("bare pyzmq REQ/REP", "send/recv"): bare_rep,
            ("bare pyzmq DEALER/ROUTER", "send/recv"): bare_router,
            ("zmq transport", "Channel.call"): lambda: channel.call(Frame(b"", [EIGHT]), 30),
            ("clusterwire over zmq", "Session.get"): lambda: session.get("small"),
            ("clusterwire over zmq", "Session.call (echo)"): lambda: session.call(ECHO, EIGHT),
        }
        samples = interleaved_round_trips(small, args.iterations, args.warmup, args.rounds)
        latencies = [Latency(name, how, samples[name, how]) for name, how in small]

        big = {
            ("bare pyzmq PAIR, copy=False", "send/recv"): bare_pair,
            ("zmq transport", "Channel.call"):
                lambda: channel.call(Frame(b"blob", []), 60).buffers[0],
            ("clusterwire over zmq", "Session.get"): lambda: session.get("big"),
        }

        def check(got: object) -> bool:
            return np.array_equal(np.frombuffer(got, np.uint8), expected)

        seconds = interleaved_transfers(big, check, args.transfers)
        throughputs = [Throughput(name, how, nbytes, seconds[name, how]) for name, how in big]

        rates = {
            ("bare pyzmq DEALER/ROUTER", "send/recv"):
                calls_per_second("bare", servers["bare-router"].address, args.clients,
                                 args.seconds),
            ("zmq transport", "Channel.call"):
                calls_per_second("channel", servers["listener"].address, args.clients,
                                 args.seconds),
            ("clusterwire over zmq", "Session.call (echo)"):
                calls_per_second("session", cluster.target("worker", 0), args.clients,
                                 args.seconds),
        }
    return latencies, throughputs, rates, info


# ----------------------------------------------------------------------------- report


def _met(ok: bool) -> str:
    return "met" if ok else "**NOT met**"


def render(args: argparse.Namespace, latencies: list[Latency], throughputs: list[Throughput],
           rates: dict, info: dict, elapsed: float) -> str:
    import zmq

    rep_us = latencies[0].median_us
    router_us = latencies[1].median_us
    pair_gbs = throughputs[0].median_gbs
    lines = [
        f"# clusterwire zmq transport benchmark, {datetime.datetime.now():%Y-%m-%d %H:%M:%S}",
        "",
        f"Command: `python bench/bench_zmq.py {' '.join(sys.argv[1:])}` ({elapsed:.0f} s). "
        "Loopback 127.0.0.1; every server in its own process.",
        "",
        f"- clusterwire commit: {git_state()}",
        f"- {len(os.sched_getaffinity(0))} usable CPUs; {platform.system()} "
        f"{platform.release()}; Python {platform.python_version()}; pyzmq {zmq.__version__}, "
        f"libzmq {zmq.zmq_version()}",
        f"- transport, as `status()` reports it: {info}",
        f"- {args.iterations} timed round trips per path in {args.rounds} interleaved rounds "
        f"after {args.warmup} warm-up calls; {args.transfers} timed {args.size_mib} MiB "
        f"transfers per path, interleaved; {args.clients} client processes for "
        f"{args.seconds:g} s per path.",
        "",
        "## 8-byte round trip",
        "",
        "| Path | Call | Median (us) | p99 (us) | x REQ/REP | x DEALER/ROUTER |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in latencies:
        lines.append(f"| {row.name} | {row.topology} | {row.median_us:.0f} | {row.p99_us:.0f} "
                     f"| {row.median_us / rep_us:.2f}x | {row.median_us / router_us:.2f}x |")
    lines += [
        "",
        f"## {args.size_mib} MiB transfer (GB/s = 1e9 B/s)",
        "",
        "| Path | Call | Median GB/s | Min-max GB/s | x bare PAIR |",
        "|---|---|---:|---:|---:|",
    ]
    for row in throughputs:
        low, high = row.range_gbs
        lines.append(f"| {row.name} | {row.topology} | {row.median_gbs:.2f} | "
                     f"{low:.2f}-{high:.2f} | {row.median_gbs / pair_gbs:.2f}x |")
    bare_rate = next(iter(rates.values()))
    lines += [
        "",
        f"## 1 KiB calls/s, {args.clients} concurrent client processes",
        "",
        "| Path | Call | Calls/s | x bare |",
        "|---|---|---:|---:|",
    ]
    for (name, how), rate in rates.items():
        lines.append(f"| {name} | {how} | {rate:,.0f} | {rate / bare_rate:.2f}x |")
    get64 = throughputs[2].median_gbs / pair_gbs
    channel8 = latencies[2].median_us / rep_us
    get8 = latencies[3].median_us / rep_us
    target = TARGETS["rtt8_vs_bare"]
    lines += [
        "",
        "## Targets",
        "",
        "| Target | Measured | |",
        "|---|---:|---|",
        f"| {args.size_mib} MiB Session.get >= {TARGETS['get64_vs_pair']}x bare pyzmq PAIR "
        f"| {get64:.2f}x | {_met(get64 >= TARGETS['get64_vs_pair'])} |",
        f"| 8-byte Channel.call <= {target}x bare pyzmq REQ/REP | {channel8:.2f}x "
        f"| {_met(channel8 <= target)} |",
        f"| 8-byte Session.get <= {target}x bare pyzmq REQ/REP | {get8:.2f}x "
        f"| {_met(get8 <= target)} |",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["bare-rep", "bare-router", "bare-pair", "listener",
                                           "load"], help=argparse.SUPPRESS)
    parser.add_argument("--blob-bytes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=2000, help="timed round trips per path")
    parser.add_argument("--warmup", type=int, default=200, help="untimed round trips per path")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--transfers", type=int, default=8, help="timed transfers per path")
    parser.add_argument("--size-mib", type=int, default=64, help="bulk transfer size")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client processes")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per calls/s path")
    parser.add_argument("--output", help="report path (default bench/results/zmq-<time>.md)")
    args = parser.parse_args(argv)
    if args.role == "load":
        _load_client(args.kind, args.address, args.seconds, args.start_at)
        return 0
    if args.role:
        _serve(args.role, args.blob_bytes)
        return 0
    started = time.perf_counter()
    latencies, throughputs, rates, info = measure(args)
    report = render(args, latencies, throughputs, rates, info, time.perf_counter() - started)
    print(report)
    output = args.output or os.path.join(
        HERE, "results", f"zmq-{datetime.datetime.now():%Y%m%d-%H%M%S}.md")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w", encoding="utf-8") as handle:
        handle.write(report)
    print(f"report written to {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
