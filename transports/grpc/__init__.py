"""The built-in "grpc" transport plugin."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clusterwire.plugins import TransportSpec, hookimpl


def _factory(options: Mapping[str, Any]):
    from clusterwire.transports.grpc.transport import GrpcTransport

    return GrpcTransport(options)


@hookimpl
def clusterwire_add_transports() -> list[TransportSpec]:
    """Register the "grpc" protocol."""
    return [TransportSpec("grpc", _factory, "frames over gRPC; bulk buffers as chunk streams")]
