"""clusterwire.testing.hosts: rehearse a cluster on one machine, each task on a host of its own.

``EmulatedHosts(n)`` makes ``n`` emulated hosts: Linux network namespaces, each with a veth
pair (``eth0`` in the host, ``h<i>`` on the bridge of a "switch" namespace), loopback up and
an address of TEST-NET-1 (``Host.address``: 192.0.2.10, .11, ...; RFC 5737, never routed
anywhere). Nothing is created in the root namespace, so traffic between hosts never leaves
the namespaces of the test bed. Processes of different hosts share the machine's CPUs,
memory and file system; only the network is theirs::

    from clusterwire.testing.hosts import EmulatedHosts

    with EmulatedHosts(3) as hosts:
        server = hosts[0].serve("serve", "--cluster", ...)   # python -m clusterwire ...
        server.wait_ready()                                  # .target, .address
        client = hosts[2].interpreter()                      # a Python to run code in
        client.exec("import clusterwire")
        hosts.cut(0)                                         # host 0 loses its link
        hosts.partition({0, 1}, {2})                         # or: groups that cannot talk
        hosts.heal()

``Host.serve`` starts a ``clusterwire`` command (serve, dispatcher, worker...) as a fork of
the host's zygote (``clusterwire.zygote``, as LocalCluster starts its tasks): one Python per
host and environment, started in the host's namespace on the first ``serve``, that has
imported clusterwire once, so a host's tasks pay neither an interpreter start nor those
imports each (``--import`` modules are imported by each task). ``Host.popen``, ``Host.run``
and ``Host.interpreter`` start a process of its own there, in a session of its own.

Leaving the ``with`` block ends the zygotes (each SIGKILLs its tasks), kills the other
processes with their sessions (and anything else still in the namespaces) and deletes every
namespace, and with them the veths and the bridges. Names carry the pid of the process that
made them, so a
crashed earlier run cannot collide with this one: its namespaces are deleted when the next
test bed starts (``remove_stale``).

Needs Linux, root (``ip netns add`` and veths need CAP_SYS_ADMIN and CAP_NET_ADMIN),
iproute2's ``ip`` and a kernel with veth and bridge devices. ``netns_available()`` says
whether this machine has them (and if not, what is missing and the fix); ``EmulatedHosts``
raises ``clusterwire.errors.FailedPreconditionError`` with that reason. This module does
not import pytest: a test suite makes its own skip marker from ``netns_available()``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import IO, Any

from clusterwire import errors
from clusterwire.local_cluster import await_ready
from clusterwire.task_launcher import TaskLauncher, TaskProcess

#: What the names of a test bed's namespaces start with.
PREFIX = "cwhost-"
SUBNET = "192.0.2"
#: Host ``i`` has address ``SUBNET.(FIRST_HOST + i)``.
FIRST_HOST = 10
#: The most hosts one test bed holds (the addresses left in the /24).
MAX_HOSTS = 254 - FIRST_HOST
_STALE = re.compile(re.escape(PREFIX) + r"(\d+)-")
_IP_TIMEOUT_S = 10.0
#: How long ``Host.serve`` waits for its zygote to fork a task (the first waits for the
#: zygote's start and imports).
_FORK_TIMEOUT_S = 60.0
#: How long a task that did not serve is given to finish writing its stderr.
_STDERR_WAIT_S = 5.0
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
        raise errors.UnknownError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
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


def netns_available() -> tuple[bool, str]:
    """Whether emulated hosts can be made on this machine: ``(True, "")``, or ``(False,
    reason)`` naming what is missing and the fix. Probed once (a namespace with a bridge and
    a veth pair, made and deleted), then remembered."""
    reason = _probe()
    return reason is None, reason or ""


@functools.cache
def _probe() -> str | None:
    if sys.platform != "linux":
        return (f"emulated hosts need Linux network namespaces, and this is {sys.platform}: "
                "run on Linux (a VM or a privileged container will do)")
    if os.geteuid() != 0:
        return ("emulated hosts need root (ip netns add, veth and bridge devices need "
                "CAP_SYS_ADMIN and CAP_NET_ADMIN): run as root, e.g. with sudo")
    if shutil.which("ip") is None:
        return ("emulated hosts need iproute2's `ip` command, which is not on PATH: install "
                "iproute2 (apt-get install iproute2)")
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except (errors.OpError, OSError, subprocess.TimeoutExpired) as err:
        return (f"network namespaces with a veth pair and a bridge cannot be made here "
                f"({err}): load the kernel's veth and bridge modules (modprobe veth bridge), "
                "and in a container run it privileged (--privileged, or CAP_SYS_ADMIN and "
                "CAP_NET_ADMIN)")
    finally:
        _ip("netns", "delete", probe, check=False)
    return None


def host_env(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """This process's environment with ``env`` laid over it (a None value removes a name)."""
    merged: dict[str, str | None] = {**os.environ, **(env or {})}
    return {name: value for name, value in merged.items() if value is not None}


class _Drain:
    """Reads a text stream to its end on a thread, keeping what it read."""

    def __init__(self, stream: IO[str]):
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True,
                                        name="clusterwire-hosts-drain")
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        with contextlib.suppress(ValueError, OSError):  # the pipe was closed
            for line in stream:
                with self._lock:
                    self._lines.append(line)

    def text(self, wait: float = 0.0) -> str:
        """What was read so far, once the stream ended or ``wait`` seconds passed."""
        self._thread.join(wait)
        with self._lock:
            return "".join(self._lines)


class Served:
    """A ``clusterwire`` command started in a host by ``Host.serve``.

    ``process`` is its process (``pid``, ``poll()``, ``wait()``, ``send_signal()``,
    ``terminate()``, ``kill()`` as on a Popen); ``target`` (``grpc://192.0.2.10:2222``) and
    ``address`` (``192.0.2.10:2222``) are set once ``wait_ready()`` has returned.
    """

    def __init__(self, host: Host, command: str, process: TaskProcess):
        self.host = host
        self.command = command
        self.process = process
        self.target: str | None = None
        self.address: str | None = None
        assert process.stderr is not None
        self._stderr = _Drain(process.stderr)

    def wait_ready(self, timeout: float = 30.0) -> Served:
        """Wait until it serves (it printed its ready line); ``UnavailableError`` with what
        it wrote to stderr if it did not within ``timeout`` seconds, or exited."""
        target = await_ready(self.process, timeout)
        if target is None:
            said = self._stderr.text(wait=_STDERR_WAIT_S)  # all of it, if it is exiting
            raise errors.UnavailableError(
                f"`clusterwire {self.command}` in {self.host.name} ({self.host.address}) did "
                f"not serve within {timeout} s (exit status {self.process.poll()}): {said}")
        self.target, self.address = target, target.split("://", 1)[1]
        return self

    def stderr(self) -> str:
        """What it wrote to stderr so far."""
        return self._stderr.text()


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a host's interpreter (its cause here)."""


class Interpreter:
    """A Python interpreter in a host, running the code it is sent in one scope.

    ``exec(source)`` runs statements, ``eval(source)`` returns an expression's value
    (pickled over); an exception raised there is raised here, caused by a RemoteTraceback.
    Each waits at most ``timeout`` seconds for the answer (then ``DeadlineExceededError``,
    and the interpreter is not used again); ``UnavailableError`` if it has exited.
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
        """Run the statements ``source`` in the interpreter's scope."""
        self._ask("exec", source, timeout)

    def eval(self, source: str, timeout: float = 30.0) -> Any:
        """The value of the expression ``source`` in the interpreter's scope (it must
        pickle)."""
        return self._ask("eval", source, timeout)

    def _ask(self, kind: str, source: str, timeout: float) -> Any:
        if self._broken:
            raise errors.UnavailableError(
                f"The interpreter in {self.host.name} is unusable: {self._broken}.")
        try:
            self._conn.send((kind, source))
            answered = self._conn.poll(timeout)
            reply = self._conn.recv() if answered else None
        except (EOFError, OSError) as err:
            self._broken = f"it exited ({self.process.poll()})"
            raise errors.UnavailableError(
                f"The interpreter in {self.host.name} is gone ({err!r}) running {source!r}; "
                f"output:\n{self.output()}") from None
        if reply is None:
            self._broken = f"no answer within {timeout} s to {source!r}"
            raise errors.DeadlineExceededError(
                f"{self.host.name}: {self._broken}; output:\n{self.output()}")
        if reply[0] == "error":
            raise reply[1] from RemoteTraceback(
                f"in {self.host.name} ({self.host.address}):\n{reply[2]}")
        return reply[1]

    def close(self) -> None:
        """Close the connection: the interpreter ends (the test bed's teardown kills it in
        any case)."""
        self._conn.close()


class Host:
    """One emulated host: a network namespace (``name``) with ``address`` on ``eth0``."""

    def __init__(self, bed: EmulatedHosts, index: int):
        self.bed = bed
        self.index = index
        self.name = f"{bed.prefix}-h{index}"
        self.address = f"{SUBNET}.{FIRST_HOST + index}"
        self.switch_port = f"h{index}"  # its veth's end on the bridge
        # One zygote per environment: variables read at interpreter start or import must
        # reach a task as they would a process of its own.
        self._launchers: dict[tuple[tuple[str, str], ...], TaskLauncher] = {}
        self._launchers_lock = threading.Lock()

    def popen(self, argv: Sequence[str], env: Mapping[str, str | None] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` in this host as a process of its own, in a session of its own
        (killed with its process group at teardown); ``kwargs`` go to ``subprocess.Popen``."""
        process = subprocess.Popen(["ip", "netns", "exec", self.name, *argv],
                                   env=host_env(env), start_new_session=True, **kwargs)
        self.bed.processes.append(process)
        return process

    def run(self, argv: Sequence[str], timeout: float = 30.0,
            env: Mapping[str, str | None] | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` in this host to its end; its output captured as text
        (``subprocess.TimeoutExpired`` after ``timeout`` seconds, the process killed)."""
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
        """Start ``clusterwire COMMAND ARGS --quiet`` (as ``python -m clusterwire`` would) in
        this host, forked from its zygote for ``env`` (this process's environment with
        ``env`` laid over it; the zygote is started on the first call with that environment).
        Returns once the process exists: ``wait_ready()`` on the result waits for it to
        serve, so start several first, then wait."""
        merged = host_env(env)
        with self._launchers_lock:
            key = tuple(sorted(merged.items()))
            launcher = self._launchers.get(key)
            if launcher is None:
                launcher = TaskLauncher(merged, ["ip", "netns", "exec", self.name])
                self._launchers[key] = launcher
        process = launcher.spawn([command, *args, "--quiet"], _FORK_TIMEOUT_S)
        self.bed.tasks.append(process)
        return Served(self, command, process)

    def interpreter(self, env: Mapping[str, str | None] | None = None) -> Interpreter:
        """A Python interpreter running in this host (see ``Interpreter``), with this
        process's environment and ``env`` laid over it."""
        interpreter = Interpreter(self, env)
        self.bed.interpreters.append(interpreter)
        return interpreter

    def close_zygotes(self, timeout: float = _IP_TIMEOUT_S) -> None:
        """End this host's zygotes (each SIGKILLs the tasks it forked that still run)."""
        with self._launchers_lock:
            launchers, self._launchers = list(self._launchers.values()), {}
        for launcher in launchers:
            launcher.close(timeout)


class EmulatedHosts:
    """``count`` emulated hosts on one bridge; a context manager (see the module).

    ``hosts[i]`` (or ``hosts.hosts[i]``) is host ``i``, whose address is
    ``192.0.2.(10 + i)``; ``tasks``, ``processes`` and ``interpreters`` list what
    ``Host.serve``, ``Host.popen`` (and ``run``) and ``Host.interpreter`` started, and
    ``prefix`` begins the names of its namespaces (``switch`` is the bridge's).
    ``FailedPreconditionError`` if namespaces cannot be made here
    (``netns_available()``), ``InvalidArgumentError`` for a count out of 1..MAX_HOSTS.
    """

    def __init__(self, count: int):
        if isinstance(count, bool) or not isinstance(count, int) or not (
                1 <= count <= MAX_HOSTS):
            raise errors.InvalidArgumentError(
                f"EmulatedHosts takes 1 to {MAX_HOSTS} hosts (one address each in "
                f"{SUBNET}.0/24), got {count!r}.")
        available, reason = netns_available()
        if not available:
            raise errors.FailedPreconditionError(f"Cannot make emulated hosts: {reason}.")
        remove_stale()
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_serials)}"
        _open_beds.add(self.prefix)
        self.switch = f"{self.prefix}-sw"
        self.hosts = [Host(self, index) for index in range(count)]
        self.processes: list[subprocess.Popen] = []  # Host.popen's
        self.tasks: list[TaskProcess] = []  # Host.serve's
        self.interpreters: list[Interpreter] = []
        self._logs: list[IO[bytes]] = []
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

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __enter__(self) -> EmulatedHosts:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def log_file(self) -> IO[bytes]:
        """A temporary file for a process's output, closed at teardown."""
        log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        return log

    def cut(self, index: int) -> None:
        """Take host ``index``'s link down on the switch side: the host is lost to the others
        (and they to it) until ``heal``. Its processes keep running."""
        self._on_switch("link", "set", self.hosts[index].switch_port, "down")

    def partition(self, *groups: Iterable[int]) -> None:
        """Split the hosts into ``groups`` (every host in exactly one) that reach each other
        only within their group: each group gets a bridge of its own."""
        members = [set(group) for group in groups]
        listed = sorted(i for group in members for i in group)
        if listed != list(range(len(self.hosts))):
            raise errors.InvalidArgumentError(
                f"partition takes every host index (0 to {len(self.hosts) - 1}) in exactly "
                f"one group, got {groups!r}.")
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
        """Kill every process started in the hosts, delete every namespace (idempotent);
        ``UnknownError`` naming any namespace that could not be deleted."""
        for interpreter in self.interpreters:
            interpreter.close()
        for host in self.hosts:
            host.close_zygotes()
        for task in self.tasks:
            task.close_pipes()
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
        self.processes, self.tasks, self.interpreters = [], [], []
        self._logs, self._namespaces = [], []
        if left:
            raise errors.UnknownError(f"Namespaces left behind: {left}.")
