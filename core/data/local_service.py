"""LocalDataService: a dispatcher and workers as processes of their own on this host.

What a user tries the data service with before there are input hosts (and what the
examples train from): ``python -m clusterwire dispatcher`` and ``... worker`` processes on
127.0.0.1, ports picked by the kernel, each ready before the constructor returns. The
workers' token (``clusterwire.data.worker_auth``) is a random one made here, handed to the
dispatcher and to the workers through their environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from clusterwire.data import worker_auth
from clusterwire.data.cli import await_ready
from clusterwire.errors import UnavailableError

_READY_S = 60.0
_STOP_S = 30.0


class LocalDataService:
    """``workers`` data-service workers and their dispatcher, each a process on 127.0.0.1.

    ``data_transfer_protocol``: the workers also serve elements over it (e.g.
    ``"grpc+local"``); ``imports``: modules the workers import (where ``@data.function``s
    live); ``readable_dirs``: the directories and URL prefixes the workers may read files
    under (``--readable-dir``; none by default). ``target`` is the dispatcher's, for
    ``distribute``. ``stop()`` (also at the end of a ``with`` block) SIGTERMs them all and
    returns their exit statuses.
    """

    def __init__(self, workers: int = 2, data_transfer_protocol: str | None = None,
                 imports: Sequence[str] = (), readable_dirs: Sequence[str] = ()):
        self._processes: list[subprocess.Popen] = []
        self._env = {**os.environ, worker_auth.ENV: worker_auth.new_token().decode()}
        self._env.pop(worker_auth.ENV_FILE, None)  # the token above, not an inherited one
        extra = ["--data-transfer-protocol", data_transfer_protocol] \
            if data_transfer_protocol else []
        for module in imports:
            extra += ["--import", module]
        for prefix in readable_dirs:
            extra += ["--readable-dir", os.fspath(prefix)]
        try:
            self.target = self._start("dispatcher", "--bind-address", "127.0.0.1")
            for _ in range(workers):
                self._start("worker", "--dispatcher-address", self.target.split("://")[1],
                            "--worker-address", "127.0.0.1:%port%", *extra)
        except BaseException:
            self.stop()
            raise

    def _start(self, command: str, *args: str) -> str:
        process = subprocess.Popen([sys.executable, "-m", "clusterwire", command, "--port", "0",
                                    "--quiet", *args], stdout=subprocess.PIPE, text=True,
                                   env=self._env)
        self._processes.append(process)
        target = await_ready(process, _READY_S)
        if target is None:
            raise UnavailableError(
                f"`clusterwire {command}` did not start within {_READY_S:g} s (exit status "
                f"{process.poll()}); run it by hand to see why.")
        return target

    def stop(self) -> list[int | None]:
        """SIGTERM every server; their exit statuses (None: one had to be killed)."""
        codes: list[int | None] = []
        for process in self._processes:
            process.terminate()
            try:
                codes.append(process.wait(_STOP_S))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                codes.append(None)
            process.stdout.close()
        self._processes = []
        return codes

    def __enter__(self) -> LocalDataService:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
