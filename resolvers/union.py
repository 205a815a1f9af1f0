"""UnionClusterResolver (exported as ``UnionResolver`` too): several resolvers merged into one.

TensorFlow's merge rules: a job is a dict (sparse) if any resolver gives it as
a dict, else a list; lists are concatenated in resolver order; dicts are
merged and an index defined twice raises KeyError. Fixes over TF:
``task_id=0`` / ``task_type=""`` given to the constructor are honoured (TF
falls through to the first resolver's because it tests truthiness), and each
resolver's ``cluster_spec()`` is called once per merge (TF calls it twice, so
a cluster that changes in between could merge inconsistently).
"""

from __future__ import annotations

from clusterwire.cluster_resolver import ClusterResolver, format_master_url
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.plugins import ResolverSpec, hookimpl
from clusterwire.resolvers._support import ResolverKeyError


def merge_cluster_specs(specs: list[ClusterSpec]) -> ClusterSpec:
    """Merge ClusterSpecs by TF's UnionResolver rules (see the module docstring)."""
    dicts = [spec.as_dict() for spec in specs]
    sparse = {job for d in dicts for job, tasks in d.items() if isinstance(tasks, dict)}
    merged: dict[str, list[str] | dict[int, str]] = {}
    for d in dicts:
        for job, tasks in d.items():
            if job not in sparse:
                merged.setdefault(job, []).extend(tasks)  # type: ignore[union-attr]
                continue
            target = merged.setdefault(job, {})
            incoming = dict(enumerate(tasks)) if isinstance(tasks, list) else dict(tasks)
            duplicates = set(incoming) & set(target)  # type: ignore[arg-type]
            if duplicates:
                raise ResolverKeyError(
                    "Duplicate keys detected when merging two ClusterSpecs: "
                    f"{duplicates!r} in job {job!r}")
            target.update(incoming)  # type: ignore[union-attr]
    return ClusterSpec(merged)


class UnionClusterResolver(ClusterResolver):
    """Merges the clusters of ``*resolvers``; the first one gives the defaults."""

    def __init__(self, *resolvers: ClusterResolver, **kwargs):
        self._rpc_layer = kwargs.pop("rpc_layer", None)
        self._task_type = kwargs.pop("task_type", None)
        self._task_id = kwargs.pop("task_id", None)
        if kwargs:
            raise ValueError(f"Unexpected kwargs provided {kwargs!r}")
        if not resolvers:
            raise ValueError("At least one ClusterResolver is required.")
        for resolver in resolvers:
            if not isinstance(resolver, ClusterResolver):
                raise TypeError("All arguments must be a sub-class of `ClusterResolver.`")
        self._resolvers = resolvers

    def cluster_spec(self) -> ClusterSpec:
        """The merged ClusterSpec, recomputed on every call."""
        return merge_cluster_specs([r.cluster_spec() for r in self._resolvers])

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """A task's URL in the merged cluster, else the first resolver's master."""
        if task_type is not None and task_id is not None:
            address = self.cluster_spec().task_address(task_type, task_id)
            return format_master_url(address, rpc_layer or self.rpc_layer)
        return self._resolvers[0].master(rpc_layer=rpc_layer)

    @property
    def task_type(self) -> str | None:  # type: ignore[override]
        """The constructor's task_type, else the first resolver's."""
        return self._task_type if self._task_type is not None else self._resolvers[0].task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:  # type: ignore[override]
        """The constructor's task_id, else the first resolver's."""
        return self._task_id if self._task_id is not None else self._resolvers[0].task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:  # type: ignore[override]
        """The constructor's rpc_layer, else the first resolver's."""
        return self._rpc_layer if self._rpc_layer is not None else self._resolvers[0].rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str:
        """The first resolver's environment."""
        return self._resolvers[0].environment

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto=None) -> dict[str, int]:
        """The first resolver's answer."""
        return self._resolvers[0].num_accelerators(task_type, task_id, config_proto)


UnionResolver = UnionClusterResolver


@hookimpl
def clusterwire_add_resolvers() -> list[ResolverSpec]:
    """Register the "union" resolver."""
    return [ResolverSpec("union", UnionClusterResolver,
                         "several resolvers merged (takes resolver objects, not CLI args)")]
