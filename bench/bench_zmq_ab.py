"""A/B of two trees of the zmq plugin in one run: 8-byte round trips, interleaved.

Run from the repository root::

    git archive HEAD plugins/clusterwire-zmq | tar -x -C /tmp/before
    python bench/bench_zmq_ab.py --before /tmp/before/plugins/clusterwire-zmq

``--before`` and ``--after`` (default: this checkout's plugin) are plugin directories, put
first on ``PYTHONPATH`` of the processes that use them. Every server and every client is
a process of its own (two versions of the plugin cannot share one), all on 127.0.0.1:
bare pyzmq REQ/REP and DEALER/ROUTER, then for each tree ``Channel.call`` of an 8-byte
frame to an echoing listener and ``Session.get`` of an 8-byte array from a ``Server``.
This process tells the clients, in turn, to make ``--per`` timed calls, ``--rounds``
times (the order rotating), and prints per path the median, its ratio to REQ/REP, and
the CPU a call took in the client and in the server's process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
AFTER = os.path.join(os.path.dirname(HERE), "plugins", "clusterwire-zmq")
HOST = "127.0.0.1"
EIGHT = bytes(range(8))


def _env(plugin: str | None) -> dict[str, str] | None:
    if plugin is None:
        return None
    paths = [plugin] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _cpu_seconds(pid: int) -> float:
    """User and system CPU of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serve(role: str) -> None:
    """A server; prints ``READY <address> <plugin file or ->``, serves until stdin closes."""
    import zmq

    if role in ("listener", "server"):
        import clusterwire_zmq

        from clusterwire import Server
        from clusterwire.plugins import get_plugin_manager
        from clusterwire.transport import Frame, ListenOptions

        if role == "server":
            server = Server({"worker": [f"{HOST}:0"]}, protocol="zmq")
            server.start()
            address, stop = server.target, server.stop
        else:
            listener = get_plugin_manager().transport("zmq").listen(
                f"{HOST}:0", lambda frame: Frame(frame.header, list(frame.buffers)),
                ListenOptions())
            listener.start()
            address, stop = listener.address, lambda: listener.stop(0)
        print(f"READY {address} {clusterwire_zmq.__file__}", flush=True)
        sys.stdin.read()
        stop()
        return
    context = zmq.Context(io_threads=1)
    sock = context.socket(zmq.REP if role == "rep" else zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    print(f"READY {HOST}:{port} -", flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    if role == "rep":
        while True:
            sock.send(sock.recv())
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def _client(kind: str, address: str) -> None:
    """A client; after warm-up prints READY, then per line ``N`` of stdin makes N timed
    calls and prints its CPU seconds and each call's nanoseconds."""
    import zmq

    where = "-"
    if kind in ("channel", "session"):
        import clusterwire_zmq
        where = clusterwire_zmq.__file__
    if kind == "channel":
        from clusterwire.plugins import get_plugin_manager
        from clusterwire.transport import Frame

        channel = get_plugin_manager().transport("zmq").connect(address)
        frame = Frame(b"", [EIGHT])

        def call() -> object:
            return channel.call(frame, 30)
    elif kind == "session":
        import numpy as np

        from clusterwire import Session

        session = Session(address, timeout=30)
        session.put("small", np.frombuffer(EIGHT, np.uint8))

        def call() -> object:
            return session.get("small")
    else:
        sock = zmq.Context(io_threads=1).socket(zmq.REQ if kind == "req" else zmq.DEALER)
        sock.linger = 0
        sock.connect(f"tcp://{address}")

        def call() -> object:
            sock.send(EIGHT)
            return sock.recv()
    for _ in range(200):
        call()
    print(f"READY - {where}", flush=True)
    clock = time.perf_counter_ns
    for line in sys.stdin:
        times = []
        cpu = time.thread_time()
        for _ in range(int(line)):
            started = clock()
            call()
            times.append(clock() - started)
        print(time.thread_time() - cpu, *times, flush=True)


def _spawn(args: list[str], plugin: str | None = None) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=_env(plugin))
    line = proc.stdout.readline().split()
    if len(line) != 3 or line[0] != "READY":
        proc.kill()
        raise RuntimeError(f"{args} did not start")
    return proc, line[1], line[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--before", help="plugin directory of the A side (required)")
    parser.add_argument("--after", default=AFTER, help="plugin directory of the B side")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--per", type=int, default=200, help="timed calls per path a round")
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve)
        return 0
    if args.client:
        _client(*args.client)
        return 0
    if not args.before:
        parser.error("--before DIR is required (a plugin tree, e.g. from git archive)")
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    servers = {"rep": _spawn(["--serve", "rep"]), "router": _spawn(["--serve", "router"])}
    clients = {"bare REQ/REP": (_spawn(["--client", "req", servers["rep"][1]]), "rep"),
               "bare DEALER/ROUTER": (_spawn(["--client", "dealer", servers["router"][1]]),
                                      "router")}
    for side, tree in trees.items():
        for role, kind, call in (("listener", "channel", "Channel.call"),
                                 ("server", "session", "Session.get")):
            server = _spawn(["--serve", role], tree)
            servers[f"{side} {role}"] = server
            clients[f"{side}: {call}"] = (_spawn(["--client", kind, server[1]], tree),
                                          f"{side} {role}")
    try:
        for name, ((_, _, where), server) in clients.items():
            print(f"{name}: client {where}, server {servers[server][2]}")
        samples: dict[str, list[int]] = {name: [] for name in clients}
        client_cpu = dict.fromkeys(clients, 0.0)
        server_cpu = dict.fromkeys(clients, 0.0)
        names = list(clients)
        load = os.getloadavg()[0]
        for index in range(args.rounds):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                (proc, _, _), server = clients[name]
                pid = servers[server][0].pid
                before = _cpu_seconds(pid)
                proc.stdin.write(f"{args.per}\n")
                proc.stdin.flush()
                fields = proc.stdout.readline().split()
                server_cpu[name] += _cpu_seconds(pid) - before
                client_cpu[name] += float(fields[0])
                samples[name] += [int(value) for value in fields[1:]]
        calls = args.rounds * args.per
        rep = statistics.median(samples[names[0]])
        print(f"1-minute load {load:.1f} at start, {os.getloadavg()[0]:.1f} at end; "
              f"{args.rounds} rounds of {args.per} calls per path")
        for name in names:
            median = statistics.median(samples[name])
            print(f"{name:28s} median {median / 1000:7.1f} us  {median / rep:5.2f}x REQ/REP  "
                  f"CPU a call: client {client_cpu[name] / calls * 1e6:6.1f} us, server "
                  f"process {server_cpu[name] / calls * 1e6:6.1f} us")
    finally:
        for (proc, _, _), _ in clients.values():
            proc.stdin.close()
        for proc, _, _ in servers.values():
            proc.stdin.close()
        for proc, _, _ in [*servers.values(), *(client for client, _ in clients.values())]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
