"""The grpc fast lane under TLS against gRPC with TLS and the plain lane (issue 34).

Three one-task clusters (a task process each, on 127.0.0.1), this process the client of
all three, their calls interleaved round by round so that the machine's load falls on each
alike:

- ``grpc+TLS``: the grpc transport with TLS, ``fast_lane = false`` (every call on gRPC);
- ``TLS lane``: the same with ``fast_lane = true`` (small calls on the lane inside TLS);
- ``plain lane``: ``fast_lane = true`` without TLS.

Measured: the median of 8-byte ``Session.get`` calls, and 64 MiB ``Session.get`` (the
response fetched as a gRPC chunk stream under TLS, from the bulk port without). Prints a
Markdown table with the load (``os.getloadavg``) before and after. Run it under
``nice -n 19``::

    nice -n 19 python bench/bench_lane_tls.py [--calls 2000] [--rounds 5] [--big-rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from clusterwire import Session
from clusterwire.local_cluster import LocalCluster
from clusterwire.plugins import PluginManager, set_plugin_manager
from clusterwire.testing.certs import Authority
from clusterwire.transports.grpc import lane

VARIANTS = ("grpc+TLS", "TLS lane", "plain lane")
_MiB = 1 << 20


@contextlib.contextmanager
def variant_session(name: str, directory: str, authority: Authority) -> Iterator[Session]:
    """A Session to a one-task cluster of ``name``'s kind."""
    tls = name != "plain lane"
    path = os.path.join(directory, f"{name.replace(' ', '_').replace('+', '_')}.toml")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(f"[options.grpc]\nfast_lane = {'false' if name == 'grpc+TLS' else 'true'}\n")
    config = None
    if tls:
        pair = authority.issue(f"server-{len(os.listdir(directory))}")
        config = {"tls_cert_file": str(pair.cert), "tls_key_file": str(pair.key),
                  "tls_ca_file": str(authority.pair.cert)}
    with LocalCluster({"worker": 1}, env={"CLUSTERWIRE_PLUGINS": path}, config=config) as cluster:
        previous = set_plugin_manager(PluginManager(path))
        try:  # the Session keeps the transport it was created with
            session = Session(cluster.target("worker", 0), config={
                "tls_ca_file": str(authority.pair.cert)} if tls else None)
        finally:
            set_plugin_manager(previous)
        with session:
            yield session


def lane_calls() -> int:
    """Calls answered over any lane of this process so far."""
    return sum(client.calls for client in list(lane._clients))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="8-byte gets per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--big-rounds", type=int, default=3, help="64 MiB gets per variant")
    args = parser.parse_args()
    small = np.arange(8, dtype=np.uint8)
    big = np.random.default_rng(0).integers(0, 255, 64 * _MiB, dtype=np.uint8)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cw-bench-lane-tls-") as directory, \
            contextlib.ExitStack() as stack:
        authority = Authority(Path(directory))
        sessions = {name: stack.enter_context(variant_session(name, directory, authority))
                    for name in VARIANTS}
        lane_used: dict[str, int] = {}
        for name, session in sessions.items():
            session.put("small", small)
            session.put("big", big)
            before = lane_calls()
            for _ in range(100):  # warm up: connections, lane tickets
                assert np.array_equal(session.get("small"), small)
            lane_used[name] = lane_calls() - before
            assert np.array_equal(session.get("big"), big), name
        small_us: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, session in sessions.items():
                for _ in range(args.calls):
                    started = time.perf_counter()
                    session.get("small")
                    small_us[name].append((time.perf_counter() - started) * 1e6)
        big_s: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.big_rounds):
            for name, session in sessions.items():
                started = time.perf_counter()
                session.get("big")
                big_s[name].append(time.perf_counter() - started)
    load_after = os.getloadavg()
    print(f"load (1/5/15 min) before {load_before[0]:.1f}/{load_before[1]:.1f}/"
          f"{load_before[2]:.1f}, after {load_after[0]:.1f}/{load_after[1]:.1f}/"
          f"{load_after[2]:.1f}; {args.rounds} rounds x {args.calls} 8-byte gets, "
          f"{args.big_rounds} 64 MiB gets per variant, interleaved\n")
    print("| path | 8 B get, median us | p90 us | 64 MiB get, median s (MB/s) | warm-up "
          "calls on a lane |")
    print("|---|---|---|---|---|")
    for name in VARIANTS:
        times = sorted(small_us[name])
        median_big = statistics.median(big_s[name])
        print(f"| {name} | {statistics.median(times):.0f} | "
              f"{times[int(0.9 * len(times))]:.0f} | {median_big:.3f} "
              f"({64 * _MiB / median_big / 1e6:.0f}) | {lane_used[name]} of 100 |")


if __name__ == "__main__":
    main()
