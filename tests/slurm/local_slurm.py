"""A throw-away Slurm cluster on this host: munged, slurmctld and one slurmd per emulated node.

Everything (config, state, logs, munge key and socket, pid files) lives under one
directory; ``stop()`` ends exactly the daemons ``start()`` started, by their PIDs.
Emulated nodes are named by loopback addresses (``127.0.0.2`` ...): each node then has
its own address, so tasks on different nodes may use the same port, and the node names
a resolver reports are addresses a test can connect to without touching /etc/hosts.
Fake GPUs are gres files backed by character devices (``mknod c 1 3``), which is what
slurmd accepts.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue", "scancel")


def missing_binaries() -> list[str]:
    """The Slurm/munge programs not on PATH (or /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class LocalSlurm:
    """A single-host Slurm with ``nodes`` emulated nodes of ``cpus`` CPUs and ``gpus`` GPUs."""

    base: str
    nodes: int = 2
    cpus: int = 8
    gpus: int = 0
    timeout: float = 60.0
    node_names: list[str] = field(init=False)
    env: dict[str, str] = field(init=False)
    _pids: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.base = os.path.abspath(self.base)
        self.node_names = [f"127.0.0.{i + 2}" for i in range(self.nodes)]
        self.conf = os.path.join(self.base, "etc", "slurm.conf")
        path = os.environ.get("PATH", "")
        self.env = {**os.environ, "SLURM_CONF": self.conf,
                    "PATH": f"{path}{os.pathsep}/usr/sbin{os.pathsep}/sbin"}
        for name in list(self.env):  # a test run inside a Slurm job must not leak its step
            if name.startswith("SLURM_") and name != "SLURM_CONF":
                del self.env[name]

    def _dir(self, *parts: str) -> str:
        path = os.path.join(self.base, *parts)
        os.makedirs(path, exist_ok=True)
        return path

    def _write_config(self) -> None:
        b = self.base
        for sub in ("etc", "state", "run", "log", "munge/lib", "munge/etc"):
            self._dir(sub)
        os.chmod(self._dir("munge", "run"), 0o755)  # munged wants a world-executable socket dir
        os.chmod(b, 0o755)
        os.chmod(self._dir("munge"), 0o755)
        key = os.path.join(b, "munge", "etc", "munge.key")
        with open(key, "wb") as handle:
            handle.write(os.urandom(1024))
        os.chmod(key, 0o400)
        ctld_port, slurmd_port = _free_ports(2)
        gres = ""
        if self.gpus:
            devices = self._dir("dev")
            for index in range(self.gpus):
                device = os.path.join(devices, f"gpu{index}")
                if not os.path.exists(device):
                    os.mknod(device, 0o666 | 0o020000, os.makedev(1, 3))  # like /dev/null
            gres = f" Gres=gpu:{self.gpus}"
            with open(os.path.join(b, "etc", "gres.conf"), "w") as handle:
                handle.write(f"Name=gpu File={devices}/gpu[0-{self.gpus - 1}]\n")
        node_ports = _free_ports(self.nodes)
        lines = [
            "ClusterName=cwtest", "SlurmctldHost=localhost", "SlurmUser=root",
            "SlurmdUser=root", f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={b}/munge/run/munge.sock", f"StateSaveLocation={b}/state",
            f"SlurmdSpoolDir={b}/spool/slurmd.%n", f"SlurmctldPidFile={b}/run/slurmctld.pid",
            f"SlurmdPidFile={b}/run/slurmd.%n.pid", f"SlurmctldLogFile={b}/log/slurmctld.log",
            f"SlurmdLogFile={b}/log/slurmd.%n.log", "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
            "SwitchType=switch/none", "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "MailProg=/bin/true", "ReturnToService=2", "SlurmdParameters=config_overrides",
            # A cancelled step's tasks get SIGTERM, then SIGKILL this many seconds later.
            "KillWait=5",
        ]
        if self.gpus:
            lines.append("GresTypes=gpu")
        for name, port in zip(self.node_names, node_ports, strict=True):
            self._dir("spool", f"slurmd.{name}")
            lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={self.cpus} RealMemory=2048 State=UNKNOWN{gres}")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        with open(self.conf, "w") as handle:
            handle.write("\n".join(lines) + "\n")

    def _daemon(self, argv: list[str], pid_file: str) -> None:
        """Run a self-daemonizing program and record the PID it writes."""
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({result.returncode}): {result.stderr.strip()}"
                               f"; logs in {self.base}/log")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with open(pid_file) as handle:
                    self._pids.append(int(handle.read().split()[0]))
                return
            except (FileNotFoundError, ValueError, IndexError):
                time.sleep(0.05)  # the daemon writes its pid file just after forking
        raise RuntimeError(f"{argv[0]} wrote no pid file {pid_file}")

    def start(self) -> LocalSlurm:
        """Configure and start the daemons, then wait until every node is idle."""
        self._write_config()
        b = self.base
        try:
            self._daemon(["munged", f"--socket={b}/munge/run/munge.sock",
                          f"--key-file={b}/munge/etc/munge.key",
                          f"--pid-file={b}/munge/run/munged.pid", f"--log-file={b}/log/munged.log",
                          f"--seed-file={b}/munge/lib/munged.seed"],
                         f"{b}/munge/run/munged.pid")
            self._daemon(["slurmctld", "-c", "-f", self.conf], f"{b}/run/slurmctld.pid")
            for name in self.node_names:
                self._daemon(["slurmd", "-f", self.conf, "-N", name], f"{b}/run/slurmd.{name}.pid")
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.timeout
        states = ""
        while time.monotonic() < deadline:
            result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env,
                                    capture_output=True, text=True, timeout=30)
            states = result.stdout
            idle = {line.split()[0] for line in states.splitlines()
                    if line.split()[1:] == ["idle"]}
            if idle >= set(self.node_names):
                return
            time.sleep(0.2)  # polling slurmctld's view; nodes register asynchronously
        raise RuntimeError(f"Slurm nodes not idle after {self.timeout} s: {states!r}; "
                           f"logs in {self.base}/log")

    def run(self, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm client command (srun, sbatch, ...) against this cluster."""
        return subprocess.run(argv, env={**self.env, **kwargs.pop("env", {})},
                              capture_output=True, text=True, timeout=timeout, **kwargs)

    def stop(self) -> None:
        """Cancel every job, then end the daemons this object started (slurmd first)."""
        if self._pids:
            self.run(["scancel", "--full", "--user", "root"], timeout=30)
        for pid in reversed(self._pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)  # not our child: no waitpid, so poll until it is gone
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._pids.clear()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
