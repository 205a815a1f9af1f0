"""SlurmClusterResolver: the cluster of the current Slurm job step.

TensorFlow's ``SlurmClusterResolver`` (names, arguments, ports
``port_base + k`` for the k-th task on a node, GPU slices per task, jobs as
contiguous rank slices in sorted job-name order), with these fixes:

* CPU-only nodes work: no GPUs (``gpus_per_node=0``, an empty
  ``CUDA_VISIBLE_DEVICES``, no ``nvidia-smi``) gives tasks without GPUs, where TF
  crashes in ``range()`` or raises FileNotFoundError; tasks beyond the GPUs
  are kept (TF silently drops them from the cluster).
* The rank -> node mapping follows the step's real layout: Slurm's node order
  (``SLURM_NODEID`` indexes the step's node list; TF sorts host names, so
  ``node10`` came before ``node2``) and its distribution (``-m cyclic`` and
  ``plane`` as well as ``block``), checked against ``SLURM_GTIDS`` and
  ``SLURM_LOCALID`` so a layout that cannot be reproduced fails loudly rather than
  giving tasks different clusters.
* When Slurm binds GPUs per task (``--gpus-per-task``) its binding is kept.
* ``task_type``/``task_id`` and ``master()`` are known at construction (TF:
  only after ``cluster_spec()``); ``num_accelerators()`` is ``{}`` without GPUs.
* Errors name the variable or argument and the fix; they are TF's exception
  types (RuntimeError, ValueError) and clusterwire errors at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

from clusterwire.cluster_spec import ClusterSpec
from clusterwire.plugins import ResolverSpec, hookimpl
from clusterwire.resolvers._support import OwnTaskResolver, ResolverRuntimeError, ResolverValueError
from clusterwire.resolvers.hostlist import expand_hostlist, expand_tasks_per_node

_OUTSIDE = ("Not running inside a SLURM step? Start every task with srun (in an sbatch "
            "script: srun clusterwire serve --resolver slurm).")


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise ResolverRuntimeError(f"{name} not found in environment. {_OUTSIDE}")
    return value


def _env_int(name: str) -> int:
    text = _env(name)
    try:
        return int(text)
    except ValueError:
        raise ResolverValueError(f"{name}={text!r} is not an integer.") from None


def task_layout(tasks_per_node: list[int], distribution: str | None = None,
                plane_size: int = 1) -> list[tuple[int, int]]:
    """``(node index, local task index)`` of each rank, as Slurm distributes tasks.

    ``distribution`` is ``$SLURM_DISTRIBUTION`` (``block`` when unset; only the
    node-level part before ``:`` matters): ``block`` fills node after node,
    ``cyclic`` deals one task per node round-robin, ``plane`` deals blocks of
    ``plane_size``; nodes that are full are skipped.
    """
    kind = (distribution or "block").split(":")[0].split(",")[0].split("=")[0].lower()
    if kind == "block":
        chunk = max(tasks_per_node, default=0)
    elif kind == "cyclic":
        chunk = 1
    elif kind == "plane":
        chunk = max(plane_size, 1)
    else:
        raise ResolverRuntimeError(
            f"SLURM_DISTRIBUTION={distribution!r}: clusterwire cannot derive where each task "
            "runs from it; use -m block, cyclic or plane.")
    remaining, placed = list(tasks_per_node), [0] * len(tasks_per_node)
    layout: list[tuple[int, int]] = []
    while any(remaining):
        for node, left in enumerate(remaining):
            for _ in range(min(chunk, left)):
                layout.append((node, placed[node]))
                placed[node] += 1
            remaining[node] -= min(chunk, left)
    return layout


def _check_layout(layout: list[tuple[int, int]], rank: int) -> None:
    """Compare the derived layout with what Slurm told this task about its own node."""
    node_id, gtids = os.environ.get("SLURM_NODEID"), os.environ.get("SLURM_GTIDS")
    local_id = os.environ.get("SLURM_LOCALID")
    found: list[str] = []
    if node_id is not None and node_id.isdigit():
        if layout[rank][0] != int(node_id):
            found.append(f"SLURM_NODEID={node_id} (derived {layout[rank][0]})")
        elif gtids:
            derived = [r for r, (node, _) in enumerate(layout) if node == int(node_id)]
            if sorted(int(g) for g in gtids.split(",")) != derived:
                found.append(f"SLURM_GTIDS={gtids} (derived {derived})")
    if local_id is not None and local_id.isdigit() and layout[rank][1] != int(local_id):
        found.append(f"SLURM_LOCALID={local_id} (derived {layout[rank][1]})")
    if found:
        raise ResolverRuntimeError(
            f"The step's task layout (SLURM_DISTRIBUTION="
            f"{os.environ.get('SLURM_DISTRIBUTION', 'block')!r}) does not match this task: "
            f"{', '.join(found)}. Use srun -m block or -m cyclic, or pass tasks_per_node.")


def _nvidia_smi_gpus() -> int:
    """GPUs listed by nvidia-smi; 0 when it is absent or fails (CPU-only node)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        result = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True,
                                timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in result.stdout.splitlines() if line.startswith("GPU "))


class SlurmClusterResolver(OwnTaskResolver):
    """The cluster of the current Slurm step (TF's ``SlurmClusterResolver``).

    Reads ``SLURM_PROCID`` (always), ``SLURM_STEP_NUM_TASKS`` (when ``jobs`` is
    None: one ``worker`` job of every task), ``SLURM_STEP_NODELIST`` (unless
    ``tasks_per_node`` is a dict ``{host: n}``), ``SLURM_STEP_TASKS_PER_NODE``
    (unless ``tasks_per_node`` is given), and ``SLURM_DISTRIBUTION``,
    ``SLURM_DIST_PLANESIZE``, ``SLURM_NODEID``, ``SLURM_GTIDS``, ``SLURM_LOCALID``,
    ``CUDA_VISIBLE_DEVICES``, ``SLURM_GPUS_ON_NODE`` where present.
    """

    def __init__(self, jobs: Mapping[str, int] | None = None, port_base: int = 8888,
                 gpus_per_node: int | None = None, gpus_per_task: int | None = None,
                 tasks_per_node: int | Mapping[str, int] | None = None,
                 auto_set_gpu: bool = True, rpc_layer: str | None = "grpc"):
        self._rank = _env_int("SLURM_PROCID")
        hosts, counts = self._task_configuration(tasks_per_node)
        num_tasks = sum(counts)
        if jobs is None:
            jobs = {"worker": _env_int("SLURM_STEP_NUM_TASKS")}
        self._jobs = _check_jobs(jobs)
        if sum(self._jobs.values()) != num_tasks:
            raise ResolverRuntimeError(
                f"Requested {sum(self._jobs.values())} tasks but only {num_tasks} were assigned. "
                f"jobs={dict(self._jobs)} must add up to the step's task count (srun -n).")
        if not 0 <= self._rank < num_tasks:
            raise ResolverRuntimeError(
                f"SLURM_PROCID={self._rank} is outside the step's {num_tasks} tasks.")
        plane = os.environ.get("SLURM_DIST_PLANESIZE", "1")
        layout = task_layout(counts, os.environ.get("SLURM_DISTRIBUTION"),
                             int(plane) if plane.isdigit() else 1)
        if tasks_per_node is None:
            _check_layout(layout, self._rank)
        if port_base + max(counts, default=1) - 1 > 65535 or port_base < 1:
            raise ResolverValueError(
                f"port_base={port_base} leaves no valid port for {max(counts)} tasks per node.")
        self._addresses = [f"{hosts[node]}:{port_base + local}" for node, local in layout]
        self._local_ids = [local for _, local in layout]
        self._port_base = port_base
        self._auto_set_gpu = auto_set_gpu
        self._setup_gpus(gpus_per_node, gpus_per_task, max(counts, default=0))
        self.rpc_layer = rpc_layer
        self.task_type, self.task_id = self._own_task()

    @staticmethod
    def _task_configuration(tasks_per_node) -> tuple[list[str], list[int]]:
        if isinstance(tasks_per_node, Mapping):
            return list(tasks_per_node), [int(n) for n in tasks_per_node.values()]
        hosts = expand_hostlist(_env("SLURM_STEP_NODELIST"))
        if tasks_per_node is not None:
            return hosts, [int(tasks_per_node)] * len(hosts)
        text = _env("SLURM_STEP_TASKS_PER_NODE")
        counts = expand_tasks_per_node(text)
        if len(counts) != len(hosts):
            raise ResolverValueError(
                f"SLURM_STEP_TASKS_PER_NODE={text!r} has {len(counts)} entries but "
                f"SLURM_STEP_NODELIST names {len(hosts)} nodes.")
        return hosts, counts

    def _setup_gpus(self, gpus_per_node: int | None, gpus_per_task: int | None,
                    max_tasks: int) -> None:
        text = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = None if text is None else [d.strip() for d in text.split(",") if d.strip()]
        on_node = os.environ.get("SLURM_GPUS_ON_NODE", "")
        self._bound_by_slurm = False
        if gpus_per_node is None:
            if (visible is not None and on_node.isdigit() and len(visible) < int(on_node)
                    and gpus_per_task is None):
                # srun --gpus-per-task: Slurm gave each task its own GPUs already.
                self._bound_by_slurm = True
                gpus_per_node, gpus_per_task = int(on_node), len(visible)
            elif visible is not None:
                gpus_per_node = len(visible)
            elif on_node.isdigit():
                gpus_per_node = int(on_node)
            else:
                gpus_per_node = _nvidia_smi_gpus()
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_tasks if max_tasks else 0
        if not self._bound_by_slurm and max_tasks * gpus_per_task > gpus_per_node:
            raise ResolverRuntimeError(
                f"Requested more GPUs per node than available: {max_tasks} tasks x "
                f"{gpus_per_task} GPUs per task > {gpus_per_node} GPUs per node.")
        self._gpus_per_node, self._gpus_per_task = gpus_per_node, gpus_per_task
        names = visible if visible and len(visible) == gpus_per_node else None
        first = self._local_ids[self._rank] * gpus_per_task
        ids = range(first, first + gpus_per_task)
        self._own_gpus = [names[i] if names else str(i) for i in ids]

    def _own_task(self) -> tuple[str, int]:
        start = 0
        for job in sorted(self._jobs):
            if start <= self._rank < start + self._jobs[job]:
                return job, self._rank - start
            start += self._jobs[job]
        raise AssertionError("rank checked against the task count")  # pragma: no cover

    def cluster_spec(self) -> ClusterSpec:
        """Jobs in sorted name order, each a slice of the tasks in rank order.

        As in TF, sets ``CUDA_VISIBLE_DEVICES`` to this task's GPUs when
        ``auto_set_gpu`` (not on nodes without GPUs, nor where Slurm bound them).
        """
        cluster, start = {}, 0
        for job in sorted(self._jobs):
            cluster[job] = self._addresses[start:start + self._jobs[job]]
            start += self._jobs[job]
        if self._auto_set_gpu and self._gpus_per_node and not self._bound_by_slurm:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self._own_gpus)
        return ClusterSpec(cluster)

    def get_task_info(self) -> tuple[str, int]:
        """``(task_type, task_id)`` of this task."""
        return self.task_type, self.task_id

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto=None) -> dict[str, int]:
        """``{"GPU": gpus_per_task}``, or ``{}`` when tasks get no GPU."""
        return {"GPU": self._gpus_per_task} if self._gpus_per_task else {}


def _check_jobs(jobs: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(jobs, Mapping) or not jobs:
        raise ResolverValueError(f"jobs must be a non-empty dict {{job: tasks}}, got {jobs!r}.")
    checked = {}
    for job, count in jobs.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ResolverValueError(f"jobs[{job!r}]={count!r} must be an int >= 0.")
        checked[str(job)] = count
    return checked


@hookimpl
def clusterwire_add_resolvers() -> list[ResolverSpec]:
    """Register the "slurm" resolver."""
    return [ResolverSpec("slurm", SlurmClusterResolver, "tasks of the current Slurm job step")]
