"""``global_shuffle`` of 10^8 indices: its memory and its per-element cost next to ``range``.

    python bench/bench_global_shuffle_index.py [--size 100000000] [--take 1000000] [--runs 3]

1. The permutation: ``IndexPermutation(size, seed=1)`` applied to every index of
   ``[0, size)`` in numpy chunks of 2^22; a bitmap of ``size`` bits (the check's memory, not
   the permutation's) shows every index comes out exactly once. Its time per index, and the
   permutation's own state (round keys and size) in bytes.
2. The Dataset: ``Dataset.range(size).global_shuffle(1).take(--take)`` and
   ``Dataset.range(size).take(--take)`` iterated in this process (median of ``--runs``; wall
   and CPU microseconds per element), and the process's resident memory before and after
   the shuffled iterations (VmRSS, /proc/self/status).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from _machine import cpu_model

from clusterwire import data
from clusterwire.data.index_shuffle import IndexPermutation

CHUNK = 1 << 22


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def state_bytes(permutation: IndexPermutation) -> int:
    """The permutation's memory: the object and what its slots refer to."""
    return sys.getsizeof(permutation) + sum(
        sys.getsizeof(getattr(permutation, name)) for name in IndexPermutation.__slots__)


def check_permutation(size: int) -> tuple[float, int]:
    """Seconds per index of applying the permutation to all of ``[0, size)`` (asserting it
    is one), and the permutation's state in bytes."""
    permutation = IndexPermutation(size, seed=1)
    seen = np.zeros(size, dtype=bool)
    started = time.perf_counter()
    for start in range(0, size, CHUNK):
        out = permutation.apply(np.arange(start, min(start + CHUNK, size), dtype=np.uint64))
        seen[out] = True
    elapsed = time.perf_counter() - started
    assert seen.all(), "not a permutation: an index never came out"
    return elapsed / size, state_bytes(permutation)


def per_element(make, runs: int, take: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(runs):
        wall, cpu, count = time.perf_counter(), time.process_time(), 0
        for _element in make():
            count += 1
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        assert count == take, count
    return statistics.median(walls) / take, statistics.median(cpus) / take


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=100_000_000)
    parser.add_argument("--take", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"# {cpu_model()}; {time.strftime('%Y-%m-%d %H:%M')}; size {args.size:,}, "
          f"take {args.take:,}, median of {args.runs}")
    before = rss_mib()
    shuffled = per_element(
        lambda: data.Dataset.range(args.size).global_shuffle(1).take(args.take),
        args.runs, args.take)
    after = rss_mib()
    plain = per_element(lambda: data.Dataset.range(args.size).take(args.take),
                        args.runs, args.take)
    print("| read | wall us/element | CPU us/element |")
    print("|---|---:|---:|")
    print(f"| range({args.size:,}).global_shuffle(1) | {shuffled[0] * 1e6:.2f} | "
          f"{shuffled[1] * 1e6:.2f} |")
    print(f"| range({args.size:,}) | {plain[0] * 1e6:.2f} | {plain[1] * 1e6:.2f} |")
    print(f"\nResident memory around the shuffled iterations: {before:.1f} -> {after:.1f} MiB")
    seconds, state = check_permutation(args.size)
    print(f"The permutation of {args.size:,} indices: a permutation (every index once), "
          f"{seconds * 1e9:.1f} ns/index applied in numpy chunks of {CHUNK:,}; its state "
          f"{state} bytes")


if __name__ == "__main__":
    main()
