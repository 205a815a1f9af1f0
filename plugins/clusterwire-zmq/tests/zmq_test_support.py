"""Helpers shared by the zmq plugin's tests.

Not a conftest.py: the repository's own tests import theirs as ``conftest``, and a second
one on the same test run would shadow it.
"""

from __future__ import annotations

import contextlib
import socket
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
