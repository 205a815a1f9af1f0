"""Load benchmark: 64 concurrent clients x 2,000 mixed put/get/call requests, per protocol.

    python bench/bench_load.py [--clients 64] [--requests 2000] [--protocols grpc,grpc+local]

One server process per protocol (started by LocalCluster on 127.0.0.1), the
clients are threads of this process, each with its own Session. Values are
1 KiB; every value read back is compared with what was written. Prints a
Markdown table: requests/s, median and p99 latency, errors, mismatches, and
the server's RSS and threads before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

from clusterwire.local_cluster import LocalCluster
from clusterwire.testing.load import process_usage, run_load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2000)
    default = ["grpc", "grpc+local"] + (["grpc+verbs"] if importlib.util.find_spec("ucxx")
                                        else [])
    parser.add_argument("--protocols", default=",".join(default))
    args = parser.parse_args()
    print("| protocol | clients x requests | requests/s | median us | p99 us | errors "
          "| mismatches | server RSS MiB before/after | server threads before/after |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    for protocol in args.protocols.split(","):
        with LocalCluster({"w": 1}, protocol=protocol,
                          imports=["clusterwire.testing.load"]) as cluster:
            target, pid = cluster.target("w"), cluster.process("w").pid
            run_load(target, clients=args.clients, requests_per_client=30)
            rss0, threads0 = process_usage(pid)
            result = run_load(target, clients=args.clients, requests_per_client=args.requests)
            time.sleep(1)  # let transient threads finish before reading /proc
            rss1, threads1 = process_usage(pid)
        print(f"| {protocol} | {args.clients} x {args.requests} | "
              f"{result.requests_per_second:,.0f} | {result.percentile_us(50):,.0f} | "
              f"{result.percentile_us(99):,.0f} | {len(result.errors)} | {result.mismatches} | "
              f"{rss0 / 2**20:.0f} / {rss1 / 2**20:.0f} | {threads0} / {threads1} |",
              flush=True)


if __name__ == "__main__":
    main()
