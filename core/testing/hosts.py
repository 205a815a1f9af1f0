"""Emulated hosts on one machine: Linux network namespaces on a bridge (issue 20's test bed).

``EmulatedHosts(n)`` makes a "switch" namespace holding a bridge and ``n`` host namespaces,
each with a veth pair (``eth0`` in the host, ``h<i>`` on the bridge), loopback up and an
address of TEST-NET-1 (192.0.2.0/24, RFC 5737: never routed anywhere). Nothing is created in
the root namespace, so traffic between hosts never leaves the namespaces of the test bed::

    with EmulatedHosts(3) as hosts:
        server = hosts[0].serve("serve", "--cluster", ...)   # python -m clusterwire ...
        client = hosts[2].interpreter()                      # a Python to run code in
        client.exec("import clusterwire")
        hosts.cut(0)                                         # host 0 loses its link
        hosts.partition({0, 1}, {2})                         # or: groups that cannot talk
        hosts.heal()

Every process started in a host runs in a session of its own; leaving the ``with`` block
kills them (and anything else still in the namespaces) and deletes every namespace, and with
them the veths and the bridges. Names carry the pid of the test process, so a crashed
earlier run cannot collide with this one: its namespaces are deleted when the next test bed
starts. ``requires_netns`` skips a test where namespaces cannot be made (not root, no
``ip``, a kernel without veth or bridge).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import pytest

from clusterwire.local_cluster import await_ready

PREFIX = "cwhost-"
SUBNET = "192.0.2"
_STALE = re.compile(re.escape(PREFIX) + r"(\d+)-")
_IP_TIMEOUT_S = 10.0
_serials = itertools.count()
_open_beds: set[str] = set()  # the prefixes of this process's test beds not yet closed

#: What a host's ``interpreter()`` runs: code sent over a socket, exec'd or eval'd in one
#: scope; the value (or the exception, with its traceback) pickled back.
_AGENT = """
import pickle, sys, traceback
from multiprocessing.connection import Connection

conn = Connection(int(sys.argv[1]))
scope = {"__name__": "__emulated_host__"}
while True:
    try:
        kind, source = conn.recv()
    except EOFError:
        break
    try:
        if kind == "exec":
            exec(source, scope)
            reply = ("ok", None)
        else:
            reply = ("ok", eval(source, scope))
    except BaseException as err:
        error = err
        try:
            pickle.loads(pickle.dumps(err))
        except Exception:
            error = RuntimeError(repr(err))
        reply = ("error", error, traceback.format_exc())
    try:
        payload = pickle.dumps(reply)
    except Exception as err:
        payload = pickle.dumps(("error", RuntimeError(f"cannot send back {reply[1]!r}: {err}"),
                                traceback.format_exc()))
    conn.send_bytes(payload)
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    listing = _ip("netns", "list").stdout.splitlines()
    return [line.split()[0] for line in listing if line.strip()]


def _kill_and_delete(namespace: str) -> None:
    """Kill every process still in ``namespace``, then delete it (its devices go with it)."""
    pids = _ip("netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "delete", namespace, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def remove_stale() -> list[str]:
    """Delete the test-bed namespaces of runs that are gone (their pid is not alive, or is
    this process's but of no open test bed); the names removed."""
    removed = []
    for namespace in _namespaces():
        match = _STALE.match(namespace)
        if not match:
            continue
        pid = int(match[1])
        if (pid == os.getpid() and namespace.rsplit("-", 1)[0] not in _open_beds) or (
                pid != os.getpid() and not _alive(pid)):
            _kill_and_delete(namespace)
            removed.append(namespace)
    return removed


def _unavailable() -> str | None:
    """Why emulated hosts cannot be made here (None: they can)."""
    if sys.platform != "linux":
        return "emulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "emulated hosts need root (ip netns add, veth, bridge)"
    if shutil.which("ip") is None:
        return "emulated hosts need iproute2's `ip` command"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        return f"network namespaces with a veth pair and a bridge cannot be made here: {err}"
    finally:
        _ip("netns", "delete", probe, check=False)
    return None


_REASON = _unavailable()
requires_netns = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def host_env(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """This process's environment with ``env`` laid over it (a None value removes a name)."""
    merged: dict[str, str | None] = {**os.environ, **(env or {})}
    return {name: value for name, value in merged.items() if value is not None}


class Served:
    """A ``python -m clusterwire`` server process started in a host; ``wait_ready()`` waits
    for it to serve and sets ``target`` and ``address``."""

    def __init__(self, host: Host, command: str, process: subprocess.Popen, log: Any):
        self.host = host
        self.command = command
        self.process = process
        self.target: str | None = None
        self.address: str | None = None
        self._log = log

    def wait_ready(self, timeout: float = 30.0) -> Served:
        target = await_ready(self.process, timeout)
        if target is None:
            raise RuntimeError(f"`clusterwire {self.command}` in {self.host.name} did not serve "
                               f"within {timeout} s (exit status {self.process.poll()}): "
                               f"{self.stderr()}")
        self.target, self.address = target, target.split("://", 1)[1]
        return self

    def stderr(self) -> str:
        """What the server wrote to stderr so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a host's interpreter (its cause here)."""


class Interpreter:
    """A Python interpreter in a host, running the code it is sent in one scope.

    ``exec(source)`` runs statements, ``eval(source)`` returns an expression's value
    (pickled over); an exception raised there is raised here, caused by a RemoteTraceback.
    Each waits at most ``timeout`` seconds for the answer.
    """

    def __init__(self, host: Host, env: Mapping[str, str | None] | None):
        self.host = host
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        self._log = host.bed.log_file()
        with theirs:
            self.process = host.popen(
                [sys.executable, "-c", _AGENT, str(theirs.fileno())], env=env,
                pass_fds=[theirs.fileno()], stdout=self._log, stderr=subprocess.STDOUT)
        self._broken: str | None = None

    def output(self) -> str:
        """What the interpreter printed (stdout and stderr) so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def exec(self, source: str, timeout: float = 30.0) -> None:
        self._ask("exec", source, timeout)

    def eval(self, source: str, timeout: float = 30.0) -> Any:
        return self._ask("eval", source, timeout)

    def _ask(self, kind: str, source: str, timeout: float) -> Any:
        if self._broken:
            raise RuntimeError(f"the interpreter in {self.host.name} is unusable: {self._broken}")
        try:
            self._conn.send((kind, source))
            answered = self._conn.poll(timeout)
            reply = self._conn.recv() if answered else None
        except (EOFError, OSError) as err:
            self._broken = f"it exited ({self.process.poll()})"
            raise RuntimeError(f"the interpreter in {self.host.name} is gone ({err!r}) running "
                               f"{source!r}; output:\n{self.output()}") from None
        if reply is None:
            self._broken = f"no answer within {timeout} s to {source!r}"
            raise TimeoutError(f"{self.host.name}: {self._broken}; output:\n{self.output()}")
        if reply[0] == "error":
            raise reply[1] from RemoteTraceback(
                f"in {self.host.name} ({self.host.address}):\n{reply[2]}")
        return reply[1]

    def close(self) -> None:
        self._conn.close()


class Host:
    """One emulated host: a network namespace with ``address`` on ``eth0``."""

    def __init__(self, bed: EmulatedHosts, index: int):
        self.bed = bed
        self.name = f"{bed.prefix}-h{index}"
        self.address = f"{SUBNET}.{10 + index}"
        self.switch_port = f"h{index}"  # its veth's end on the bridge

    def popen(self, argv: Sequence[str], env: Mapping[str, str | None] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` in this host (killed with its process group at teardown)."""
        process = subprocess.Popen(["ip", "netns", "exec", self.name, *argv],
                                   env=host_env(env), start_new_session=True, **kwargs)
        self.bed.processes.append(process)
        return process

    def run(self, argv: Sequence[str], timeout: float = 30.0,
            env: Mapping[str, str | None] | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` in this host to its end; its output captured as text."""
        process = self.popen(argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    def serve(self, command: str, *args: str,
              env: Mapping[str, str | None] | None = None) -> Served:
        """Start ``python -m clusterwire COMMAND ARGS --quiet`` in this host (``wait_ready()``
        on the result waits for it to serve: start several first, then wait)."""
        log = self.bed.log_file()
        process = self.popen([sys.executable, "-m", "clusterwire", command, *args, "--quiet"],
                             env, stdout=subprocess.PIPE, stderr=log, text=True)
        return Served(self, command, process, log)

    def interpreter(self, env: Mapping[str, str | None] | None = None) -> Interpreter:
        """A Python interpreter running in this host (see ``Interpreter``)."""
        interpreter = Interpreter(self, env)
        self.bed.interpreters.append(interpreter)
        return interpreter


class EmulatedHosts:
    """``count`` emulated hosts on one bridge; a context manager (see the module)."""

    def __init__(self, count: int):
        remove_stale()
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_serials)}"
        _open_beds.add(self.prefix)
        self.switch = f"{self.prefix}-sw"
        self.hosts = [Host(self, index) for index in range(count)]
        self.processes: list[subprocess.Popen] = []
        self.interpreters: list[Interpreter] = []
        self._logs: list[Any] = []
        self._namespaces: list[str] = []
        self._bridges = {"br0"}
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        self._add_namespace(self.switch)
        self._on_switch("link", "add", "br0", "type", "bridge")
        self._on_switch("link", "set", "br0", "up")
        for host in self.hosts:
            self._add_namespace(host.name)
            _ip("-n", host.name, "link", "set", "lo", "up")
            self._on_switch("link", "add", host.switch_port, "type", "veth", "peer", "name",
                            "eth0", "netns", host.name)
            self._on_switch("link", "set", host.switch_port, "master", "br0", "up")
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.name, "link", "set", "eth0", "up")

    def _on_switch(self, *args: str) -> None:
        _ip("-n", self.switch, *args)

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __enter__(self) -> EmulatedHosts:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def log_file(self) -> Any:
        """A temporary file for a process's output, closed at teardown."""
        log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        return log

    def cut(self, index: int) -> None:
        """Take host ``index``'s link down on the switch side: the host is lost to the others
        (and they to it) until ``heal``."""
        self._on_switch("link", "set", self.hosts[index].switch_port, "down")

    def partition(self, *groups: Iterable[int]) -> None:
        """Split the hosts into ``groups`` (every host in exactly one) that reach each other
        only within their group: each group gets a bridge of its own."""
        members = [set(group) for group in groups]
        listed = sorted(i for group in members for i in group)
        if listed != list(range(len(self.hosts))):
            raise ValueError(f"every host must be in exactly one group, got {groups!r}")
        for number, group in enumerate(members):
            bridge = f"br{number}"
            if bridge not in self._bridges:
                self._on_switch("link", "add", bridge, "type", "bridge")
                self._on_switch("link", "set", bridge, "up")
                self._bridges.add(bridge)
            for index in group:
                self._on_switch("link", "set", self.hosts[index].switch_port, "master", bridge)

    def heal(self, index: int | None = None) -> None:
        """Bring host ``index``'s link up again; with no index every link, and end any
        partition (every host back on one bridge)."""
        for host in self.hosts if index is None else [self.hosts[index]]:
            if index is None:
                self._on_switch("link", "set", host.switch_port, "master", "br0")
            self._on_switch("link", "set", host.switch_port, "up")

    def close(self) -> None:
        """Kill every process started in the hosts, delete every namespace (idempotent)."""
        for interpreter in self.interpreters:
            interpreter.close()
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(_IP_TIMEOUT_S)
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        for namespace in reversed(self._namespaces):
            _kill_and_delete(namespace)
        left = [name for name in _namespaces() if name.startswith(self.prefix + "-")]
        for log in self._logs:
            log.close()
        _open_beds.discard(self.prefix)
        self.processes, self.interpreters, self._logs, self._namespaces = [], [], [], []
        if left:
            raise RuntimeError(f"namespaces left behind: {left}")
