"""Resume at scale (issue 31): 64 consumers of a distributed_epoch job save their positions at
one step, ``merge_states`` merges them, and 48 new consumers resume from the merged position.

    python bench/bench_resume.py [--old 64] [--new 48] [--take 20] [--runs 3]

A dispatcher and 2 workers run as processes of their own (``bench_data.Servers``); the
consumers are threads of this process, each with its own iterator. The dataset is
``Dataset.range(2**20)``: 256 splits of 4096 elements, so that each of the 64 consumers holds
splits of its own when it saves. Per round:

1. baseline: ``--new`` consumers start a fresh job at once (a barrier); each one's time from
   its ``iter(from_dataset_id(...))`` to its first element, and to ``iter()``'s return;
2. ``--old`` consumers of another job each read ``--take`` elements and save their position
   (``state_dict()``, through JSON as a checkpoint), then stop; ``merge_states`` merges the
   positions (its time, and the merged position's size: bytes of its JSON, beside the sum of
   the single positions');
3. ``--new`` consumers start at once from the merged position: each one's time to its first
   element (the first of them has the dispatcher check every merged offset's vouch and give
   the unread parts back to the job), and to its job request's answer (``iter()``).

Medians over the consumers of a round (and the max), then the median over ``--runs`` rounds.
Every process started here is stopped at the end, also on error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _machine import cpu_model
from bench_data import Servers

from clusterwire import data

COUNT = 2 ** 20
MODE = "distributed_epoch"


def first_elements(count: int, make: Callable[[], Any]) -> tuple[list[float], list[float]]:
    """``count`` consumers made by ``make`` start together; each one's seconds from its
    start to its first element, and to its ``iter()``'s return (the dispatcher's answer to
    its job request: the merge, for the first resumed consumer). The consumers are closed
    after."""
    barrier = threading.Barrier(count)
    iterators: list[Any] = []
    lock = threading.Lock()

    def run() -> tuple[float, float]:
        barrier.wait(60)
        started = time.perf_counter()
        iterator = iter(make())
        joined = time.perf_counter() - started
        with lock:
            iterators.append(iterator)
        next(iterator)
        return time.perf_counter() - started, joined

    try:
        with ThreadPoolExecutor(count) as pool:
            results = [future.result(120) for future in [pool.submit(run)
                                                         for _ in range(count)]]
    finally:
        for iterator in iterators:
            iterator.close()
    return [first for first, _ in results], [joined for _, joined in results]


def saved_positions(target: str, dataset_id: str, job_name: str, count: int, take: int
                    ) -> list[dict[str, Any]]:
    """``count`` consumers of one job each read ``take`` elements and save their position
    (through JSON, as a checkpoint); then they stop."""
    barrier = threading.Barrier(count)

    def run() -> dict[str, Any]:
        iterator = iter(data.from_dataset_id(MODE, target, dataset_id, job_name=job_name))
        try:
            barrier.wait(60)  # all are consumers before any reads: each holds its own splits
            for _, _ in zip(range(take), iterator, strict=False):
                pass
            return json.loads(json.dumps(iterator.state_dict()))
        finally:
            iterator.close()

    with ThreadPoolExecutor(count) as pool:
        return [future.result(120) for future in [pool.submit(run) for _ in range(count)]]


def one_round(target: str, dataset_id: str, args: argparse.Namespace, index: int
              ) -> dict[str, Any]:
    fresh, fresh_job = first_elements(args.new, lambda: data.from_dataset_id(
        MODE, target, dataset_id, job_name=f"fresh-{index}"))
    states = saved_positions(target, dataset_id, f"saved-{index}", args.old, args.take)
    started = time.perf_counter()
    merged = json.loads(json.dumps(data.merge_states(states)))
    merge_s = time.perf_counter() - started
    resumed, resumed_job = first_elements(args.new, lambda: data.from_dataset_id(
        MODE, target, dataset_id, job_name=f"resumed-{index}", state=merged))
    return {"fresh": fresh, "resumed": resumed, "fresh_job": fresh_job,
            "resumed_job": resumed_job, "merge_s": merge_s,
            "merged_bytes": len(json.dumps(merged)),
            "single_bytes": sum(len(json.dumps(state)) for state in states),
            "partial": sum(len(c["partial"]) for c in merged["consumers"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=int, default=64, help="consumers that save (64)")
    parser.add_argument("--new", type=int, default=48, help="consumers that resume (48)")
    parser.add_argument("--take", type=int, default=20,
                        help="elements each saving consumer reads first (20)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    servers = Servers("clusterwire")
    try:
        dataset_id = data.register_dataset(servers.target, data.Dataset.range(COUNT))
        one_round(servers.target, dataset_id, args, 0)  # warm-up
        rounds = [one_round(servers.target, dataset_id, args, i + 1)
                  for i in range(args.runs)]
    finally:
        servers.close()
    print(f"# {cpu_model()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}; load "
          f"average {load:.2f} at the start; range(2**20) over 2 workers; {args.old} -> "
          f"{args.new} consumers (threads), {args.take} elements each before the save; "
          f"{args.runs} rounds after a warm-up (medians of the rounds)\n")

    def median(key: str, of: Callable[[list[float]], float]) -> float:
        return statistics.median(of(r[key]) for r in rounds) * 1e3

    print("| ms | median over consumers | max over consumers | each round's median / max |")
    print("|---|---:|---:|---|")
    fresh, resumed = (f"fresh job, {args.new} consumers (baseline)",
                      f"resumed from {args.old} merged positions, {args.new} consumers")
    for key, what in (("fresh", f"first element: {fresh}"),
                      ("resumed", f"first element: {resumed}"),
                      ("fresh_job", f"job request (iter()): {fresh}"),
                      ("resumed_job", f"job request (iter()): {resumed}")):
        per_round = ", ".join(f"{statistics.median(r[key]) * 1e3:.0f} / "
                              f"{max(r[key]) * 1e3:.0f}" for r in rounds)
        print(f"| {what} | {median(key, statistics.median):.0f} | {median(key, max):.0f} | "
              f"{per_round} |")
    ratio = median("resumed", statistics.median) / median("fresh", statistics.median)
    print(f"\nResumed / fresh, median time to first element: {ratio:.2f}x")
    sizes = ", ".join(f"{r['merged_bytes']:,}" for r in rounds)
    print(f"Merged position of {args.old} consumers: "
          f"{statistics.median(r['merged_bytes'] for r in rounds):,.0f} bytes of JSON "
          f"({sizes}), holding "
          f"{statistics.median(r['partial'] for r in rounds):.0f} partly read splits; the "
          f"{args.old} single positions "
          f"{statistics.median(r['single_bytes'] for r in rounds):,.0f} bytes together; "
          f"merge_states {median('merge_s', lambda s: s):.1f} ms")


if __name__ == "__main__":
    main()
