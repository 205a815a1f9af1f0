"""The contract between clusterwire's core and a transport plugin.

A transport moves **frames**: a small control header (serialized protobuf
bytes) plus a list of raw buffers (tensor bytes). It never looks inside the
header, and bulk buffers never pass through a protobuf field, so a transport
may send them on a separate data path (gRPC chunk streams, shared memory,
UCX, zmq frames). ``clusterwire.envelope`` lays a frame out for the wire: the
header, the buffer table, the buffers that ride inline, and the size checks.

Roles:

* ``Transport``: created once per process and protocol by the plugin's
  factory (``TransportSpec.factory(options)``). ``listen`` creates a server
  side, ``connect`` a client side.
* ``Listener``: binds ``host:port`` (port 0 picks a free port), reports the
  bound contact address, calls the handler for every request frame on its own
  threads (the handler is thread-safe), and stops with a grace period:
  in-flight calls may finish within ``grace`` seconds, the rest end with
  ``CancelledError`` at their callers; afterwards the port is free.
* ``Channel``: a client connection to one address, safe to share between
  threads. ``call`` sends one request frame and returns the response frame or
  raises a ``clusterwire.errors`` class; it never blocks past ``timeout``.
  ``close`` releases the connection.

Security (``ListenOptions.security`` / ``connect(..., security)``): with TLS
configured the control plane speaks TLS; with a token, the listener checks
each request's token (constant time) before it reads bulk data or calls the
handler, and answers ``UnauthenticatedError`` otherwise. A data path outside
the control connection (shared memory, UCX, ...) accepts a transfer only
for a request or connection the control plane authenticated. A transport
that cannot provide what is asked must refuse with ``UnimplementedError``,
never silently run without it.

Errors a transport raises (never its library's own exception types):
``UnavailableError`` (cannot connect, peer died), ``DeadlineExceededError``
(timeout), ``CancelledError`` (server stopping), ``ResourceExhaustedError``
(frame larger than the configured limit), ``InvalidArgumentError``
(malformed frame), ``UnauthenticatedError`` (wrong token, TLS handshake or
certificate refused).

Buffer ownership: the caller of ``call`` (and the handler returning a frame)
must not modify the buffers it passed until ``call`` returns (the handler's
until the transport is done sending). Received buffers belong to the
receiver; the transport must not reuse them, and should hand them over
writable and without extra copies where it can.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterwire.errors import UnavailableError
from clusterwire.security import Security

Buffer = Any  # any object supporting the buffer protocol


@dataclass
class Frame:
    """One message: a control header and the raw buffers it refers to."""

    header: bytes
    buffers: Sequence[Buffer] = field(default_factory=list)
    #: The buffers are never written again by anyone (a stored tensor): a receiver in this
    #: process may share them read-only instead of copying (``clusterwire.in_process``).
    frozen: bool = False
    #: On a request a listener hands its handler: the peer that sent it, as the transport
    #: tells peers apart (a TCP peer's IP address, a Unix peer's "uid:N"); the fair shares
    #: of a server's tables are kept by it. Empty for callers in this process.
    peer: str = ""

    @property
    def payload_bytes(self) -> int:
        """Total size of the raw buffers."""
        return sum(memoryview(b).nbytes for b in self.buffers)


Handler = Callable[[Frame], Frame]

#: The slowest a streamed request's body (an upload) may arrive: each window of
#: ``ListenOptions.message_idle_timeout_seconds`` must bring this many bytes a second
#: (or the rest of the request), else it is dropped with DeadlineExceededError. A request
#: sent in the default 1 MiB chunks within the idle timeout brings more.
MIN_UPLOAD_BYTES_PER_SECOND = 64 << 10


@dataclass(frozen=True)
class ListenOptions:
    """Server-side limits a transport must enforce."""

    max_workers: int = 16
    max_message_bytes: int = 4 << 30
    #: Requests served at once. The core's cluster service enforces it itself; a
    #: transport may also enforce it early (before reading a request's data).
    max_concurrent_calls: int = 256
    #: Authenticated client connections held at once; more are refused.
    max_connections: int = 1024
    #: A connection that has not authenticated (TLS handshake done and a first request or
    #: hello whose token checked) within this many seconds is closed. Until it authenticates
    #: it does not count against ``max_connections``.
    handshake_timeout_seconds: float = 5.0
    #: Unauthenticated connections held at once; a new one beyond this closes the oldest
    #: unauthenticated one, so a flood of silent connections cannot lock out real clients.
    max_pending_connections: int = 256
    #: A request whose bytes stop arriving for this many seconds, or arrive slower than
    #: ``MIN_UPLOAD_BYTES_PER_SECOND`` over such a window, is dropped (DeadlineExceededError).
    message_idle_timeout_seconds: float = 10.0
    #: Of ``max_workers``, threads kept for requests without a streamed body, so bulk
    #: uploads cannot starve small calls. A streamed request holds one of the others only
    #: while it works (its bytes arriving, its handler running); waiting for its next bytes
    #: it holds none, so slow uploads leave the threads to others.
    small_call_reserve: int = 4
    security: Security = field(default_factory=Security)


class Listener(abc.ABC):
    """The server side of a transport, bound to one address."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The contact address ``host:port`` with the bound port."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start serving (idempotent)."""

    @abc.abstractmethod
    def stop(self, grace: float | None = None) -> None:
        """Stop serving: drain for ``grace`` seconds, answer the calls still running with
        CancelledError, free the port."""

    def drain(self) -> None:  # noqa: B027 - optional: most transports report no health
        """The server takes no more work (its shell drains before ``stop``): a transport
        with a health service reports NOT_SERVING from now on. Default: nothing."""

    def report_ready(self, ready: bool) -> None:  # noqa: B027 - optional, as drain
        """Whether the server takes work now, before and after ``start`` (a standby waiting
        for its turn listens but does not): a transport with a health service reports
        SERVING or NOT_SERVING accordingly until ``drain``. Default: nothing."""

    def connections(self) -> int | None:
        """Authenticated client connections held now (the ``clusterwire_connections``
        metric), or None where the transport does not count them. Default: None."""
        return None


class Channel(abc.ABC):
    """The client side of a transport, connected to one address."""

    @abc.abstractmethod
    def call(self, frame: Frame, timeout: float | None = None) -> Frame:
        """Send ``frame`` and return the response frame."""

    def call_relayed(self, frame: Frame, timeout: float | None = None) -> Frame:
        """``call``, for a caller that only passes the response on through a listener of
        the same transport (a task forwarding a request for another task).

        A transport may return the response's buffers before they arrived, as objects
        only its own listeners can send: they then stream from the peer to the next
        receiver as they arrive (cut-through), with bounded buffering. The default
        receives them whole, as ``call``.
        """
        return self.call(frame, timeout)

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection (idempotent)."""


class Transport(abc.ABC):
    """A protocol's factory for listeners and channels."""

    protocol: str = ""

    @abc.abstractmethod
    def listen(self, address: str, handler: Handler, options: ListenOptions) -> Listener:
        """Bind ``address`` (``host:port``; port 0 = any free port) and serve ``handler``."""

    @abc.abstractmethod
    def connect(self, address: str, security: Security | None = None) -> Channel:
        """A channel to the listener at ``address``; connecting may be lazy.

        With ``security.tls`` the channel speaks TLS (checking the server with
        the root certificates, presenting its own certificate for mutual TLS);
        with ``security.token`` every request carries the cluster token.
        """

    def info(self) -> dict[str, str]:
        """Facts about the transport for ``status`` (e.g. the data path in use)."""
        return {}

    def keep(self, buffer: Buffer) -> Buffer | None:
        """The read-only buffer a server of this protocol keeps for ``buffer``, received from
        a caller of its own process (``clusterwire.in_process``): a copy in memory of the
        transport's choosing, e.g. a shared-memory segment later sends pass by descriptor.
        None (the default) lets the core share read-only memory and copy writable memory."""
        return None


class ConnectionFailed(UnavailableError):
    """The peer could not be reached and the request was certainly not delivered.

    Transports raise it (rather than plain UnavailableError) when they know
    nothing was sent, so the core may retry even non-idempotent requests.
    """


class HandshakeFailed(UnavailableError):
    """The peer was reached but the connection's security handshake failed.

    Retrying with the same settings cannot help, so the core does not retry it.
    """
