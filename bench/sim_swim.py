"""SWIM membership simulated to 10,000 members: the module's own code, in virtual time.

Runs ``clusterwire.swim``'s state machines with their default constants (``swim.Config``;
``--probe-interval`` and ``--probe-timeout`` change those two) on
``clusterwire.testing.swim_network``, a discrete-event network (message latency 0.5-2 ms,
no sockets, no sleeps). It is a simulation of the protocol's code, not a measurement of
the runtime: nothing here is wired into a task yet. Run from the repository root, under
``nice -n 19`` on a shared machine::

    nice -n 19 python bench/sim_swim.py [--sizes 16,64,256,1024,10000] [--json]

For each cluster size n:

1. Detection: after ``--warmup`` virtual seconds one member is killed; the time until a
   member first suspects it, first declares it dead, and until every member holds it dead.
2. Dissemination: at the same moment a new member joins; the time, and probe rounds,
   until every member holds it alive.
3. Messages a member sends per second, over the second half of the warm-up.
4. False positives: another run of ``--loss-seconds`` with ``--loss`` of all messages lost
   and one member handling every event up to ``--lag`` s late (a CPU-starved process):
   suspicions of live members (each one refuted), and observers that held a live member
   dead.

Prints a Markdown table; ``--json`` prints one JSON line instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from dataclasses import replace

from clusterwire.swim import Config, State
from clusterwire.testing.swim_network import SimNetwork


def detect_and_join(n: int, warmup: float, seed: int, base: Config) -> dict:
    """Kill one member and join another at once after ``warmup``; time both."""
    config = replace(base, allow_joins=True, max_members=n + 16)
    net = SimNetwork(n, config=config, seed=seed)
    net.run_until(warmup / 2)
    before = sum(net.sent.values())
    net.run_until(warmup)
    per_second = (sum(net.sent.values()) - before) / n / (warmup / 2)
    victim = f"m{n // 2}"
    net.watch(victim, "new")
    net.kill(victim)
    net.add("new", seed=seed)
    start = net.now
    low, high = config.suspicion_bounds(n)
    joined = None

    def done() -> bool:
        nonlocal joined
        if joined is None and net.everyone("new", State.ALIVE):
            joined = net.now - start
        return joined is not None and net.everyone(victim, State.DEAD)

    net.run_until(start + (n + 1) * config.probe_interval + high + 60, until=done,
                  check_every=0.05)
    suspected = net.seen.get((victim, State.SUSPECT), {})
    dead = net.seen.get((victim, State.DEAD), {})
    everywhere = net.everyone(victim, State.DEAD)
    return {
        "n": n,
        "suspicion_min_s": round(low, 2), "suspicion_max_s": round(high, 2),
        "first_suspect_s": round(min(suspected.values()) - start, 2) if suspected else None,
        "first_dead_s": round(min(dead.values()) - start, 2) if dead else None,
        "dead_everywhere_s": round(max(dead.values()) - start, 2) if everywhere else None,
        "join_everywhere_s": None if joined is None else round(joined, 2),
        "join_rounds": None if joined is None else round(joined / config.probe_interval, 1),
        "log2_n": round(math.log2(n), 1),
        "messages_per_member_s": round(per_second, 2),
        "false_dead_detect_run": net.false_dead,
    }


def false_positives(n: int, seconds: float, loss: float, lag: float, seed: int,
                    base: Config) -> dict:
    """Run ``seconds`` with ``loss`` and one member lagging ``lag``; count false news."""
    net = SimNetwork(n, config=replace(base, max_members=n + 16), seed=seed, loss=loss)
    net.load("m1", lag)
    net.watch("m1")
    net.run_until(seconds)
    return {
        "loss_seconds": seconds, "loss": loss, "lag_s": lag,
        "refuted_suspicions": sum(node.incarnation for node in net.nodes.values()),
        "loaded_member_suspicions": net.nodes["m1"].incarnation,
        "false_dead": net.false_dead,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="16,64,256,1024,10000")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--loss", type=float, default=0.05)
    parser.add_argument("--lag", type=float, default=0.7)
    parser.add_argument("--loss-seconds", type=float, default=300.0,
                        help="virtual seconds of the false-positive run (at most 60 past "
                             "1,024 members, to bound the run's time)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--probe-interval", type=float, default=Config.probe_interval,
                        help="seconds (every time above scales with it)")
    parser.add_argument("--probe-timeout", type=float, default=Config.probe_timeout)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    config = Config(probe_interval=args.probe_interval, probe_timeout=args.probe_timeout)
    rows = []
    for n in (int(size) for size in args.sizes.split(",")):
        began = time.perf_counter()
        row = detect_and_join(n, args.warmup, args.seed, config)
        seconds = args.loss_seconds if n <= 1024 else min(args.loss_seconds, 60.0)
        row.update(false_positives(n, seconds, args.loss, args.lag, args.seed, config))
        row["wall_s"] = round(time.perf_counter() - began, 1)
        row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        rows.append(row)
    load = os.getloadavg()
    if args.json:
        constants = {key: value for key, value in config.__dict__.items()
                     if key not in ("allow_joins", "max_members")}  # set per run
        print(json.dumps({"rows": rows, "config": constants,
                          "loadavg": [round(x, 2) for x in load]}))
        return
    print(f"SWIM simulated (clusterwire.swim; probe {config.probe_interval} s, "
          f"timeout {config.probe_timeout} s, k={config.indirect_checks}, suspicion "
          f"{config.suspicion_mult}*max(1,log10 n) intervals up to x"
          f"{config.suspicion_max_mult}, retransmits {config.retransmit_mult}*ceil(ln(n+1))); "
          f"load average {load[0]:.1f}")
    print()
    print("| n | first suspect s | first dead s | dead everywhere s | suspicion min-max s "
          "| join everywhere s (rounds; log2 n) | messages/member/s | false-positive run "
          "| refuted suspicions (loaded member) | false dead | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']:,} | {r['first_suspect_s']} | {r['first_dead_s']} | "
              f"{r['dead_everywhere_s']} | {r['suspicion_min_s']}-{r['suspicion_max_s']} | "
              f"{r['join_everywhere_s']} ({r['join_rounds']}; {r['log2_n']}) | "
              f"{r['messages_per_member_s']} | {r['loss_seconds']:.0f} s, "
              f"{r['loss']:.0%} lost, m1 lags {r['lag_s']} s | {r['refuted_suspicions']} "
              f"({r['loaded_member_suspicions']}) | {r['false_dead']} | {r['wall_s']} |")


if __name__ == "__main__":
    main()
