"""The built-in "grpc+local" transport plugin (same process / same host)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clusterwire.plugins import TransportSpec, hookimpl


def _factory(options: Mapping[str, Any]):
    from clusterwire.transports.local.transport import LocalTransport

    return LocalTransport(options)


@hookimpl
def clusterwire_add_transports() -> list[TransportSpec]:
    """Register the "grpc+local" protocol."""
    return [TransportSpec("grpc+local", _factory,
                          "gRPC control; in-process hand-off or sealed shared memory")]
