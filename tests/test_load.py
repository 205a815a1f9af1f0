"""Load: 64 concurrent clients doing mixed put/get/call against one server, per protocol.

The full-size run (2,000 requests per client) is ``bench/bench_load.py``; CI runs a
scaled-down round (set CLUSTERWIRE_LOAD_REQUESTS to change it) with the same checks:
zero errors, every value read back as written, the server's memory back near its
baseline and its threads within the configured pools afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

from clusterwire.local_cluster import LocalCluster
from clusterwire.testing.load import process_usage, run_load

PROTOCOLS = ["grpc", "grpc+local"] + [
    protocol for protocol, module in (("grpc+verbs", "ucxx"), ("zmq", "clusterwire_zmq"))
    if importlib.util.find_spec(module) is not None]
REQUESTS = int(os.environ.get("CLUSTERWIRE_LOAD_REQUESTS", "60"))
# A server's threads: main, the transport's handler pool (max_workers, 16 by default)
# and a control pool, plus the transport library's own (gRPC event engine, UCX engine,
# zmq I/O threads): pools grow to their configured size and stay; anything beyond
# this ceiling is a leak.
THREAD_CEILING = 1 + 16 + 16 + 16


def settled_usage(pid: int) -> tuple[int, int]:
    """Usage once the server's transient threads wound down (bounded wait)."""
    deadline = time.monotonic() + 15
    rss, threads = process_usage(pid)
    while threads > THREAD_CEILING and time.monotonic() < deadline:
        time.sleep(0.1)  # polling a /proc counter, not synchronising with the server
        rss, threads = process_usage(pid)
    return rss, threads


@pytest.mark.timeout(300)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_64_concurrent_clients(protocol):
    with LocalCluster({"w": 1}, protocol=protocol,
                      imports=["clusterwire.testing.load"]) as cluster:
        target, pid = cluster.target("w"), cluster.process("w").pid
        # Same shape, smaller: thread pools grow to their configured size and stay there.
        warm = run_load(target, clients=64, requests_per_client=30)
        assert not warm.errors, warm.errors[:3]
        rss_before, _ = process_usage(pid)
        result = run_load(target, clients=64, requests_per_client=REQUESTS)
        assert not result.errors, result.errors[:5]
        assert result.mismatches == 0
        assert result.requests == 64 * (REQUESTS // 3) * 3
        rss_after, threads_after = settled_usage(pid)
        assert threads_after <= THREAD_CEILING
        assert rss_after - rss_before < 64 << 20
