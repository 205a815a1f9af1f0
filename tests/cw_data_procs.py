"""Data-service servers as separate processes (``python -m clusterwire dispatcher|worker``)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile

from clusterwire.data import worker_auth
from clusterwire.data.cli import await_ready

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
#: The worker token every dispatcher and worker process of a test run shares (the env).
WORKER_TOKEN_ENV = {worker_auth.ENV: secrets.token_hex(32)}


class ServerProcess:
    """One server process; ``target`` is read from its ready line (not waited for, and
    empty, with ``ready=False``: a worker that its dispatcher does not accept never prints
    it). Dispatchers and workers get WORKER_TOKEN_ENV (``env`` may override it)."""

    def __init__(self, command: str, *args: str, env: dict[str, str] | None = None,
                 timeout: float = 30.0, ready: bool = True):
        path = os.environ.get("PYTHONPATH", "")
        child_env = {**os.environ, "PYTHONPATH": TESTS_DIR + (os.pathsep + path if path else ""),
                     **WORKER_TOKEN_ENV, **(env or {})}
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "clusterwire", command, *args, "--quiet"],
            stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=child_env)
        self.target = self._await_ready(timeout) if ready else ""
        if ready:
            self.address = self.target.split("://", 1)[1]
            self.port = int(self.address.rsplit(":", 1)[1])

    def _await_ready(self, timeout: float) -> str:
        target = await_ready(self.process, timeout)
        if target is None:
            self.kill()
            raise RuntimeError(f"server did not start: {self.stderr()}")
        return target

    def stderr(self) -> str:
        """What the process wrote to stderr so far."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait for the exit code (SIGKILL if it does not come)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def close(self) -> None:
        """Stop the process however it is and release its files."""
        self.kill()
        if self.process.stdout:
            self.process.stdout.close()
        self._stderr.close()
