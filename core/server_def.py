"""Building a ServerDef from the arguments of ``Server`` (TF's _make_server_def)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clusterwire.cluster_resolver import ClusterResolver
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.errors import InvalidArgumentError
from clusterwire.protos.tensorflow_server_pb2 import ConfigProto, ServerDef, ServerOptions

DEFAULT_PROTOCOL = "grpc"


def _merge_config(server_def: ServerDef, config: Any) -> None:
    if config is None:
        return
    if isinstance(config, ConfigProto):
        server_def.default_session_config.MergeFrom(config)
    elif isinstance(config, ServerOptions):
        server_def.clusterwire_options.MergeFrom(config)
    elif isinstance(config, Mapping):
        try:
            server_def.clusterwire_options.MergeFrom(ServerOptions(**config))
        except (ValueError, TypeError) as err:
            fields = ", ".join(ServerOptions.DESCRIPTOR.fields_by_name)
            raise InvalidArgumentError(
                f"Invalid server config {dict(config)!r}: {err}. Known options: {fields}."
            ) from None
    else:
        raise TypeError(
            f"config must be a ConfigProto, a clusterwire ServerOptions or a dict of "
            f"ServerOptions fields, got {type(config).__name__}")


def _is_resolver(value: Any) -> bool:
    return isinstance(value, ClusterResolver)


def make_server_def(server_or_cluster_def: Any, job_name: str | None = None,
                    task_index: int | None = None, protocol: str | None = None,
                    config: Any = None) -> ServerDef:
    """A ServerDef from a ServerDef, ClusterDef, ClusterSpec, dict or ClusterResolver.

    TF's defaulting applies; a resolver contributes its cluster spec, task and
    rpc_layer, which explicit arguments override.
    """
    server_def = ServerDef()
    if _is_resolver(server_or_cluster_def):
        resolver = server_or_cluster_def
        server_or_cluster_def = resolver.cluster_spec()
        job_name = resolver.task_type if job_name is None else job_name
        task_index = resolver.task_id if task_index is None else task_index
        protocol = protocol or resolver.rpc_layer or None
    if isinstance(server_or_cluster_def, ServerDef):
        server_def.CopyFrom(server_or_cluster_def)
        if job_name is not None:
            server_def.job_name = job_name
        if task_index is not None:
            server_def.task_index = task_index
        if protocol is not None:
            server_def.protocol = protocol
    else:
        try:
            cluster_spec = ClusterSpec(server_or_cluster_def)
        except TypeError:
            raise TypeError(
                "Could not convert `server_or_cluster_def` to a `clusterwire.ServerDef` or "
                "`clusterwire.ClusterSpec`.") from None
        if job_name is None:
            if len(cluster_spec.jobs) != 1:
                raise ValueError("Must specify an explicit `job_name`.")
            job_name = cluster_spec.jobs[0]
        if task_index is None:
            indices = cluster_spec.task_indices(job_name) if job_name in cluster_spec.jobs else []
            if len(indices) != 1:
                raise ValueError("Must specify an explicit `task_index`.")
            task_index = indices[0]
        server_def.cluster.CopyFrom(cluster_spec.as_cluster_def())
        server_def.job_name = job_name
        server_def.task_index = task_index
        server_def.protocol = protocol or DEFAULT_PROTOCOL
    if not server_def.protocol:
        server_def.protocol = DEFAULT_PROTOCOL
    if not server_def.job_name:
        # A cluster may name a job "" (TF's GCE resolver with task_type=""), but its tasks'
        # device names (/job:/task:0) do not parse: TF aborts the process on them.
        raise InvalidArgumentError(
            "A server needs a job name: its task's device names (/job:NAME/task:I) do not "
            "parse with an empty one (TensorFlow aborts on them). Name the job (e.g. "
            "GCEClusterResolver(..., task_type=\"worker\")) or pass job_name=.")
    _merge_config(server_def, config)
    return server_def
