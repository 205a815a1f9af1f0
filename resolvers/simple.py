"""SimpleClusterResolver: a fixed ClusterSpec (TF's ``SimpleClusterResolver``)."""

from __future__ import annotations

from typing import Any

from clusterwire.cluster_resolver import ClusterResolver, format_master_url
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.plugins import ResolverSpec, hookimpl


class SimpleClusterResolver(ClusterResolver):
    """Returns the ClusterSpec, master and task it was given (TF's, rule for rule).

    ``master(task_type, task_id)`` is that task's address when both are given,
    else ``master``; either way prefixed with ``rpc_layer`` (so an empty master
    with ``rpc_layer="grpc"`` is ``"grpc://"``, as in TF). As a convenience
    ``cluster_spec`` may also be a dict or ClusterDef (TF: ClusterSpec only).
    """

    def __init__(self, cluster_spec: Any, master: str = "", task_type: str | None = None,
                 task_id: int | None = None, environment: str = "",
                 num_accelerators: dict[str, int] | None = None, rpc_layer: str | None = None):
        if isinstance(cluster_spec, dict) or type(cluster_spec).__name__ == "ClusterDef":
            cluster_spec = ClusterSpec(cluster_spec)
        if not isinstance(cluster_spec, ClusterSpec):
            raise TypeError("cluster_spec must be a `tf.train.ClusterSpec`.")
        if not isinstance(master, str):
            raise TypeError("master must be a string.")
        self._cluster_spec = cluster_spec
        self._master = master
        self.task_type = task_type
        self.task_id = task_id
        self._environment = environment
        self._num_accelerators = num_accelerators
        self.rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The ClusterSpec given at construction."""
        return self._cluster_spec

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """A task's address, or the configured master, with the rpc_layer prefix."""
        if task_type is not None and task_id is not None:
            master = self._cluster_spec.task_address(task_type, task_id)
        else:
            master = self._master
        return format_master_url(master, rpc_layer or self.rpc_layer)

    @property
    def environment(self) -> str:
        """The environment given at construction."""
        return self._environment

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto=None) -> dict[str, int]:
        """The dict given at construction, or ``{}``."""
        return self._num_accelerators or {}


@hookimpl
def clusterwire_add_resolvers() -> list[ResolverSpec]:
    """Register the "simple" resolver."""
    return [ResolverSpec("simple", SimpleClusterResolver, "a ClusterSpec given as an argument")]
