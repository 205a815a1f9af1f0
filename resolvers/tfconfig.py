"""TFConfigClusterResolver: the cluster described by the ``TF_CONFIG`` environment variable.

TensorFlow's resolver, rule for rule: ``TF_CONFIG`` is read on every call
(``cluster``, ``task.type``, ``task.index``, ``rpc_layer``, ``session_master``);
constructor arguments override it; its ``environment`` key is not read. Unlike
TF, malformed content raises an error naming TF_CONFIG and the bad part (a
ValueError, as TF's JSONDecodeError is, and a clusterwire InvalidArgumentError)
instead of a bare JSON or KeyError traceback.
"""

from __future__ import annotations

import json
import os
from typing import Any

from clusterwire.cluster_resolver import ClusterResolver, format_master_url
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.plugins import ResolverSpec, hookimpl
from clusterwire.resolvers._support import ResolverValueError

TF_CONFIG = "TF_CONFIG"


def load_tf_config() -> dict[str, Any]:
    """``TF_CONFIG`` parsed (``{}`` when unset); ResolverValueError when malformed."""
    text = os.environ.get(TF_CONFIG, "{}")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ResolverValueError(f"{TF_CONFIG} is not valid JSON ({err}): {text!r}") from None
    if not isinstance(config, dict):
        raise ResolverValueError(f"{TF_CONFIG} must be a JSON object, got {text!r}")
    task = config.get("task", {})
    if not isinstance(task, dict):
        raise ResolverValueError(f'{TF_CONFIG}: "task" must be an object, got {task!r}')
    return config


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster, this task and the rpc layer from ``TF_CONFIG``."""

    def __init__(self, task_type: str | None = None, task_id: int | None = None,
                 rpc_layer: str | None = None, environment: str | None = None):
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @property
    def task_type(self) -> str | None:  # type: ignore[override]
        """The constructor's task_type, else ``TF_CONFIG``'s ``task.type``."""
        if self._task_type is not None:
            return str(self._task_type)
        task = load_tf_config().get("task", {})
        return str(task["type"]) if "type" in task else None

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:  # type: ignore[override]
        """The constructor's task_id, else ``TF_CONFIG``'s ``task.index``."""
        if self._task_id is not None:
            return int(self._task_id)
        task = load_tf_config().get("task", {})
        if "index" not in task:
            return None
        try:
            return int(task["index"])
        except (TypeError, ValueError):
            raise ResolverValueError(
                f'{TF_CONFIG}: "task.index" must be an integer, got {task["index"]!r}') from None

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:  # type: ignore[override]
        """The constructor's rpc_layer, else ``TF_CONFIG``'s ``rpc_layer``."""
        if self._rpc_layer is not None:
            return self._rpc_layer
        return load_tf_config().get("rpc_layer")

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str | None:  # type: ignore[override]
        """The constructor's environment (TF_CONFIG's is ignored, as in TF)."""
        return self._environment

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto=None) -> dict[str, int]:
        """Accelerators of a task (default: this TF_CONFIG task)."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        return super().num_accelerators(task_type, task_id, config_proto)

    def cluster_spec(self) -> ClusterSpec:
        """``TF_CONFIG``'s ``cluster`` (an empty ClusterSpec without one)."""
        config = load_tf_config()
        if "cluster" not in config:
            return ClusterSpec({})
        try:
            return ClusterSpec(config["cluster"])
        except (TypeError, ValueError) as err:
            raise ResolverValueError(f'{TF_CONFIG}: invalid "cluster": {err}') from None

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """``session_master`` if set; ``""`` for at most one task; else a task's URL."""
        config = load_tf_config()
        if config.get("session_master") is not None:
            return config["session_master"]
        cluster = self.cluster_spec()
        if not cluster.jobs or (len(cluster.jobs) == 1
                                and len(cluster.job_tasks(cluster.jobs[0])) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        rpc_layer = rpc_layer if rpc_layer is not None else self.rpc_layer
        return format_master_url(cluster.task_address(task_type, task_id), rpc_layer)


@hookimpl
def clusterwire_add_resolvers() -> list[ResolverSpec]:
    """Register the "tfconfig" resolver."""
    return [ResolverSpec("tfconfig", TFConfigClusterResolver,
                         "the TF_CONFIG environment variable (TensorFlow's JSON)")]
