"""The README's quick tour, runnable: a 2-task cluster in this process, over loopback.

    python examples/quickstart.py [protocol]
"""

from __future__ import annotations

import sys

import numpy as np

import clusterwire


@clusterwire.remote
def scale(x: np.ndarray, factor: float) -> np.ndarray:
    """Runs on whichever task the caller names."""
    return x * factor


def main(protocol: str = "grpc") -> None:
    cluster = {"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:0"]}  # port 0: any free port
    with clusterwire.Server(cluster, job_name="ps", task_index=0, protocol=protocol) as ps, \
            clusterwire.Server(cluster, job_name="worker", task_index=0, protocol=protocol) as w:
        # Each server learned its own bound port; tell each the other's.
        bound = {"ps": [ps.target.split("://")[1]], "worker": [w.target.split("://")[1]]}
        for server in (ps, w):
            with clusterwire.Session(server.target) as session:
                session.complete_cluster(bound)
        with clusterwire.Session(w.target) as session:
            weights = np.ones((1024, 1024), np.float32)
            session.put("weights", weights, task="/job:ps/task:0")  # forwarded to the ps
            fetched = session.get("weights", task="/job:ps/task:0")
            doubled = session.call(scale, fetched, 2.0, task="/job:ps/task:0")
            status = session.status(task="/job:ps/task:0")
        print(f"{protocol}: got {fetched.shape} {fetched.dtype}, scaled sum {doubled.sum():.0f}, "
              f"ps at {status['target']} with {status['cpu_count']} CPUs")


if __name__ == "__main__":
    main(*sys.argv[1:])
