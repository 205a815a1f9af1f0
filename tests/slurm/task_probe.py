"""Run inside each task of a Slurm step (``srun python task_probe.py PORT_BASE [JOBS_JSON]``).

Resolves the cluster with SlurmClusterResolver, serves this task, asks every
other task for its status through its own server (server-to-server), waits at a
barrier of the whole job so no server stops while others still call it, and
prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import sys

from clusterwire import Server, Session
from clusterwire.resolvers import SlurmClusterResolver


def main() -> None:
    jobs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
    resolver = SlurmClusterResolver(jobs=jobs, port_base=int(sys.argv[1]))
    cluster = resolver.cluster_spec()
    server = Server.from_resolver(resolver)
    reached = {}
    with Session(server.target, timeout=30) as session:
        for job in cluster.jobs:
            for index in cluster.task_indices(job):
                status = session.status(task=f"/job:{job}/task:{index}")
                reached[f"{job}:{index}"] = [status["job"], status["task_index"],
                                             len([d for d in status["devices"]
                                                  if d["device_type"] == "GPU"])]
        session.barrier("probe-done", timeout=60)
    server.stop(grace=10)  # answers the barrier waits it has just released
    print(json.dumps({
        "rank": int(os.environ["SLURM_PROCID"]), "node": os.environ.get("SLURMD_NODENAME"),
        "task": [resolver.task_type, resolver.task_id], "cluster": cluster.as_dict(),
        "master": resolver.master(), "target": server.target, "reached": reached,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "num_accelerators": resolver.num_accelerators()}), flush=True)


if __name__ == "__main__":
    main()
