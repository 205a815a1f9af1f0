"""Session: a client of one server target, reaching every task of its cluster."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from clusterwire import barrier, codec, errors, functions
from clusterwire.addressing import parse_device, split_host_port, split_target
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.membership import MAX_TASKS
from clusterwire.protos.service_pb2 import Request, TaskRef
from clusterwire.rpc import DEFAULT_TIMEOUT, RequestClient, response_value
from clusterwire.security import load_security
from clusterwire.transport import Frame

_requests = codec.HeaderCache()
#: How long a Session tries a barrier's coordinator before arriving through its target.
_COORDINATOR_PROBE_S = 1.0
#: Tasks ``cluster_status`` asks at once.
_STATUS_PARALLEL = 64
#: Of a forwarded status' deadline, what is kept for the target's answer to come back.
_REPLY_ALLOWANCE_S = 1.0



class ClusterStatus(dict[str, dict[str, Any]]):
    """``Session.cluster_status``'s answer: each task asked -> its status (or its error),
    and ``left_out``: how many more tasks the target listed, over ``membership.MAX_TASKS``
    (not asked)."""

    def __init__(self, statuses: dict[str, dict[str, Any]], left_out: int = 0):
        super().__init__(statuses)
        self.left_out = left_out


class Session:
    """A connection to a server ``target`` (``"grpc://host:port"``).

    ``task`` arguments are TF device strings (``"/job:ps/task:0"``,
    ``"/job:ps/replica:0/task:0"``); None means the target's own task. A
    request for another task is forwarded by the target server. Every request
    has a deadline (``timeout`` seconds, default 30; per call overridable);
    while the task is unreachable it is retried with backoff until then, then
    raises UnavailableError.

    A target server of this process is reached without its transport (no socket, no
    copy of a stored tensor; see ``clusterwire.in_process``): values it returns are then
    read-only arrays. ``in_process=False`` always goes through the transport.
    """

    def __init__(self, target: str, config: Mapping[str, Any] | None = None,
                 timeout: float = DEFAULT_TIMEOUT, in_process: bool = True):
        self.target = target
        self.config = config
        protocol, address = split_target(target)
        split_host_port(address)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise errors.InvalidArgumentError(f"timeout must be > 0 seconds, got {timeout!r}")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict of security options, got {config!r}")
        self._address = address
        # Barrier routing (see barrier()): the target's cluster and task, once asked, and
        # whether this client reaches a coordinator.
        self._view: tuple[ClusterSpec, tuple[str, int]] | None = None
        self._reachable: dict[str, bool] = {}
        self._client = RequestClient(protocol, timeout=float(timeout),
                                     security=load_security(config), in_process=in_process)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self._client.close()

    def _request(self, method: str, task: str | None, name: str = "") -> Request:
        request = Request(method=method, name=name)
        if task is not None:
            job, index = parse_device(task)
            request.task.CopyFrom(TaskRef(job=job, index=index))
            request.has_task = True
        return request

    def _send(self, request: Request, buffers=(), timeout: float | None = None):
        return self._client.send(self._address, request, buffers, self._timeout(timeout))

    @staticmethod
    def _timeout(timeout: float | None) -> float | None:
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise errors.InvalidArgumentError(f"timeout must be > 0 seconds, got {timeout!r}")
        return timeout

    def _value(self, request: Request, buffers=(), timeout: float | None = None,
               address: str | None = None) -> Any:
        frame = Frame(request.SerializeToString(), buffers)
        return self._value_of(frame, request.method, timeout, address)

    def _value_of(self, frame: Frame, method: str, timeout: float | None,
                  address: str | None = None) -> Any:
        """The value of ``frame``'s response from ``address`` (default: the target)."""
        frame = self._client.send_frame(address or self._address, frame, method,
                                        self._timeout(timeout))
        return response_value(frame)

    def _cached(self, method: str, task: str | None, name: str, value: Any = None,
                kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """Send a request whose header is kept by the structure of ``value`` (and
        ``kwargs``): a get, put or call repeated with same-shaped values builds it once."""
        def build(buffers: list) -> bytes:
            request = self._request(method, task, name)
            if method != "get":  # a get has no value; a put of None has one
                codec.encode_into(request.value, value, buffers)
            if kwargs:
                codec.encode_into(request.kwargs, kwargs, buffers)
            return request.SerializeToString()

        header, buffers = _requests.encode((method, task, name),
                                           (value, kwargs) if kwargs else value, build)
        return self._value_of(Frame(header, buffers), method, timeout)

    @staticmethod
    def _check_name(name: Any) -> str:
        if not isinstance(name, str) or not name:
            raise errors.InvalidArgumentError(
                f"A tensor name must be a non-empty str, got {name!r}")
        return name

    def put(self, name: str, value: Any, task: str | None = None,
            timeout: float | None = None) -> None:
        """Store ``value`` under ``name`` on ``task`` (atomic: all or nothing)."""
        self._cached("put", task, self._check_name(name), value, timeout=timeout)

    def get(self, name: str, task: str | None = None, timeout: float | None = None) -> Any:
        """The value stored under ``name`` on ``task``; NotFoundError if none."""
        return self._cached("get", task, self._check_name(name), timeout=timeout)

    def delete(self, name: str, task: str | None = None, timeout: float | None = None) -> bool:
        """Remove ``name`` from ``task``'s store; True if it was there."""
        return self._value(self._request("delete", task, self._check_name(name)), (), timeout)

    def list(self, task: str | None = None, timeout: float | None = None) -> list[str]:
        """Names stored on ``task``, sorted."""
        return self._value(self._request("list", task), (), timeout)

    def call(self, fn_or_name: Callable[..., Any] | str, *args: Any, task: str | None = None,
             timeout: float | None = None, **kwargs: Any) -> Any:
        """Run a ``@remote`` function on ``task`` and return its result.

        An exception in the function is raised here as RemoteFunctionError
        (with the remote type and traceback), or as the clusterwire error it
        was. ``task`` and ``timeout`` are taken by ``call`` itself.
        """
        return self._cached("call", task, functions.name_of(fn_or_name), list(args), kwargs,
                            timeout)

    def status(self, task: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Identity, cluster, devices, protocol and version of ``task``; ``metrics``, the
        samples its server counted (``clusterwire.metrics``: name, labels, value; histograms
        as NAME_count and NAME_sum); ``unreachable_peers``, the peer tasks it could not reach
        within the last minute and has not reached since (task, address, ``last_failure`` as
        Unix seconds, error); ``membership_version`` and, with heartbeats, ``peers`` (task,
        address, ``last_seen`` as Unix seconds or 0, ``down``: see clusterwire.membership).

        The target forwards a status for another task within this call's deadline (less
        a moment for its answer to return), so a task it cannot reach is named in its
        error, e.g. ``UnavailableError: Task at HOST:PORT ...``."""
        request = self._request("status", task)
        if task is not None:
            # The target forwards it: bounded so the target's own answer (naming the task
            # that did not answer) arrives before this call's deadline.
            budget = self._client.timeout if self._timeout(timeout) is None else timeout
            request.timeout_seconds = budget - min(budget / 4, _REPLY_ALLOWANCE_S)
        response, _ = self._send(request, (), timeout)
        status = response.task_status
        return {
            "job": status.task.job,
            "task_index": status.task.index,
            "cluster": ClusterSpec(status.cluster),
            "protocol": status.protocol,
            "target": status.target,
            "version": status.version,
            "cpu_count": status.cpu_count,
            "devices": [{"name": d.name, "device_type": d.device_type} for d in status.devices],
            "transport": dict(status.transport_info),
            "metrics": [{"name": m.name, "labels": dict(m.labels), "value": m.value}
                        for m in status.metrics],
            "unreachable_peers": [
                {"task": f"/job:{p.task.job}/task:{p.task.index}", "address": p.address,
                 "last_failure": p.last_failure_unix_seconds, "error": p.error}
                for p in status.unreachable_peers],
            "membership_version": status.membership_version,
            "peers": [{"task": f"/job:{p.task.job}/task:{p.task.index}", "address": p.address,
                       "last_seen": p.last_seen_unix_seconds, "down": p.down}
                      for p in status.peers],
        }

    def cluster_status(self, timeout: float | None = None,
                       parallel: int = _STATUS_PARALLEL) -> ClusterStatus:
        """``status()`` of every task of the target's cluster, ``parallel`` asked at once,
        all within one deadline: ``timeout`` seconds (default: the Session's) for the whole
        call, the target's own status included.

        Keys are the tasks (``"/job:worker/task:3"``) in the cluster's order. A task that
        does not answer by the deadline has ``{"error": "<ErrorClass>: message", "address":
        its address in the cluster}`` instead of its status (the target's error when it
        could not reach the task, e.g. UnavailableError naming the task's address; one not
        asked before the deadline, a DeadlineExceededError saying so), so one
        task down does not hide the others and a target that stalls every forward costs
        one ``timeout``, not one per ``parallel`` tasks. Only the first
        ``membership.MAX_TASKS`` tasks the target lists are asked (no cluster has more; a
        hostile target may list as many as fit in a reply): the answer's ``left_out`` says
        how many more it listed.
        """
        if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
            raise errors.InvalidArgumentError(f"parallel must be an int >= 1, got {parallel!r}")
        budget = self._client.timeout if self._timeout(timeout) is None else timeout
        deadline = time.monotonic() + budget
        cluster = self.status(timeout=budget)["cluster"]
        listed = (f"/job:{job}/task:{index}" for job in cluster.jobs
                  for index in cluster.task_indices(job))
        tasks = list(itertools.islice(listed, MAX_TASKS))
        left_out = sum(1 for _ in listed)
        unasked = (f"DeadlineExceededError: not asked: the deadline of {budget:g} s for the "
                   f"whole cluster's status passed first ({parallel} tasks asked at a time)")
        addresses = {f"/job:{job}/task:{index}": address
                     for (job, index), address in cluster.task_addresses().items()}
        statuses = ClusterStatus({task: {"error": unasked, "address": addresses[task]}
                                  for task in tasks}, left_out)
        pending = iter(tasks)
        lock = threading.Lock()

        def ask() -> None:
            while (left := deadline - time.monotonic()) > 0:
                with lock:
                    task = next(pending, None)
                if task is None:
                    return
                try:
                    statuses[task] = self.status(task=task, timeout=left)
                except errors.OpError as err:
                    statuses[task] = {"error": f"{type(err).__name__}: {err.message}",
                                      "address": addresses[task]}

        askers = [threading.Thread(target=ask, name="clusterwire-status", daemon=True)
                  for _ in range(min(parallel, len(tasks)))]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join()
        return statuses

    def complete_cluster(self, cluster: Any, task: str | None = None,
                         timeout: float | None = None) -> None:
        """Tell ``task`` the bound ports of tasks that were started with port 0."""
        request = self._request("complete_cluster", task)
        request.cluster.CopyFrom(ClusterSpec(cluster).as_cluster_def())
        self._value(request, (), timeout)

    def update_cluster(self, cluster: Any, task: str | None = None,
                       timeout: float | None = None) -> int:
        """Make ``cluster`` the next membership version of ``task`` (default: the target's),
        which spreads to the other tasks with heartbeats; returns the version (see
        ``Server.update_cluster``)."""
        request = self._request("update_cluster", task)
        request.cluster.CopyFrom(ClusterSpec(cluster).as_cluster_def())
        return self._value(request, (), timeout)

    def barrier(self, name: str = "barrier", task: str | None = None,
                timeout: float | None = None) -> None:
        """Arrive at barrier ``name`` as ``task`` (default: the target's task).

        Returns once every task of that task's job has arrived at ``name``;
        DeadlineExceededError (naming the missing tasks) after ``timeout`` seconds of
        waiting. As in TF (``RunOptions.timeout_in_ms`` over the session's
        ``operation_timeout_in_ms``), the call's ``timeout`` applies when given, even one
        longer than the Session's; else the Session's ``timeout``. Reaching the task (retried
        while it is unreachable) and its answer have the Session's timeout on top.
        A barrier name can be reused: each release starts a new round.
        """
        request = Request(method="barrier", name=self._check_name(name))
        arriving = parse_device(task) if task is not None else None
        if arriving is not None:
            request.from_task.CopyFrom(TaskRef(job=arriving[0], index=arriving[1]))
        wait = self._client.timeout if timeout is None else timeout
        request.timeout_seconds = self._timeout(wait)
        address, own = self._barrier_route(arriving, min(wait, _COORDINATOR_PROBE_S))
        if address != self._address and own is not None:
            request.from_task.CopyFrom(TaskRef(job=own[0], index=own[1]))
        self._value(request, (), wait + self._client.timeout, address)

    def _barrier_route(self, arriving: tuple[str, int] | None, probe_timeout: float
                       ) -> tuple[str, tuple[str, int] | None]:
        """Where to send a barrier arrival: the job's coordinator itself when the job has at
        most ``FLAT_MAX_TASKS`` tasks and this client reaches it (checked once per
        coordinator), else the target; and the target's own task, when the arrival is its."""
        if self._view is None:
            status = self.status()
            self._view = (status["cluster"], (status["job"], status["task_index"]))
        cluster, own = self._view
        job, _ = arriving or own
        try:
            indices = cluster.task_indices(job)
            address = cluster.task_address(job, min(indices))
        except ValueError:
            return self._address, None  # the target names the unknown job
        if (len(indices) > barrier.FLAT_MAX_TASKS or address == self._address
                or split_host_port(address)[1] == 0):
            return self._address, None
        reachable = self._reachable.get(address)
        if reachable is None:
            try:
                self._client.send(address, Request(method="status"), timeout=probe_timeout)
                reachable = True
            except errors.OpError:
                reachable = False
            self._reachable[address] = reachable
        if not reachable:
            return self._address, None
        return address, None if arriving else own
