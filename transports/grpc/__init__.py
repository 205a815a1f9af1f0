"""The built-in "grpc" transport plugin."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from clusterwire.plugins import TransportSpec, hookimpl

# Before grpc is first imported (by any of the gRPC-based transports): no log lines
# from the C core (e.g. for every refused TLS handshake, or a bind error that
# clusterwire reports itself). GRPC_VERBOSITY=error (or debug) brings them back.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")


def _factory(options: Mapping[str, Any]):
    from clusterwire.transports.grpc.transport import GrpcTransport

    return GrpcTransport(options)


@hookimpl
def clusterwire_add_transports() -> list[TransportSpec]:
    """Register the "grpc" protocol."""
    return [TransportSpec("grpc", _factory, "frames over gRPC; bulk buffers as chunk streams")]
