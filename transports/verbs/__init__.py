"""The built-in "grpc+verbs" transport plugin: gRPC control plane, UCX data plane.

Needs the ``verbs`` extra (``pip install 'clusterwire[verbs]'``, which brings
ucxx); asking for the protocol without it raises NotFoundError naming the
extra, never a fallback to plain gRPC.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clusterwire.plugins import TransportSpec, hookimpl


def _factory(options: Mapping[str, Any]):
    from clusterwire.transports.verbs.transport import VerbsTransport

    return VerbsTransport(options)


@hookimpl
def clusterwire_add_transports() -> list[TransportSpec]:
    """Register the "grpc+verbs" protocol."""
    return [TransportSpec("grpc+verbs", _factory, "gRPC control plane, UCX data plane")]
