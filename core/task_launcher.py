"""The launcher's side of ``clusterwire.zygote``: start tasks as forks of a warmed parent.

``TaskLauncher(env)`` starts one zygote with exactly ``env``; ``spawn(argv)``
has it fork a child that runs ``clusterwire serve`` with ``argv`` in the
caller's working directory, stdout and stderr on new pipes. The child is the
zygote's, not ours, so ``TaskProcess`` offers the part of ``subprocess.Popen``
that LocalCluster and its users need (``pid``, ``stdout``, ``stderr``, ``poll``,
``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``), with the
exit status the zygote reports. The caller must drain both pipes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TextIO

from clusterwire import errors

_MAX_REPLY_BYTES = 1 << 12


class TaskProcess:
    """A task process forked by the zygote (a ``subprocess.Popen`` look-alike)."""

    def __init__(self, args: list[str], stdout: TextIO, stderr: TextIO):
        self.args = args
        self.stdout: TextIO | None = stdout
        self.stderr: TextIO | None = stderr
        self.pid = 0
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        """The exit status once the process has exited, else None."""
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; ``subprocess.TimeoutExpired`` if it has not exited in time."""
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process unless it has exited."""
        if self.returncode is None:
            # Exited but not reported yet: gone, or a zombie until the zygote reaps it.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM: the task stops gracefully."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def _exit(self, returncode: int) -> None:
        self.returncode = returncode
        self._exited.set()

    def close_pipes(self) -> None:
        """Close this side of the stdout and stderr pipes."""
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.close()

    def __repr__(self) -> str:
        return f"<TaskProcess pid={self.pid} returncode={self.returncode}>"


class TaskLauncher:
    """A zygote started with ``env`` and the tasks it forks; ``close()`` ends it.

    ``wrapper`` is a command the zygote is started through (``ip netns exec NAME``: it and
    its tasks run in that network namespace, clusterwire.testing.hosts)."""

    def __init__(self, env: Mapping[str, str], wrapper: Sequence[str] = ()):
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with theirs:
                self._zygote = subprocess.Popen(
                    [*wrapper, sys.executable, "-m", "clusterwire.zygote"], stdin=theirs,
                    stdout=subprocess.DEVNULL, env=dict(env))
        except BaseException:
            self._sock.close()
            raise
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._next_id = 0
        self._pending: dict[int, tuple[Future, TaskProcess]] = {}
        self._running: dict[int, TaskProcess] = {}
        self._gone = False
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="clusterwire-zygote-reader")
        self._reader.start()

    def start(self, argv: Sequence[str]) -> Future[TaskProcess]:
        """Ask the zygote to fork a task running ``clusterwire serve`` with ``argv``.

        The future holds its TaskProcess (stdout a text pipe) once the zygote has
        forked it; UnavailableError if the zygote cannot fork or has exited.
        """
        cwd = os.getcwd()
        read, write = os.pipe()
        error_read, error_write = os.pipe()
        # The process owns its pipes (close_pipes).
        process = TaskProcess(list(argv), open(read), open(error_read))  # noqa: SIM115
        reply: Future[TaskProcess] = Future()
        with self._lock:
            request_id, self._next_id = self._next_id, self._next_id + 1
            gone = self._gone
            if not gone:
                self._pending[request_id] = (reply, process)
        if gone:
            os.close(write)
            os.close(error_write)
            process.close_pipes()
            raise self._unavailable()
        request = json.dumps({"id": request_id, "argv": process.args, "cwd": cwd}).encode()
        try:
            # Not under self._lock: a send blocked on a full socket must not keep the reader
            # from taking the zygote's answers.
            with self._send_lock:
                socket.send_fds(self._sock, [request], [write, error_write])
        except OSError as err:
            with self._lock:
                self._pending.pop(request_id, None)
            process.close_pipes()
            if err.errno == errno.EMSGSIZE:
                raise errors.InvalidArgumentError(
                    f"A task's command line of {len(request)} bytes is more than the "
                    "zygote's socket takes in one message.") from None
            raise self._unavailable() from None
        finally:
            os.close(write)
            os.close(error_write)
        return reply

    def spawn(self, argv: Sequence[str], timeout: float) -> TaskProcess:
        """``start(argv)`` and wait for the task's process; UnavailableError after ``timeout`` s."""
        return self.started(self.start(argv), timeout)

    def started(self, reply: Future[TaskProcess], timeout: float) -> TaskProcess:
        """The process of a ``start()`` reply; UnavailableError if none came within ``timeout``."""
        try:
            return reply.result(timeout)
        except FutureTimeout:
            raise errors.UnavailableError(
                f"The task launcher (pid {self._zygote.pid}) did not start a task within "
                f"{timeout} s.") from None

    def _unavailable(self) -> errors.UnavailableError:
        code = self._zygote.poll()
        state = f"exited with {code}" if code is not None else "stopped answering"
        return errors.UnavailableError(
            f"The task launcher (python -m clusterwire.zygote, pid {self._zygote.pid}) {state}; "
            "its error, if any, is on stderr.")

    def _read(self) -> None:
        """Route the zygote's answers and exit reports until it closes its end."""
        while data := self._receive():
            message = json.loads(data)
            with self._lock:
                if "id" not in message:
                    self._running.pop(message["pid"])._exit(message["returncode"])
                    continue
                reply, process = self._pending.pop(message["id"])
                if "pid" in message:
                    process.pid = message["pid"]
                    self._running[process.pid] = process
            if "pid" in message:
                reply.set_result(process)
            else:
                process.close_pipes()
                reply.set_exception(errors.UnavailableError(
                    f"The task launcher could not fork a task: {message['error']}"))
        self._zygote.wait()
        with self._lock:
            self._gone = True
            # The zygote SIGKILLs its children before it exits, and a Linux kernel does so
            # when it dies (PR_SET_PDEATHSIG): either way they are gone.
            for process in self._running.values():
                process._exit(-signal.SIGKILL)
            self._running.clear()
            pending, self._pending = list(self._pending.values()), {}
        for reply, process in pending:
            process.close_pipes()
            reply.set_exception(self._unavailable())

    def _receive(self) -> bytes:
        try:
            return self._sock.recv(_MAX_REPLY_BYTES)
        except OSError:
            return b""

    def close(self, timeout: float = 10.0) -> None:
        """End the zygote (it SIGKILLs the tasks still running) and wait for it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        try:
            self._zygote.wait(timeout)
        except subprocess.TimeoutExpired:
            self._zygote.kill()
            self._zygote.wait()
        self._reader.join(timeout)
        self._sock.close()
