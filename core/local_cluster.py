"""LocalCluster: a multi-process cluster on this host, one process per task.

Each task runs ``python -m clusterwire serve`` with port 0, so no port is
guessed or raced for: the launcher reads every bound address back, then
tells each task the completed cluster (``Session.complete_cluster``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from clusterwire import errors
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.security import security_fields
from clusterwire.session import Session

READY_PREFIX = "CLUSTERWIRE_READY "


def await_ready(process: subprocess.Popen, timeout: float) -> str | None:
    """The target a server process prints on its ready line (None if none came in time).

    ``process`` must have been started with ``stdout=PIPE, text=True``; its
    output keeps being drained afterwards so it never blocks on a full pipe.
    """
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        try:
            for line in process.stdout:  # type: ignore[union-attr]
                if not found and line.startswith(READY_PREFIX):
                    found.append(line[len(READY_PREFIX):].strip())
                    ready.set()
        except (ValueError, OSError):
            pass  # the pipe was closed
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(timeout)
    return found[0] if found else None


class LocalCluster:
    """Start ``{job: num_tasks}`` as separate processes on ``host``; a context manager.

    ``imports`` are modules each task imports (to register ``@remote``
    functions). ``targets[job][index]`` is each task's target.
    """

    def __init__(self, jobs: Mapping[str, int], protocol: str = "grpc", host: str = "127.0.0.1",
                 imports: Sequence[str] = (), start_timeout: float = 30.0,
                 env: Mapping[str, str] | None = None, config: Mapping[str, Any] | None = None):
        self.protocol = protocol
        self._processes: dict[tuple[str, int], subprocess.Popen] = {}
        self._options = {"protocol": protocol, "imports": list(imports), "config": config,
                         "env": {**os.environ, **(env or {})}, "timeout": start_timeout}
        spec = {job: [f"{host}:0"] * count for job, count in jobs.items()}
        try:
            for job, count in jobs.items():
                for index in range(count):
                    self._processes[job, index] = self._spawn(spec, job, index)
            addresses = {key: self._await_ready(key, proc, start_timeout)
                         for key, proc in self._processes.items()}
            self.cluster_spec = ClusterSpec({
                job: [addresses[job, i] for i in range(count)] for job, count in jobs.items()})
            self.targets = {job: [f"{protocol}://{addresses[job, i]}" for i in range(count)]
                            for job, count in jobs.items()}
            # The launcher presents the servers' own credentials (TLS files, token file).
            credentials = {k: v for k, v in (config or {}).items() if k in security_fields()}
            self.client_config = credentials or None
            for target in (t for ts in self.targets.values() for t in ts):
                with Session(target, config=self.client_config,
                             timeout=start_timeout) as session:
                    session.complete_cluster(self.cluster_spec)
        except BaseException:
            self.close()
            raise

    def _spawn(self, cluster: Mapping[str, Any], job: str, index: int) -> subprocess.Popen:
        options = self._options
        command = [sys.executable, "-m", "clusterwire", "serve", "--cluster",
                   json.dumps(cluster), "--job-name", job, "--task-index", str(index),
                   "--protocol", options["protocol"], "--quiet"]
        if options["config"]:
            command += ["--config", json.dumps(dict(options["config"]))]
        for module in options["imports"]:
            command += ["--import", module]
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=options["env"])

    def restart(self, job: str, index: int = 0) -> None:
        """Kill one task (SIGKILL) and start it again on the same address.

        The new process starts with an empty store, as a real restart would.
        """
        old = self._processes[job, index]
        if old.poll() is None:
            old.kill()
        old.wait()
        if old.stdout:
            old.stdout.close()
        proc = self._spawn(self.cluster_spec.as_dict(), job, index)
        self._processes[job, index] = proc
        self._await_ready((job, index), proc, self._options["timeout"])

    @staticmethod
    def _await_ready(key: tuple[str, int], proc: subprocess.Popen, timeout: float) -> str:
        target = await_ready(proc, timeout)
        if target is None:
            code = proc.poll()
            raise errors.UnavailableError(
                f"Task /job:{key[0]}/task:{key[1]} did not start within {timeout} s "
                f"({'exited with ' + str(code) if code is not None else 'still starting'}).")
        return target.split("://", 1)[1]

    def target(self, job: str, index: int = 0) -> str:
        """The target of one task."""
        return self.targets[job][index]

    def process(self, job: str, index: int = 0) -> subprocess.Popen:
        """The process of one task (for fault-injection tests)."""
        return self._processes[job, index]

    def close(self, timeout: float = 10.0) -> None:
        """Stop every task (SIGTERM, then SIGKILL after ``timeout``) and reap it."""
        for proc in self._processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._processes.values():
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
