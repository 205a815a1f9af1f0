"""A task that joins a running cluster (``clusterwire serve --join``).

It is a client of the cluster (a ``Session`` to read its membership and grow it) and a
``Server``, so it sits above both; ``clusterwire.membership``, which the server uses, stays
below them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clusterwire.cluster_spec import ClusterSpec, with_address
from clusterwire.security import security_fields
from clusterwire.server import Server
from clusterwire.session import Session

#: A task that joins a running cluster heartbeats this often unless its config says.
JOIN_HEARTBEAT_SECONDS = 1.0


def join(target: str, job: str, address: str, protocol: str | None = None,
         config: Mapping[str, Any] | None = None, rank: int = 0) -> Server:
    """Start a task that joins the running cluster of ``target`` (a task's
    ``protocol://host:port``) as the next task of ``job`` (plus ``rank``: the tasks of one
    launch, e.g. a Slurm step's, take consecutive indices), at ``address`` (port 0: a free
    one); the grown cluster becomes the next membership version through ``target``. Returns
    the started ``Server``. Tasks of one launch join at once; launches join one after
    another (two launches racing for one index would both claim it)."""
    config = dict(config or {})
    config.setdefault("membership_heartbeat_seconds", JOIN_HEARTBEAT_SECONDS)
    config.setdefault("allow_membership_changes", True)
    with Session(target, config={k: v for k, v in config.items()
                                 if k in security_fields()}) as session:
        status = session.status()
        cluster: ClusterSpec = status["cluster"]
        taken = cluster.task_indices(job) if job in cluster.jobs else []
        index = (max(taken) + 1 if taken else 0) + rank
        server = Server(with_address(cluster, job, index, address), job_name=job,
                        task_index=index,
                        protocol=protocol or status["protocol"], config=config)
        try:
            session.update_cluster(server.cluster_spec)
        except BaseException:
            server.stop()
            raise
    return server
