"""Helpers shared by the zmq plugin's tests.

Not a conftest.py: the repository's own tests import theirs as ``conftest``, and a second
one on the same test run would shadow it.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator

import numpy as np

from clusterwire.plugins import get_plugin_manager
from clusterwire.security import Security
from clusterwire.testing.peer import echo_handler
from clusterwire.transport import Channel, Handler, Listener, ListenOptions, Transport


def zmq_transport() -> Transport:
    """The process-wide zmq transport, as the core gets it."""
    return get_plugin_manager().transport("zmq")


@contextlib.contextmanager
def serving(handler: Handler = echo_handler, options: ListenOptions | None = None,
            address: str = "127.0.0.1:0", transport: Transport | None = None
            ) -> Iterator[Listener]:
    """A started listener, stopped at exit."""
    listener = (transport or zmq_transport()).listen(address, handler,
                                                     options or ListenOptions())
    listener.start()
    try:
        yield listener
    finally:
        listener.stop(0)


@contextlib.contextmanager
def channel_to(address: str, security: Security | None = None,
               transport: Transport | None = None) -> Iterator[Channel]:
    """A channel, closed at exit."""
    channel = (transport or zmq_transport()).connect(address, security)
    try:
        yield channel
    finally:
        channel.close()


def free_port() -> int:
    """A port nothing listens on (bound and released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def payload(nbytes: int, seed: int = 0) -> np.ndarray:
    """Deterministic random bytes."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


_LISTENER = """
import os, resource, sys
from clusterwire.plugins import get_plugin_manager
from clusterwire.testing.peer import echo_handler
from clusterwire.transport import ListenOptions
listener = get_plugin_manager().transport("zmq").listen(
    "127.0.0.1:0", echo_handler, ListenOptions(max_message_bytes=int(sys.argv[1])))
listener.start()
if int(sys.argv[2]):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare = len(os.listdir("/proc/self/fd")) + int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (spare, hard))
print(listener.address, flush=True)
sys.stdin.read()
listener.stop(0)
"""


@contextlib.contextmanager
def listener_process(max_message_bytes: int, spare_descriptors: int = 0
                     ) -> Iterator[tuple[subprocess.Popen, str]]:
    """An echoing zmq listener in a process of its own: ``(process, address)``; it stops
    when its stdin closes. With ``spare_descriptors``, the process may open only that many
    descriptors more once the listener runs (RLIMIT_NOFILE)."""
    process = subprocess.Popen(
        [sys.executable, "-c", _LISTENER, str(max_message_bytes), str(spare_descriptors)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = process.stdout.readline().strip()
        assert address, "the listener process did not start"
        yield process, address
    finally:
        process.stdin.close()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def _status_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"/proc/{pid}/status has no {field}")


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` now, MiB."""
    return _status_mib(pid, "VmRSS")


def peak_rss_mib(pid: int) -> float:
    """The most resident memory process ``pid`` ever had, MiB (no peak missed between
    samples)."""
    return _status_mib(pid, "VmHWM")
