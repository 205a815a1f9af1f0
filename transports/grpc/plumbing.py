"""gRPC pieces shared by the transports whose control plane is gRPC.

Binding with or without TLS, opening channels with the matching credentials,
carrying and checking the cluster token, and mapping gRPC failures to
clusterwire errors.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent import futures

import grpc

from clusterwire import errors
from clusterwire.addressing import join_host_port, split_host_port
from clusterwire.security import TOKEN_KEY, Security
from clusterwire.transport import ConnectionFailed, HandshakeFailed, ListenOptions

#: gRPC metadata key of the cluster token ("-bin": any bytes allowed).
TOKEN_METADATA = f"{TOKEN_KEY}-bin"
_STOP_SLACK_S = 10.0
_DEFAULT_LIMITS = ListenOptions()
_LOG = logging.getLogger(__name__)


def bind(server: grpc.Server, address: str, security: Security) -> str:
    """Bind ``address`` (TLS if configured); the contact address with the bound port."""
    tls = security.tls
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            if not (tls.certificate_chain and tls.private_key):
                raise errors.InvalidArgumentError(
                    "A TLS server needs tls_cert_file and tls_key_file.")
            credentials = grpc.ssl_server_credentials(
                [(tls.private_key, tls.certificate_chain)],
                root_certificates=tls.root_certificates,
                require_client_auth=tls.require_client_auth)
            port = server.add_secure_port(address, credentials)
        reason = "address in use or not local"
    except RuntimeError as err:
        port, reason = 0, str(err)
    if not port:
        raise errors.UnavailableError(
            f"Could not bind {address} ({reason}). Choose a free port, or port 0 to let the "
            "system pick one, and a host name of this machine.")
    return join_host_port(split_host_port(address)[0], port)


def connection_args(limits: ListenOptions) -> list[tuple[str, int]]:
    """gRPC core's arguments for ``limits``' connection limits (its accept loop is in C).

    gRPC core cannot tell an authenticated connection from another (the token rides on
    each call) and has one quota for all of them, closing the newest connection over it
    at accept; it cannot close the oldest unauthenticated one instead. So the quota is
    ``max_connections + max_pending_connections`` and unauthenticated connections leave
    by time: a connection whose TLS handshake and HTTP/2 settings are not done within
    ``handshake_timeout_seconds`` is closed, and so is one with no call for as long
    (gRPC's idle limit; it also ends idle client connections, which reconnect on their
    next call).
    """
    handshake_ms = max(int(limits.handshake_timeout_seconds * 1000), 1)
    return [("grpc.max_allowed_incoming_connections",
             limits.max_connections + limits.max_pending_connections),
            ("grpc.server_handshake_timeout_ms", handshake_ms),
            ("grpc.max_connection_idle_ms", handshake_ms)]


class _TokenGate(grpc.ServerInterceptor):
    """Refuses calls without the cluster token before gRPC reads their request.

    It runs on gRPC's own serving thread; a call it refuses gets a streaming handler
    that aborts at once, so even a unary request that never finishes arriving takes
    no pool thread (grpcio waits for a unary request on the pool thread, with no
    timeout).
    """

    def __init__(self, security: Security):
        self._security = security

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        presented = next((v for k, v in details.invocation_metadata if k == TOKEN_METADATA),
                         None)
        try:
            self._security.check_token(presented)
        except errors.UnauthenticatedError as err:
            message = err.message  # ``err`` is unbound once the except block ends
            return grpc.stream_unary_rpc_method_handler(
                lambda requests, context: context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                                        message))
        return continuation(details)


class ControlServer:
    """A gRPC server on its own thread pool, bound (with TLS if configured) when created.

    ``limits``: the listener's options, whose connection limits it enforces (see
    ``connection_args``). With a token, calls without it are refused before their
    request is read.
    """

    def __init__(self, address: str, security: Security, service: str,
                 handlers: Mapping[str, grpc.RpcMethodHandler], max_workers: int, name: str,
                 options: Sequence[tuple[str, object]] = (),
                 limits: ListenOptions = _DEFAULT_LIMITS):
        self.pool = futures.ThreadPoolExecutor(max_workers,
                                               thread_name_prefix=f"clusterwire-{name}")
        self.server = grpc.server(
            self.pool, interceptors=[_TokenGate(security)] if security.token else None,
            options=[("grpc.so_reuseport", 0), *connection_args(limits), *options])
        # Registered methods (what grpc_tools generates): gRPC core matches them itself, with
        # no per-call Python lookup of the method; clients mark theirs _registered_method.
        self.server.add_registered_method_handlers(service, dict(handlers))
        self.address = address  # the contact address (bound port) once bound
        try:
            self.address = bind(self.server, address, security)
        except errors.OpError:
            self.stop(None)
            raise

    def start(self) -> None:
        """Start serving."""
        self.server.start()

    def stop(self, grace: float | None) -> None:
        """Stop (in-flight calls get ``grace`` seconds), then release the pool."""
        # Bounded: gRPC never reports the stop done if its polling thread died.
        if not self.server.stop(grace).wait((grace or 0.0) + _STOP_SLACK_S):
            _LOG.warning("The gRPC server at %s did not confirm its stop within %.0f s.",
                         self.address, (grace or 0.0) + _STOP_SLACK_S)
        self.pool.shutdown(wait=False)


def open_channel(address: str, security: Security,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to ``address`` with TLS credentials when configured."""
    tls = security.tls
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.root_certificates, private_key=tls.private_key,
        certificate_chain=tls.certificate_chain)
    return grpc.secure_channel(address, credentials, options=list(options))


def token_metadata(security: Security) -> tuple[tuple[str, bytes], ...] | None:
    """The call metadata that carries the token, if there is one."""
    return ((TOKEN_METADATA, security.token),) if security.token else None


def grpc_error(err: grpc.RpcError, address: str,
               security: Security | None = None) -> errors.OpError:
    """The clusterwire error for a gRPC failure talking to ``address`` with ``security``."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    lowered = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE and details == "Cancelling all calls":
        # What a gRPC server's stop() tells calls still running after the grace period.
        return errors.CancelledError(f"The server at {address} stopped during the call.")
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in lowered:
        if ("certificate_verify_failed" in lowered or "peer_did_not_return" in lowered
                or "verification check failed" in lowered):
            return errors.UnauthenticatedError(
                f"TLS to {address}: the certificate was refused ({_reason(details)}). Check "
                "tls_ca_file and that the certificate is current and names this host "
                f"({split_host_port(address)[0]}).")
        tls = security.tls if security is not None else None
        if lowered.endswith(": socket closed") and tls is not None and not tls.certificate_chain:
            return errors.UnauthenticatedError(
                f"TLS to {address}: the server closed the connection during the handshake; it "
                "requires a client certificate (mutual TLS), which this client does not "
                "present: set tls_cert_file and tls_key_file.")
        if "wrong_version_number" in lowered:
            return HandshakeFailed(
                f"TLS to {address} failed: the server does not speak TLS ({_reason(details)}).")
        if "socket closed" in lowered:
            return HandshakeFailed(
                f"{address} closed the connection at once: it holds its max_connections, or "
                "it requires TLS, or a client certificate, that this client does not present "
                "(then set tls_ca_file, and tls_cert_file/tls_key_file for mutual TLS).")
        return ConnectionFailed(f"cannot connect to {address}: {details}")
    return errors.error_from_code(code.value[0], details)


def _reason(details: str) -> str:
    return details.rsplit(":", 2)[-2].strip() if details.count(":") >= 2 else details


def status_code(code: int) -> tuple[int, str]:
    """The grpc.StatusCode value of a clusterwire error code."""
    return next(s.value for s in grpc.StatusCode if s.value[0] == code)
