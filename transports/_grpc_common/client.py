"""Client channels of a gRPC control plane and the call metadata that carries the token."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from clusterwire.security import TOKEN_KEY, Security

#: gRPC metadata key of the cluster token ("-bin": any bytes allowed).
TOKEN_METADATA = f"{TOKEN_KEY}-bin"


def message_size_args(max_receive_bytes: int | None) -> list[tuple[str, int]]:
    """gRPC arguments: receive messages of up to ``max_receive_bytes`` (None: gRPC's
    default), send any size (the receiver enforces its own limit)."""
    sizes = [("grpc.max_send_message_length", -1)]
    if max_receive_bytes is not None:
        sizes.append(("grpc.max_receive_message_length", max_receive_bytes))
    return sizes


def open_channel(address: str, security: Security, max_receive_bytes: int | None = None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to ``address`` with TLS credentials when configured (see
    ``message_size_args`` for ``max_receive_bytes``)."""
    arguments = [*message_size_args(max_receive_bytes), *options]
    tls = security.tls
    if tls is None:
        return grpc.insecure_channel(address, options=arguments)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.root_certificates, private_key=tls.private_key,
        certificate_chain=tls.certificate_chain)
    return grpc.secure_channel(address, credentials, options=arguments)


def token_metadata(security: Security) -> tuple[tuple[str, bytes], ...] | None:
    """The call metadata that carries the token, if there is one."""
    return ((TOKEN_METADATA, security.token),) if security.token else None
