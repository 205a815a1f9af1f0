"""clusterwire-zmq: the "zmq" transport for clusterwire, a separate distribution.

Installing it registers the protocol through the ``clusterwire`` entry-point group, so
``Server(..., protocol="zmq")`` and ``Session("zmq://host:port")`` use it. pyzmq is
imported only when the transport is first used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clusterwire.plugins import TransportSpec, hookimpl


def _factory(options: Mapping[str, Any]):
    from clusterwire_zmq.transport import ZmqTransport

    return ZmqTransport(options)


@hookimpl
def clusterwire_add_transports() -> list[TransportSpec]:
    """Register the "zmq" protocol."""
    return [TransportSpec("zmq", _factory, "frames over ZeroMQ ROUTER/DEALER; zero-copy buffers")]
