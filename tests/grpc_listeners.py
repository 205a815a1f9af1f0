"""Test support for the grpc transport: a started listener in this process and a channel to
it, both with the same cluster token and, if given, TLS (used by test_grpc_limits,
test_grpc_lane and test_grpc_lane_tls)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from clusterwire.security import Security, TlsConfig
from clusterwire.testing.peer import echo_handler
from clusterwire.transport import Frame, ListenOptions
from clusterwire.transports.grpc.transport import GrpcListener, GrpcTransport

TOKEN = b"t" * 32


@contextlib.contextmanager
def listening(transport_options: dict | None = None,
              handler: Callable[[Frame], Frame] = echo_handler,
              tls: TlsConfig | None = None, **limits) -> Iterator[GrpcListener]:
    """A started grpc listener on 127.0.0.1 (the transport's ``transport_options``) serving
    ``handler`` with TOKEN, ``tls`` and the ``ListenOptions`` ``limits``; stopped at the
    end."""
    listener = GrpcTransport(transport_options).listen(
        "127.0.0.1:0", handler,
        ListenOptions(security=Security(tls=tls, token=TOKEN), **limits))
    listener.start()
    try:
        yield listener
    finally:
        listener.stop(0)


@contextlib.contextmanager
def channel_to(address: str, token: bytes | None = TOKEN,
               transport_options: dict | None = None,
               tls: TlsConfig | None = None) -> Iterator:
    """A grpc channel (the transport's ``transport_options``) to ``address`` showing
    ``token``, with ``tls``; closed at the end."""
    channel = GrpcTransport(transport_options).connect(address,
                                                       Security(tls=tls, token=token))
    try:
        yield channel
    finally:
        channel.close()
