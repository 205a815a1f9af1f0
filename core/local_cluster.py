"""LocalCluster: a multi-process cluster on this host, one process per task.

Each task runs ``clusterwire serve`` with port 0, so no port is guessed or
raced for: the launcher reads every bound address back, then tells each task
the completed cluster (``Session.complete_cluster``, to several tasks at once).
Tasks are forked from one warmed parent per cluster (``clusterwire.zygote``):
a task skips the interpreter start and imports, and shares their memory with
its siblings. That parent is started with exactly the tasks' environment
(this process's plus ``env``), so variables read at interpreter start or at
import (PYTHONPATH, GRPC_*, CLUSTERWIRE_PLUGINS...) reach the tasks as they
would a process of their own; each task runs in the launcher's working
directory of the moment it is started.

The protocol and the plugin configuration are checked here before any task starts, so a
misspelt protocol or a malformed plugins.toml is one clear error, not one per task. What a
task writes to stderr is held until it serves, then passed on; a task that exits before it
serves is reported once, with its exit status and what it wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from clusterwire import errors
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.plugins import PluginManager, get_plugin_manager
from clusterwire.ready_line import READY_PREFIX
from clusterwire.security import security_fields
from clusterwire.session import Session
from clusterwire.task_launcher import TaskLauncher, TaskProcess

#: Lines of a failed task's stderr quoted in the error.
_QUOTED_LINES = 20

#: At most this many ``complete_cluster`` calls are in flight at once.
COMPLETE_CLUSTER_THREADS = 16


class _ReadyWatcher:
    """Drains a process's stdout on a thread, keeping its ready line and whether it ended."""

    def __init__(self, process: subprocess.Popen | TaskProcess):
        self.target: str | None = None
        self.ended = False
        self._event = threading.Event()
        threading.Thread(target=self._read, args=(process.stdout,), daemon=True).start()

    def _read(self, stdout: Any) -> None:
        try:
            for line in stdout:
                if self.target is None and line.startswith(READY_PREFIX):
                    self.target = line[len(READY_PREFIX):].strip()
                    self._event.set()
        except (ValueError, OSError):
            pass  # the pipe was closed
        self.ended = True
        self._event.set()

    def wait(self, timeout: float) -> str | None:
        self._event.wait(timeout)
        return self.target


class _HeldStderr:
    """Drains a task's stderr on a thread: held until ``release()`` (the task serves), then
    passed on to this process's stderr line by line."""

    def __init__(self, stream: Any):
        self._lines: list[str] = []
        self._released = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        with contextlib.suppress(ValueError, OSError):  # the pipe was closed
            for line in stream:
                with self._lock:
                    if not self._released:
                        self._lines.append(line)
                        continue
                sys.stderr.write(line)

    def release(self) -> None:
        """Pass on what was held and every later line."""
        with self._lock:
            self._released = True
            held, self._lines = self._lines, []
        sys.stderr.write("".join(held))

    def held(self, timeout: float) -> str:
        """What the task wrote, once it closed its stderr (or ``timeout`` passed)."""
        self._thread.join(timeout)
        with self._lock:
            return "".join(self._lines[-_QUOTED_LINES:]).strip()


def await_ready(process: subprocess.Popen | TaskProcess, timeout: float) -> str | None:
    """The target a server process prints on its ready line (None if none came in time).

    ``process`` must have been started with ``stdout=PIPE, text=True``; its
    output keeps being drained afterwards so it never blocks on a full pipe.
    """
    return _ReadyWatcher(process).wait(timeout)


class LocalCluster:
    """Start ``{job: num_tasks}`` as separate processes on ``host``; a context manager.

    ``imports`` are modules each task imports (to register ``@remote``
    functions). ``targets[job][index]`` is each task's target. ``env`` is added
    to this process's environment for the tasks. ``add_tasks`` and ``remove_task`` change
    the cluster while it runs (clusterwire.membership): its tasks take membership changes
    (``allow_membership_changes``) unless ``config`` sets it False.
    """

    def __init__(self, jobs: Mapping[str, int], protocol: str = "grpc", host: str = "127.0.0.1",
                 imports: Sequence[str] = (), start_timeout: float = 30.0,
                 env: Mapping[str, str] | None = None, config: Mapping[str, Any] | None = None):
        self.protocol = protocol
        _check_protocol(protocol, env)
        self._processes: dict[tuple[str, int], TaskProcess] = {}
        self._removed: set[tuple[str, int]] = set()
        self._host = host
        self._options = {"protocol": protocol, "imports": list(imports),
                         "config": {"allow_membership_changes": True, **(config or {})},
                         "timeout": start_timeout}
        self._launcher = TaskLauncher({**os.environ, **(env or {})})
        spec = {job: [f"{host}:0"] * count for job, count in jobs.items()}
        try:
            replies = {(job, index): self._launcher.start(self._argv(spec, job, index))
                       for job, count in jobs.items() for index in range(count)}
            for key, reply in replies.items():
                self._processes[key] = self._launcher.started(reply, start_timeout)
            addresses = {key: self._await_ready(key, proc, start_timeout)
                         for key, proc in self._processes.items()}
            self.cluster_spec = ClusterSpec({
                job: [addresses[job, i] for i in range(count)] for job, count in jobs.items()})
            self.targets = {job: [f"{protocol}://{addresses[job, i]}" for i in range(count)]
                            for job, count in jobs.items()}
            # The launcher presents the servers' own credentials (TLS files, token file).
            credentials = {k: v for k, v in (config or {}).items() if k in security_fields()}
            self.client_config = credentials or None
            self._complete_cluster(start_timeout)
        except BaseException:
            self.close()
            raise

    def _argv(self, cluster: Mapping[str, Any], job: str, index: int) -> list[str]:
        options = self._options
        argv = ["serve", "--cluster", json.dumps(cluster), "--job-name", job, "--task-index",
                str(index), "--protocol", options["protocol"], "--quiet"]
        if options["config"]:
            argv += ["--config", json.dumps(dict(options["config"]))]
        for module in options["imports"]:
            argv += ["--import", module]
        return argv

    def _complete_cluster(self, timeout: float) -> None:
        """Tell every task the bound addresses; the first failure (in task order) is raised."""
        def complete(target: str) -> None:
            with Session(target, config=self.client_config, timeout=timeout) as session:
                session.complete_cluster(self.cluster_spec)

        targets = [t for ts in self.targets.values() for t in ts]
        with ThreadPoolExecutor(max(1, min(len(targets), COMPLETE_CLUSTER_THREADS)),
                                thread_name_prefix="clusterwire-complete") as pool:
            for done in [pool.submit(complete, target) for target in targets]:
                done.result()

    def restart(self, job: str, index: int = 0) -> None:
        """Kill one task (SIGKILL) and start it again on the same address.

        The new process starts with an empty store, as a real restart would.
        """
        old = self._processes[job, index]
        old.kill()
        old.wait()
        old.close_pipes()
        proc = self._launcher.spawn(self._argv(self.cluster_spec.as_dict(), job, index),
                                    self._options["timeout"])
        self._processes[job, index] = proc
        self._await_ready((job, index), proc, self._options["timeout"])

    def add_tasks(self, job: str, count: int = 1) -> list[int]:
        """Start ``count`` more tasks of ``job`` (the next indices; a new job's from 0) and
        make the grown cluster the next membership version of the running tasks
        (``Session.update_cluster``; it spreads with heartbeats: start the cluster with
        ``membership_heartbeat_seconds`` in its config). Returns the new tasks' indices."""
        first = len(self.targets.get(job, []))
        indices = list(range(first, first + count))
        tasks = self._tasks()
        tasks.setdefault(job, {}).update((i, f"{self._host}:0") for i in indices)
        for index in indices:
            self._processes[job, index] = self._launcher.spawn(
                self._argv(tasks, job, index), self._options["timeout"])
        for index in indices:
            address = self._await_ready((job, index), self._processes[job, index],
                                        self._options["timeout"])
            tasks[job][index] = address
            self.targets.setdefault(job, []).append(f"{self.protocol}://{address}")
        self._update(ClusterSpec(tasks), exclude=set((job, i) for i in indices))
        return indices

    def remove_task(self, job: str, index: int) -> None:
        """Take a task out of the membership of the running tasks (stopping it first, with
        SIGKILL, if it still runs: a lost host). Its index is not used again."""
        proc = self._processes[job, index]
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.close_pipes()
        tasks = self._tasks()
        del tasks[job][index]
        self._removed.add((job, index))
        self._update(ClusterSpec({j: t for j, t in tasks.items() if t}), exclude=set())

    def _tasks(self) -> dict[str, dict[int, str]]:
        spec = self.cluster_spec
        return {job: {i: spec.task_address(job, i) for i in spec.task_indices(job)}
                for job in spec.jobs}

    def _update(self, cluster: ClusterSpec, exclude: set[tuple[str, int]]) -> None:
        """Make ``cluster`` the membership, through the first running task not in
        ``exclude``."""
        self.cluster_spec = cluster
        for job in cluster.jobs:
            for index in cluster.task_indices(job):
                if (job, index) not in exclude and self._processes[job, index].poll() is None:
                    with Session(self.targets[job][index], config=self.client_config,
                                 timeout=self._options["timeout"]) as session:
                        session.update_cluster(cluster)
                    return
        raise errors.FailedPreconditionError("No task of the cluster runs to take the change.")

    @staticmethod
    def _await_ready(key: tuple[str, int], proc: TaskProcess, timeout: float) -> str:
        stderr = _HeldStderr(proc.stderr)
        watcher = _ReadyWatcher(proc)
        target = watcher.wait(timeout)
        task = f"/job:{key[0]}/task:{key[1]}"
        if target is not None:
            stderr.release()
            return target.split("://", 1)[1]
        if not watcher.ended:
            raise errors.UnavailableError(f"Task {task} did not start within {timeout} s.")
        # It closed its stdout: it is exiting, its status is on the way.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
        said = stderr.held(timeout)
        raise errors.UnavailableError(
            f"Task {task} exited with status {proc.poll()} before it served"
            + (f"; it said:\n{said}" if said else " (it wrote nothing to stderr)."))

    def target(self, job: str, index: int = 0) -> str:
        """The target of one task."""
        if (job, index) in self._removed:
            raise errors.NotFoundError(f"/job:{job}/task:{index} was removed from the cluster.")
        return self.targets[job][index]

    def process(self, job: str, index: int = 0) -> TaskProcess:
        """The process of one task (for fault-injection tests): ``pid``, ``poll()``,
        ``wait()``, ``send_signal()``, ``terminate()`` and ``kill()`` as on a Popen."""
        return self._processes[job, index]

    def close(self, timeout: float = 10.0) -> None:
        """Stop every task (SIGTERM, then SIGKILL after ``timeout``) and reap it."""
        for proc in self._processes.values():
            proc.terminate()
        for proc in self._processes.values():
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.close_pipes()
        self._launcher.close(timeout)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _check_protocol(protocol: str, env: Mapping[str, str] | None) -> None:
    """The error every task would raise for ``protocol`` (unknown, or a malformed plugins
    configuration), raised once here before any task starts."""
    config = (env or {}).get("CLUSTERWIRE_PLUGINS")
    manager = PluginManager(config) if config else get_plugin_manager()
    manager.transport(protocol)
