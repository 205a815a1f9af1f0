"""``python -m clusterwire.zygote``: a warmed parent that forks ``clusterwire serve`` tasks.

LocalCluster starts one of these per cluster, with the tasks' environment and
working directory. It imports what a task needs once, then forks a child per
request; the child runs ``clusterwire serve`` as ``python -m clusterwire``
would, sharing the imported modules' memory with its siblings copy-on-write.

Why a zygote of our own rather than ``multiprocessing``'s forkserver: the
forkserver is one per launching process with one environment, re-imports the
launcher's ``__main__`` in every child (``python -m clusterwire demo`` would run
the demo again), hands children only pickled arguments (no stdout pipe of their
own), and its children are not its caller's to signal or reap. Here each
request carries the task's argv, working directory, stdout pipe and stderr,
and the zygote reports each child's pid and real exit status.

gRPC is not fork-safe once a channel, a server or its threads exist, so this
process only imports: it never creates a gRPC object and starts no Python
thread (checked before the first fork). The one native thread an import
starts, OpenBLAS's pool, is stopped by OpenBLAS's own fork handler.

Protocol, on the SOCK_SEQPACKET socket that is this process's stdin, one JSON
object per packet: ``{"id", "argv", "cwd"}`` with the child's stdout and stderr
as two attached descriptors, answered ``{"id", "pid"}`` (or ``{"id", "error"}``);
``{"pid", "returncode"}`` once a child is reaped (``subprocess`` convention: a
negative number is the signal that ended it). End of input: the children
still running are SIGKILLed and reaped, then the zygote exits.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import json
import os
import selectors
import signal
import socket
import sys
import threading
from typing import Any, NoReturn

#: What a ``clusterwire serve`` task of the gRPC-based transports imports: the command,
#: the built-in plugins and transports. Third-party plugins and ``--import`` modules are
#: imported by each child after the fork (importing them here might start threads).
PRELOAD = (
    "clusterwire.cli",
    "clusterwire.data.cli",
    "clusterwire.resolvers",
    "clusterwire.server",
    "clusterwire.transports.grpc.transport",
    "clusterwire.transports.local.transport",
    "clusterwire.transports.verbs",
)

#: The receive buffer for one request (the argv holds the cluster spec as JSON); the
#: socket's send buffer is the real limit.
MAX_REQUEST_BYTES = 1 << 20


def _preload() -> None:
    import importlib
    import importlib.metadata

    for module in PRELOAD:
        importlib.import_module(module)
    # Warm what every task's start goes through: the plugin entry-point scan (directory
    # listings are cached) and the command-line parser (compiled patterns are cached).
    importlib.metadata.entry_points(group="clusterwire")
    sys.modules["clusterwire.cli"].build_parser()
    if threading.active_count() != 1:
        raise RuntimeError(f"clusterwire.zygote: importing {PRELOAD} started threads "
                           f"{threading.enumerate()}; forking now would not be safe.")


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    # A launcher that is gone shows as end of input at the next receive.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.send(json.dumps(message).encode())


def _reap(sock: socket.socket, children: set[int]) -> None:
    """Report every child that has exited."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _kill_all(children: set[int]) -> None:
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)


def _die_with(zygote: int) -> None:
    """SIGKILL this child when the zygote dies, so no task outlives it (Linux only)."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is None:
        return
    pr_set_pdeathsig = 1
    prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != zygote:  # it died before prctl took effect
        os._exit(1)


def _become_task(sock: socket.socket, wakeup: tuple[int, int], request: dict[str, Any],
                 stdio: list[int], zygote: int, start_dir: str) -> list[str]:
    """In a fresh child: drop the zygote's descriptors and signal handlers, take the task's
    stdout, stderr and directory; the argv to run."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _die_with(zygote)
    for fd in wakeup:
        os.close(fd)
    sock.detach()  # its descriptor is stdin, replaced below
    devnull = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((devnull, 0), (stdio[0], 1), (stdio[1], 2)):
        os.dup2(source, target)
    for fd in (devnull, *stdio):
        os.close(fd)
    os.chdir(request["cwd"])
    if sys.path and sys.path[0] == start_dir:  # as ``python -m`` started there would have it
        sys.path[0] = request["cwd"]
    sys.argv[1:] = request["argv"]
    gc.enable()
    return request["argv"]


def serve(sock: socket.socket) -> list[str] | None:
    """Fork a task per request until end of input (then None); in a child, its argv."""
    zygote, start_dir = os.getpid(), os.getcwd()
    wakeup = os.pipe()
    os.set_blocking(wakeup[1], False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        selector.register(wakeup[0], selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj == wakeup[0]:
                    os.read(wakeup[0], 4096)
                    _reap(sock, children)
                    continue
                data, stdio, flags, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, 2)
                if not data:
                    _kill_all(children)
                    return None
                request = json.loads(data)
                if len(stdio) != 2 or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    _send(sock, {"id": request["id"], "error": "malformed request"})
                else:
                    gc.freeze()
                    try:
                        pid = os.fork()
                    except OSError as err:
                        _send(sock, {"id": request["id"], "error": str(err)})
                    else:
                        if pid == 0:
                            return _become_task(sock, wakeup, request, stdio, zygote,
                                                start_dir)
                        children.add(pid)
                        _send(sock, {"id": request["id"], "pid": pid})
                for fd in stdio:
                    os.close(fd)


def _exit_status(code: object) -> int:
    """The exit status of ``SystemExit(code)``; a message is printed, as the interpreter does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_task(argv: list[str]) -> NoReturn:
    """Run ``clusterwire serve`` and exit as the interpreter would, but without tearing
    down the modules: that would write to, and so copy, every page shared with the zygote."""
    from clusterwire.cli import main as cli_main

    signum = 0
    try:
        code = cli_main(argv)
    except SystemExit as stop:
        code = _exit_status(stop.code)
    except BaseException as err:
        sys.excepthook(type(err), err, err.__traceback__)
        code, signum = 1, signal.SIGINT if isinstance(err, KeyboardInterrupt) else 0
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: joins threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if signum:  # as the interpreter ends on an uncaught KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(code)


def main() -> int:
    """Warm up, then serve requests on stdin; a forked child runs ``clusterwire serve``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the tasks and the launcher
    # No collections while warming (freed holes in shared pages would be filled, and so
    # copied, by the children), and none of the warm objects in the children's collections.
    gc.disable()
    _preload()
    gc.freeze()
    argv = serve(socket.socket(fileno=sys.stdin.fileno()))
    if argv is not None:
        _run_task(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
