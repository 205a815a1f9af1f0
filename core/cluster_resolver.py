"""ClusterResolver: TensorFlow's interface for discovering a cluster from its manager.

Concrete resolvers live in ``clusterwire.resolvers`` (one module per cluster
manager) and register through the plugin manager's
``clusterwire_add_resolvers`` hook as ``ResolverSpec`` records, exactly as
transports do.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Callable
from typing import Any

from clusterwire.cluster_spec import ClusterSpec
from clusterwire.devices import gpu_count
from clusterwire.session import Session


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """``rpc_layer://master`` if ``rpc_layer`` is set, else ``master`` (as TF)."""
    return f"{rpc_layer}://{master}" if rpc_layer else master


class ClusterResolver(abc.ABC):
    """Discovers the cluster a process belongs to (``tf.distribute.cluster_resolver``).

    Subclasses implement ``cluster_spec()`` and ``master()``; ``task_type``,
    ``task_id`` and ``rpc_layer`` name this process's task and protocol.
    """

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The current ClusterSpec (recomputed on each call where the manager can change)."""

    @abc.abstractmethod
    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The target of a task (default: this resolver's), prefixed with ``rpc_layer``."""

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto=None) -> dict[str, int]:
        """Accelerators of a task by type, e.g. ``{"GPU": 2}`` (CPUs are not counted).

        Asks the task's running server for its devices when ``master()`` names
        one; otherwise counts this host's GPUs.
        """
        target = self.master(task_type, task_id)
        if not target:
            count = gpu_count()
            return {"GPU": count} if count else {}
        with Session(target) as session:
            devices = session.status()["devices"]
        counts = Counter(d["device_type"] for d in devices if d["device_type"] != "CPU")
        return dict(counts)

    @property
    def environment(self) -> str:
        """The environment the cluster runs in; ``""`` outside Google's."""
        return ""

    def register_task(self, server: Any) -> Callable[[], None] | None:
        """Make ``server`` (this process's task, serving) known to the cluster manager, for
        managers whose membership is what tasks register (clusterwire-etcd); returns what
        withdraws it. None (the default): the manager itself lists the tasks (Slurm,
        Kubernetes, TF_CONFIG, a cloud's instances) and there is nothing to register.
        ``clusterwire serve --resolver`` calls it once the task serves, and the function it
        returned when the task stops."""
        return None

    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None
