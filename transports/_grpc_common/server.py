"""The gRPC server of a control plane: bound with TLS if configured, the token checked
before a request is read, gRPC core's connection limits set from ``ListenOptions`` and,
with a token, its pending connections held to their rules by a ``door``.

It also serves the standard gRPC health-checking service (``grpc.health.v1.Health``, for
Kubernetes' gRPC probes and load balancers): SERVING once started, NOT_SERVING from the
moment its shell drains until the port closes. Health calls need no cluster token (a probe
carries none); ``health`` bounds what they may hold.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import grpc

from clusterwire import errors
from clusterwire.addressing import join_host_port, split_host_port
from clusterwire.bind_probe import why_unbindable
from clusterwire.security import Security
from clusterwire.thread_pool import ElasticPool
from clusterwire.transport import ListenOptions
from clusterwire.transports._grpc_common.client import TOKEN_METADATA, message_size_args
from clusterwire.transports._grpc_common.door import Door
from clusterwire.transports._grpc_common.health import SERVICE as HEALTH_SERVICE
from clusterwire.transports._grpc_common.health import HealthService
from clusterwire.transports._grpc_common.status import abort
from clusterwire.wrong_protocol import wrong_protocol

_STOP_SLACK_S = 10.0
_QUOTA_PENDING = 16  # see connection_args
_LOG = logging.getLogger(__name__)
_HEALTH_METHODS = f"/{HEALTH_SERVICE}/"


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
        reason = why_unbindable(address) or reason
        raise errors.UnavailableError(
            f"Could not bind {address} ({reason}). Choose a free port, or port 0 to let the "
            "system pick one, and a host name of this machine.")
    return join_host_port(split_host_port(address)[0], port)


def connection_args(limits: ListenOptions, door: bool) -> list[tuple[str, int]]:
    """gRPC core's arguments for ``limits``' connection limits (its accept loop is in C).

    gRPC core cannot tell an authenticated connection from another (the token rides on
    each call) and has one quota for all of them, closing the newest connection over it
    at accept: ``max_connections + max_pending_connections``. With a token (``door``),
    the ``Door`` keeps unauthenticated connections to their own rules
    (``clusterwire.pending``) and authenticated ones to ``max_connections``; the quota
    then leaves room for ``_QUOTA_PENDING`` times ``max_pending_connections``, as a
    connection the door closes leaves gRPC's count only once gRPC's threads have handled
    its end (later on a machine under load). A
    connection whose TLS handshake and HTTP/2 settings are not done within
    ``handshake_timeout_seconds`` is closed, and so is one with no call for as long
    (gRPC's idle limit; it also ends idle client connections, which reconnect on their
    next call).
    """
    handshake_ms = max(int(limits.handshake_timeout_seconds * 1000), 1)
    return [("grpc.max_allowed_incoming_connections",
             limits.max_connections
             + (_QUOTA_PENDING if door else 1) * limits.max_pending_connections),
            ("grpc.server_handshake_timeout_ms", handshake_ms),
            ("grpc.max_connection_idle_ms", handshake_ms)]


class _TokenGate(grpc.ServerInterceptor):
    """Refuses calls without the cluster token before gRPC reads their request.

    It runs on gRPC's own serving thread; a call it refuses gets a streaming handler
    that aborts at once, so even a unary request that never finishes arriving takes
    no pool thread (grpcio waits for a unary request on the pool thread, with no
    timeout).
    """

    def __init__(self, security: Security, door: Door, health: HealthService):
        self._security = security
        self._door = door
        self._health = health

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        presented = next((v for k, v in details.invocation_metadata if k == TOKEN_METADATA),
                         None)
        try:
            self._security.check_token(presented)
        except errors.UnauthenticatedError as err:
            if details.method.startswith(_HEALTH_METHODS):
                if self._health.admit_tokenless():
                    return continuation(details)
                return self._refusal(errors.ResourceExhaustedError(
                    "Too many health calls without the cluster token at once (at most "
                    "max_pending_connections); try again."))
            return self._refusal(err)
        return continuation(details)

    def _refusal(self, error: errors.OpError) -> grpc.RpcMethodHandler:
        door = self._door

        def refuse(requests, context: grpc.ServicerContext):
            door.refused(context.peer())
            abort(context, error)

        return grpc.stream_unary_rpc_method_handler(refuse)


class _OtherProtocol(grpc.GenericRpcHandler):
    """Answers a call of a method this server does not register (a client of another
    clusterwire protocol, or no clusterwire client) with ``wrong_protocol``, without reading
    its request. Registered methods never reach it; with a token, the token gate runs
    first."""

    def __init__(self, protocol: str):
        self._error = wrong_protocol(protocol)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        error = self._error

        def refuse(requests, context: grpc.ServicerContext):
            abort(context, error)

        return grpc.stream_unary_rpc_method_handler(refuse)


def _opening(handler: grpc.RpcMethodHandler, door: Door) -> grpc.RpcMethodHandler:
    """``handler``, telling ``door`` that its caller's connection is authenticated (the
    token gate let the call in) unless the door counts it already: a call on a connection
    over ``max_connections`` is refused."""
    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                if getattr(handler, k) is not None)
    behavior = getattr(handler, kind)

    admitted = door.admitted

    def opened(request, context: grpc.ServicerContext):
        if context.peer() not in admitted:
            door.admit(context)
        return behavior(request, context)

    return handler._replace(**{kind: opened})


class ControlServer:
    """A gRPC server on its own thread pool (an ``ElasticPool``), bound (with TLS if
    configured) when created.

    ``protocol``: the clusterwire protocol it serves, named to a client of another one.
    ``limits``: the listener's options: its security, the connection limits it enforces
    (see ``connection_args``) and, unless ``max_workers`` is given, its thread count.
    With a token, calls without it are refused before their request is read, and a
    connection is pending (``door``) until a call shows it, then one of at most
    ``max_connections``. ``max_receive_bytes``: the
    largest request message (gRPC's default, 4 MiB, if None); responses are not capped.
    """

    def __init__(self, address: str, service: str,
                 handlers: Mapping[str, grpc.RpcMethodHandler], limits: ListenOptions,
                 name: str, protocol: str, max_workers: int | None = None,
                 max_receive_bytes: int | None = None):
        security = limits.security
        self._door = Door(limits, name) if security.token else None
        self.health = HealthService([service], limits, name, self._door)
        # Handlers that wait on other requests park (clusterwire.thread_pool.parked) and
        # leave the max_workers threads to the requests that end their waits.
        self.pool = ElasticPool(max_workers or limits.max_workers, f"clusterwire-{name}")
        self.server = grpc.server(
            self.pool,
            interceptors=[_TokenGate(security, self._door, self.health)] if self._door else None,
            options=[("grpc.so_reuseport", 0), *connection_args(limits, self._door is not None),
                     *message_size_args(max_receive_bytes),
                     *([self._door.argument()] if self._door else [])])
        if self._door:
            handlers = {method: _opening(handler, self._door)
                        for method, handler in handlers.items()}
        # Registered methods (what grpc_tools generates): gRPC core matches them itself, with
        # no per-call Python lookup of the method; clients mark theirs _registered_method.
        self.server.add_registered_method_handlers(service, dict(handlers))
        self.server.add_registered_method_handlers(HEALTH_SERVICE, self.health.handlers())
        self.server.add_generic_rpc_handlers([_OtherProtocol(protocol)])
        self.address = address  # the contact address (bound port) once bound
        try:
            self.address = bind(self.server, address, security)
        except errors.OpError:
            self.stop(None)
            raise

    def start(self) -> None:
        """Start serving."""
        if self._door:
            self._door.start()
        self.server.start()
        self.health.start()

    def drain(self) -> None:
        """Report NOT_SERVING from now on (the shell takes no more work)."""
        self.health.drain()

    def report_ready(self, ready: bool) -> None:
        """Report SERVING or NOT_SERVING (``Listener.report_ready``)."""
        self.health.ready(ready)

    def stop(self, grace: float | None) -> None:
        """Stop (in-flight calls get ``grace`` seconds), then release the pool."""
        # Bounded: gRPC never reports the stop done if its polling thread died.
        if not self.server.stop(grace).wait((grace or 0.0) + _STOP_SLACK_S):
            _LOG.warning("The gRPC server at %s did not confirm its stop within %.0f s.",
                         self.address, (grace or 0.0) + _STOP_SLACK_S)
        self.health.close()
        if self._door:
            self._door.close()
        self.pool.shutdown(wait=False)
