"""ClusterSpec: the jobs of a cluster and the address of each task.

Follows ``tf.train.ClusterSpec`` (tensorflow/python/training/server_lib.py)
rule for rule, with these deliberate differences, each a fix of a TF bug:

* An address is checked at construction: an empty or malformed address
  (no ``:port``, bad port, unbracketed IPv6) raises ValueError naming it,
  where TF accepts it and fails later inside ``Server``.
* A task index must be an int or a string of digits (TF calls ``int()`` on it,
  so ``1.7`` silently became ``1``); anything else raises TypeError.
* A job name must look like a TF device-name component
  (``[A-Za-z][A-Za-z0-9_]*``), or be empty: TF accepts ``"a/b"`` and then cannot
  parse its own device strings. The empty name is accepted as TF accepts it (TF's
  GCEClusterResolver with ``task_type=""`` returns a cluster of that job).
* ``job_tasks`` of an empty job returns ``[]`` (TF raises from ``max()``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from clusterwire.addressing import split_host_port
from clusterwire.errors import InvalidArgumentError
from clusterwire.protos.cluster_pb2 import ClusterDef

_JOB_NAME = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)?$")
_TYPE_ERROR = (
    "`cluster` must be a dictionary mapping one or more job names to lists of network "
    "addresses, or a `ClusterDef` protocol buffer"
)


def _job_name(name) -> str:
    if isinstance(name, bytes):
        name = name.decode()
    if not isinstance(name, str):
        raise TypeError(f"Job name {name!r} must be bytes or unicode")
    if not _JOB_NAME.match(name):
        raise ValueError(
            f"Invalid job name {name!r}: use letters, digits and '_', starting with a letter "
            "(e.g. 'worker', 'ps'), or the empty name.")
    return name


def _task_index(index) -> int:
    if isinstance(index, bool) or not isinstance(index, (int, str, bytes)):
        raise TypeError(f"Task index {index!r} must be an integer.")
    value = int(index)  # "x" raises ValueError, as in TF
    if value < 0:
        raise ValueError(f"Task index {value} must be >= 0.")
    return value


def _address(job: str, address) -> str:
    if isinstance(address, bytes):
        address = address.decode()
    if not isinstance(address, str):
        raise TypeError(f"Task address {address!r} must be bytes or unicode")
    try:
        split_host_port(address)
    except InvalidArgumentError as err:
        raise ValueError(f"Job {job!r}: {err.message}") from None
    return address


class ClusterSpec:
    """Represents a cluster as a set of "tasks", organized into "jobs".

    Build it from ``{job: [address, ...]}`` (dense: index = position),
    ``{job: {index: address}}`` (sparse), a ``ClusterDef`` protobuf, or another
    ClusterSpec. Anything else raises TypeError.
    """

    __hash__ = None  # type: ignore[assignment]  # unhashable, as TF's

    def __init__(self, cluster):
        if isinstance(cluster, Mapping):
            self._cluster_spec: dict[str, dict[int, str]] = {}
            for job, tasks in cluster.items():
                name = _job_name(job)
                if isinstance(tasks, (list, tuple)):
                    entries = {i: _address(name, a) for i, a in enumerate(tasks)}
                elif isinstance(tasks, Mapping):
                    entries = {_task_index(i): _address(name, a) for i, a in tasks.items()}
                else:
                    raise TypeError(
                        f"The tasks for job {job!r} must be a list or a dictionary from "
                        "integers to strings.")
                self._cluster_spec[name] = entries
            self._cluster_def = self._make_cluster_def()
        elif isinstance(cluster, ClusterDef):
            self._cluster_def = cluster
            self._cluster_spec = {}
            for job_def in cluster.job:
                name = _job_name(job_def.name)
                self._cluster_spec[name] = {
                    _task_index(i): _address(name, a) for i, a in job_def.tasks.items()}
        elif isinstance(cluster, ClusterSpec):
            self._cluster_def = ClusterDef()
            self._cluster_def.MergeFrom(cluster.as_cluster_def())
            self._cluster_spec = {job: dict(tasks) for job, tasks in cluster._cluster_spec.items()}
        else:
            raise TypeError(_TYPE_ERROR)

    def _make_cluster_def(self) -> ClusterDef:
        cluster_def = ClusterDef()
        for job in sorted(self._cluster_spec):
            job_def = cluster_def.job.add(name=job)
            for index in sorted(self._cluster_spec[job]):
                job_def.tasks[index] = self._cluster_spec[job][index]
        return cluster_def

    def __bool__(self) -> bool:
        return bool(self._cluster_spec)

    __nonzero__ = __bool__

    def __eq__(self, other) -> bool:
        if isinstance(other, ClusterSpec):
            return self._cluster_spec == other._cluster_spec
        return self._cluster_spec == other

    def __ne__(self, other) -> bool:
        return not self == other

    def __repr__(self) -> str:
        as_dict = self.as_dict()
        body = ", ".join(f"{job!r}: {as_dict[job]!r}" for job in sorted(as_dict))
        return f"ClusterSpec({{{body}}})"

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """``{job: [addr, ...]}`` for jobs with indices 0..n-1, else ``{job: {index: addr}}``."""
        result: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._cluster_spec.items():
            if not tasks:
                result[job] = {}
            elif max(tasks) + 1 == len(tasks):
                result[job] = [tasks[i] for i in range(len(tasks))]
            else:
                result[job] = dict(tasks)
        return result

    def as_cluster_def(self) -> ClusterDef:
        """The ``ClusterDef`` protobuf (jobs sorted by name, tasks by index)."""
        return self._cluster_def

    @property
    def jobs(self) -> list[str]:
        """Job names, in dict insertion order (or ClusterDef order)."""
        return list(self._cluster_spec)

    def _tasks(self, job_name: str) -> dict[int, str]:
        try:
            return self._cluster_spec[job_name]
        except KeyError:
            raise ValueError(f"No such job in cluster: {job_name!r}") from None

    def num_tasks(self, job_name: str) -> int:
        """The number of tasks in ``job_name``; ValueError for an unknown job."""
        return len(self._tasks(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The sorted task indices of ``job_name``."""
        return sorted(self._tasks(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of one task; ValueError for an unknown job or index."""
        tasks = self._tasks(job_name)
        try:
            return tasks[task_index]
        except (KeyError, TypeError):
            raise ValueError(
                f"No task with index {task_index!r} in job {job_name!r}") from None

    def task_addresses(self) -> dict[tuple[str, int], str]:
        """Every task, ``(job, index)``, and its address: jobs in order, indices sorted."""
        return {(job, index): tasks[index] for job, tasks in self._cluster_spec.items()
                for index in sorted(tasks)}

    def job_tasks(self, job_name: str) -> list[str | None]:
        """Addresses of ``job_name`` by index, with None in the gaps of a sparse job."""
        tasks = self._tasks(job_name)
        if not tasks:
            return []
        return [tasks.get(i) for i in range(max(tasks) + 1)]


def with_address(cluster: ClusterSpec, job: str, index: int, address: str) -> ClusterSpec:
    """``cluster`` with task ``/job:job/task:index`` at ``address`` (added if it is not in
    it, its job too)."""
    tasks = {j: {i: cluster.task_address(j, i) for i in cluster.task_indices(j)}
             for j in cluster.jobs}
    tasks.setdefault(job, {})[index] = address
    return ClusterSpec(tasks)
