"""The opt-in HTTP endpoint of a process's metrics: ``/metrics``, ``/healthz``, ``/readyz``.

* ``/metrics``: Prometheus' text format (``clusterwire.metrics.exposition``).
* ``/healthz``: 200 while the process serves this endpoint (liveness).
* ``/readyz``: 200 while every server of the process accepts work, 503 naming the ones
  that do not (before start, while draining): readiness, for protocols without gRPC health.

Bound to 127.0.0.1 unless the operator names another host. It is protected like the
process's servers: with their cluster token, ``/metrics`` needs ``Authorization: Bearer
TOKEN`` (Prometheus' ``authorization`` / ``bearer_token_file``); with their TLS, the
endpoint speaks HTTPS with the same certificate (and asks for client certificates under
mutual TLS). ``/healthz`` and ``/readyz`` say only up or down, and answer without a token,
as gRPC health does. A connection gets ``TIMEOUT_S`` to send its request and at most
``MAX_CONNECTIONS`` are waiting for theirs at once (a new one closes the oldest, the likeliest
to be a silent one); a connection whose request came is being answered and is never closed for
a newer one (what a tokenless peer is answered fits a socket's buffer, so its answers end at
once), so a hostile peer can neither pin the endpoint's threads nor lock a scraper out, nor cut
a scrape short.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import sys
import tempfile
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from clusterwire import errors
from clusterwire.addressing import join_host_port
from clusterwire.metrics import catalog
from clusterwire.metrics.exposition import Exposition
from clusterwire.metrics.registry import REGISTRY, Registry
from clusterwire.security import Security, TlsConfig
from clusterwire.shell import listen_options, warn_if_exposed

_LOG = logging.getLogger(__name__)

#: Seconds a connection may take to send its request (TLS handshake included).
TIMEOUT_S = 5.0
#: Connections served at once.
MAX_CONNECTIONS = 16
#: Connections the kernel holds for the accept loop, capped by net.core.somaxconn
#: (socketserver's default of 5, and 1024 behind a flood of 1,344 reconnecting
#: connections, left a scrape waiting a second for its SYN's retry).
ACCEPT_BACKLOG = 4096

_lock = threading.Lock()
_endpoints: dict[tuple[str, int], MetricsEndpoint] = {}


def _tls_context(tls: TlsConfig) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="clusterwire-metrics-") as folder:
        cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        for path, pem in ((cert, tls.certificate_chain), (key, tls.private_key)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as out:
                out.write(pem or b"")
        context.load_cert_chain(cert, key)
    if tls.require_client_auth:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=(tls.root_certificates or b"").decode())
    return context


def readiness(registry: Registry) -> list[str]:
    """The servers of the process that do not accept work now (empty: ready)."""
    return sorted(sample.labels[0] for sample in registry.samples()
                  if sample.metric is catalog.SERVING and not sample.value)


class _Handler(BaseHTTPRequestHandler):
    server: _HttpServer
    timeout = TIMEOUT_S
    server_version = "clusterwire-metrics"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        endpoint = self.server.endpoint
        self.server.answering()
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._answer(200, b"ok\n")
        elif path == "/readyz":
            waiting = readiness(endpoint.registry)
            self._answer(503 if waiting else 200, (
                f"not serving: {', '.join(waiting)}\n" if waiting else "ready\n").encode())
        elif path == "/metrics":
            if not endpoint.authorized(self.headers.get("Authorization")):
                self._answer(401, b"a bearer token is required: the cluster token\n",
                             {"WWW-Authenticate": "Bearer"})
            else:
                self._answer(200, endpoint.exposition.render(),
                             {"Content-Type": endpoint.exposition.content_type})
        else:
            self._answer(404, b"this endpoint serves /metrics, /healthz and /readyz\n")

    def _answer(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for name, value in {"Content-Type": "text/plain; charset=utf-8", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:  # scrapes are not news
        pass


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = ACCEPT_BACKLOG
    endpoint: MetricsEndpoint

    def __init__(self, address: tuple[str, int], context: ssl.SSLContext | None):
        self._context = context
        # The connections waiting for their request, oldest first (the ones evicted).
        self._open: OrderedDict[int, socket.socket] = OrderedDict()
        self._open_lock = threading.Lock()
        self._connection = threading.local()  # the key of the thread's connection
        super().__init__(address, _Handler)

    def process_request(self, request: socket.socket, client_address) -> None:
        with self._open_lock:
            if len(self._open) >= MAX_CONNECTIONS:  # the oldest is most likely a silent one
                _key, oldest = self._open.popitem(last=False)
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            self._open[id(request)] = request
        request.settimeout(TIMEOUT_S)
        super().process_request(request, client_address)

    def answering(self) -> None:
        """The calling thread's connection sent its request: it is no longer one a newer
        connection may close."""
        with self._open_lock:
            self._open.pop(self._connection.key, None)

    def handle_error(self, request, client_address) -> None:
        """A client that hung up or went silent while it was answered is no news (the
        default prints a traceback to stderr); anything else is logged."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError, ssl.SSLError)):
            return
        _LOG.exception("clusterwire: the metrics endpoint failed answering %s",
                       client_address[0] if client_address else "a client")

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        raw = request
        self._connection.key = id(raw)
        try:
            if self._context is not None:
                try:
                    request = self._context.wrap_socket(request, server_side=True)
                except (OSError, ssl.SSLError):
                    self.shutdown_request(request)
                    return
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open.pop(id(raw), None)


class MetricsEndpoint:
    """One HTTP endpoint serving the process's registry; ``serve_metrics`` makes them."""

    def __init__(self, host: str, port: int, security: Security, registry: Registry):
        self.registry = registry
        self.exposition = Exposition(registry)
        self._token = security.token
        context = _tls_context(security.tls) if security.tls is not None else None
        try:
            self._server = _HttpServer((host, port), context)
        except OSError as err:
            raise errors.UnavailableError(
                f"Cannot serve metrics at {join_host_port(host, port)}: {err.strerror}; pick "
                "another metrics_port (0: a free one).") from None
        self._server.endpoint = self
        self.host, self.port = host, self._server.server_address[1]
        self.scheme = "https" if context is not None else "http"
        self._users = 0
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name=f"clusterwire-metrics-{self.port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """``http(s)://host:port/metrics``."""
        return f"{self.scheme}://{join_host_port(self.host, self.port)}/metrics"

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the cluster token (if one is set)."""
        if self._token is None:
            return True
        scheme, _, presented = (header or "").partition(" ")
        try:
            Security(token=self._token).check_token(presented.strip()
                                                    if scheme.lower() == "bearer" else None)
        except errors.UnauthenticatedError:
            return False
        return True

    def close(self) -> None:
        """Release this user's hold; the last one stops the endpoint and frees its port."""
        with _lock:
            self._users -= 1
            if self._users > 0:
                return
            _endpoints.pop((self.host, self.port), None)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve_metrics(port: int = 0, host: str = "127.0.0.1", security: Security | None = None,
                  registry: Registry = REGISTRY) -> MetricsEndpoint:
    """Serve this process's metrics over HTTP at ``host:port`` (0: a free port); several
    servers of one process asking for the same port share one endpoint. ``close()`` it.

    A training process calls it to export what its data-service consumers counted (the
    time its loop waited for data); servers call it for their ``metrics_port``.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise errors.InvalidArgumentError(
            f"metrics_port must be an int in 0..65535 (0: a free port), got {port!r}.")
    security = security or Security()
    warn_if_exposed(host, listen_options(security=security), "The metrics endpoint")
    with _lock:
        endpoint = _endpoints.get((host, port)) if port else None
        if endpoint is None:
            endpoint = MetricsEndpoint(host, port, security, registry)
            _endpoints[(host, endpoint.port)] = endpoint
        endpoint._users += 1
        return endpoint
