"""A bounded load generator: many concurrent clients doing mixed put/get/call.

Used by the load test (scaled down) and ``bench/bench_load.py`` (full size).
The server must run ``--import clusterwire.testing.load`` so ``echo`` is
registered there. Every value read back is compared with what was written.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from clusterwire.errors import OpError
from clusterwire.functions import remote
from clusterwire.session import Session


@remote
def echo(value):
    """Return the argument (the load's remote call)."""
    return value


@dataclass
class LoadResult:
    """What a load run did and saw."""

    requests: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    mismatches: int = 0
    latencies_us: list[float] = field(default_factory=list)

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile_us(self, q: float) -> float:
        return float(np.percentile(self.latencies_us, q)) if self.latencies_us else 0.0


def _client(target: str, client: int, rounds: int, value_bytes: int, config,
            result: LoadResult, lock: threading.Lock, deadline: float) -> None:
    latencies, errors, mismatches, done = [], [], 0, 0
    try:
        with Session(target, config=config, timeout=60) as session:
            for step in range(rounds):
                if time.monotonic() > deadline:
                    errors.append(f"client {client}: time budget exhausted at round {step}")
                    break
                value = np.full(value_bytes // 8, client * 1_000_003 + step, np.int64)
                key = f"c{client}-k{step % 4}"
                for op in ("put", "get", "call"):
                    started = time.perf_counter()
                    try:
                        if op == "put":
                            session.put(key, value)
                        elif op == "get":
                            mismatches += not np.array_equal(session.get(key), value)
                        else:
                            mismatches += not np.array_equal(session.call(echo, value), value)
                    except OpError as err:
                        errors.append(f"client {client} {op}: {type(err).__name__}: {err}")
                    latencies.append((time.perf_counter() - started) * 1e6)
                    done += 1
            for slot in range(4):
                session.delete(f"c{client}-k{slot}")
    except OpError as err:
        errors.append(f"client {client}: {type(err).__name__}: {err}")
    with lock:
        result.requests += done
        result.errors += errors
        result.mismatches += mismatches
        result.latencies_us += latencies


def run_load(target: str, clients: int = 64, requests_per_client: int = 2000,
             value_bytes: int = 1024, config=None, budget_seconds: float = 600) -> LoadResult:
    """``clients`` threads, each doing ``requests_per_client`` mixed requests (put/get/call)."""
    result, lock = LoadResult(), threading.Lock()
    deadline = time.monotonic() + budget_seconds
    rounds = max(1, requests_per_client // 3)
    threads = [threading.Thread(target=_client, args=(target, c, rounds, value_bytes, config,
                                                      result, lock, deadline))
               for c in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(budget_seconds + 60)
    result.seconds = time.perf_counter() - started
    return result


def process_usage(pid: int) -> tuple[int, int]:
    """(resident set size in bytes, thread count) of a process, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return int(fields["VmRSS"][0]) * 1024, int(fields["Threads"][0])
