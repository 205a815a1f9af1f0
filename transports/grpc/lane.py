"""The grpc transport's fast lane (option ``fast_lane = true``): small calls over persistent
TCP connections beside the gRPC port, without gRPC's per-call cost.

gRPC stays the control plane: a client that wants a lane connection asks the listener for
a ticket with a gRPC call (``Lane``), which the token gate checks like any other; the
reply names the lane's TCP port and a fresh 128-bit secret, good for one connection, from
the peer (IP address) that asked, within ``fetch_ttl_seconds``. The connection then
carries calls one at a time, each answered on it (a channel keeps a LIFO pool of idle ones,
``_grpc_common.call_pool``: one per calling thread in flight). The listener serves each
connection on a thread of its own and runs the handler inline under one of
``max_workers`` work slots (a ``parked()`` wait gives it back), as grpc+local's call
connections do. Only calls whose request buffers fit ``inline_bytes`` take the lane;
a response travels as the ``Call`` method's reply would (inline up to ``bulk_bytes``, else
announced and fetched from the bulk port), so larger data keeps its paths.

The wire (little-endian; every message starts with ``"CWN1" | op u8 | 3 pad | length u64``
and ``length`` bytes of body follow)::

    Lane reply (gRPC)   "CWN1" | lane port u16 | 2 pad | secret 16 B
    client -> server    HELLO   body = the secret; first thing on a connection
    server -> client    READY   (admitted) or ERROR (refused, then closed)
    client -> server    CALL    body = the request envelope (``framing``, every buffer INLINE)
    server -> client    REPLY   body = the response envelope, as the Call method's reply
                        ERROR   body = error code u32 | UTF-8 text
                        CLOSING the server closes this connection, having read no call
                                since its last answer (sent after that answer, if any)

Limits (the listener's ``ListenOptions``, kept by ``ticket_port``): a connection is pending
until its HELLO, which must come within ``handshake_timeout_seconds``; a wrong or used
secret closes it unanswered; the pending and admitted connections are capped per peer as on
the bulk port. A message longer than the largest envelope of ``inline_bytes`` is refused
(RESOURCE_EXHAUSTED, then closed) before it is read; a request over ``max_message_bytes``
gets RESOURCE_EXHAUSTED. A request's bytes must all arrive within
``message_idle_timeout_seconds`` of its start; a connection idle for ``IDLE_SECONDS`` is
closed. Answers the listener cannot send within ``message_idle_timeout_seconds`` (a client
that does not read) close the connection.

Errors: ERROR ``UNAVAILABLE`` only for a call the listener did not run (it is stopping:
``ConnectionFailed`` at the caller), ``CANCELLED`` for a call still running when its grace
ran out. A channel falls back to gRPC for a call whenever it gets no lane connection (the
peer has no lane, the port cannot be reached within ``_CONNECT_S``, the listener is at its
connection limit, the ticket is refused); calls that would need a new connection stay on
gRPC for ``_RETRY_S`` after a lasting failure, ``_BUSY_S`` after a passing one.
TLS (``lane_tls``): when the listener has TLS, its lane does too, with the same
certificates; a connection's TLS handshake and its HELLO must both arrive within
``handshake_timeout_seconds`` (a client without TLS, or whose certificate the listener's
mutual TLS refuses, is closed at the handshake). A channel with TLS checks the lane's
certificate as gRPC checks the listener's; one that cannot verify it calls over gRPC.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import socket
import ssl
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.envelope import BULK, split_inline
from clusterwire.security import TlsConfig
from clusterwire.thread_pool import WorkSlots, serve_parking
from clusterwire.transport import ConnectionFailed, Frame, Handler, ListenOptions
from clusterwire.transports._grpc_common.call_pool import (
    IdleConnections,
    PooledConnection,
    left,
    set_receive_timeout,
    timeval,
)
from clusterwire.transports.grpc import framing, lane_tls
from clusterwire.transports.grpc.bulk import Unreachable
from clusterwire.transports.grpc.ticket_port import TicketPort, send_views, shutdown

MAGIC = b"CWN1"
_MESSAGE = struct.Struct("<4sB3xQ")
_TICKET = struct.Struct("<4sH2x16s")
_ERROR = struct.Struct("<I")
HELLO, READY, CALL, REPLY, ERROR, CLOSING = 1, 2, 3, 4, 5, 6
_OPS = frozenset((HELLO, READY, CALL, REPLY, ERROR, CLOSING))
_SECRET_BYTES = 16
#: A connection that brings no call for this long is closed (its client reconnects).
IDLE_SECONDS = 300.0
_CONNECT_S = 5.0  # longer, and the lane's port is taken for unreachable (firewalled)
_RETRY_S = 30.0  # after a lasting failure, before the lane is tried again
_BUSY_S = 1.0  # after a passing one (see LaneClient._passing)
_SCRATCH_BYTES = 64 << 10  # a connection's receive buffer: most messages arrive in one read
_MAX_ERROR_TEXT = 4000
_LOG = logging.getLogger(__name__)


class Garbage(Exception):
    """Bytes that are not a lane message."""


class Oversized(Exception):
    """A message longer than the receiver takes."""


def message(op: int, body: bytes = b"") -> bytes:
    """One lane message."""
    return _MESSAGE.pack(MAGIC, op, len(body)) + body


def _error_message(code: int, text: str) -> bytes:
    return message(ERROR, _ERROR.pack(code) + text.encode("utf-8", "replace")[:_MAX_ERROR_TEXT])


def _decode_error(body: Any) -> tuple[int, str]:
    if len(body) < _ERROR.size:
        raise Garbage("a short ERROR message")
    return _ERROR.unpack_from(body)[0], bytes(body[_ERROR.size:]).decode("utf-8", "replace")


def _receive(sock: socket.socket, view: memoryview, give_up: Callable[[], bool]) -> int:
    """``recv_into(view)``, again while the kernel receive timeout expires and
    ``give_up()`` is False; TimeoutError when it is True."""
    while True:
        try:
            return sock.recv_into(view)
        except BlockingIOError:
            if give_up():
                raise TimeoutError from None


def read_message(sock: socket.socket, scratch: memoryview, limit: int,
                 give_up_first: Callable[[], bool], give_up_rest: Callable[[], bool]
                 ) -> tuple[int, memoryview, bool] | None:
    """The next message on ``sock``: (op, body, whether more bytes followed it), None on a
    clean end before it. The body is a view of ``scratch`` when it fits there (valid until
    the next read), else a buffer of its own. ``give_up_first``: whether to stop waiting
    for the message (TimeoutError); ``give_up_rest``: for the rest of it once begun.
    ``Garbage``, ``Oversized`` (over ``limit``: nothing of the body read), ConnectionError
    (the connection ended inside the message)."""
    try:  # the common case: the whole message in one receive
        filled = sock.recv_into(scratch)
    except BlockingIOError:
        if give_up_first():
            raise TimeoutError from None
        filled = 0
    else:
        if not filled:
            return None
        if filled > _MESSAGE.size:
            magic, op, length = _MESSAGE.unpack_from(scratch)
            if filled == _MESSAGE.size + length and magic == MAGIC and op in _OPS \
                    and length <= limit:
                return op, scratch[_MESSAGE.size:filled], False
    while filled < _MESSAGE.size:
        count = _receive(sock, scratch[filled:], give_up_rest if filled else give_up_first)
        if not count:
            if not filled:
                return None
            raise ConnectionResetError("the lane connection closed inside a message")
        filled += count
    magic, op, length = _MESSAGE.unpack_from(scratch)
    if magic != MAGIC or op not in _OPS:
        raise Garbage("not a lane message")
    if length > limit:
        raise Oversized(length)
    end = _MESSAGE.size + length
    if end <= scratch.nbytes:
        while filled < end:
            count = _receive(sock, scratch[filled:], give_up_rest)
            if not count:
                raise ConnectionResetError("the lane connection closed inside a message")
            filled += count
        return op, scratch[_MESSAGE.size:end], filled > end
    if filled > end:  # cannot happen: scratch is smaller than the message
        raise Garbage("overlong read")
    body = memoryview(bytearray(length))
    have = filled - _MESSAGE.size
    body[:have] = scratch[_MESSAGE.size:filled]
    while have < length:
        count = _receive(sock, body[have:], give_up_rest)
        if not count:
            raise ConnectionResetError("the lane connection closed inside a message")
        have += count
    return op, body, False


class _Tickets:
    """Secrets handed out in ``Lane`` replies: each good for one connection from the peer
    it was issued to, within ``ttl`` seconds; at most ``limit`` outstanding (the oldest
    goes first)."""

    def __init__(self, ttl: float, limit: int):
        self._ttl, self._limit = ttl, limit
        self._items: OrderedDict[bytes, tuple[float, str]] = OrderedDict()
        self._lock = threading.Lock()

    def issue(self, peer: str) -> bytes:
        secret = secrets.token_bytes(_SECRET_BYTES)
        now = time.monotonic()
        with self._lock:
            while self._items and (len(self._items) >= self._limit
                                   or next(iter(self._items.values()))[0] < now):
                self._items.popitem(last=False)
            self._items[secret] = (now + self._ttl, peer)
        return secret

    def take(self, secret: bytes) -> str | None:
        """The peer ``secret`` was issued to (it is used up), None if it is unknown or
        expired."""
        with self._lock:
            item = self._items.pop(secret, None)
        if item is None or item[0] < time.monotonic():
            return None
        return item[1]


class LaneServer(TicketPort):
    """A listener's fast lane: a TCP port whose admitted connections carry calls.

    ``handler``: the listener's; ``respond(response frame)``: the reply envelope the Call
    method would send; ``limit``: max_message_bytes; ``message_limit``: the longest
    request envelope the lane takes. With ``limits.security.tls`` every connection runs
    inside TLS (``lane_tls``)."""

    def __init__(self, host: str, handler: Handler, respond: Callable[[Frame], bytes],
                 limits: ListenOptions, message_limit: int, ticket_ttl: float, address: str):
        super().__init__(host, limits, "clusterwire-grpc-lane")
        self._handler, self._respond = handler, respond
        self._limit, self._message_limit = limits.max_message_bytes, message_limit
        self._address = address
        tls = limits.security.tls
        self._tls = None if tls is None else lane_tls.server_context(tls)
        self._tickets = _Tickets(ticket_ttl,
                                 limits.max_pending_connections + limits.max_connections)
        self.slots = WorkSlots(limits.max_workers)
        self._calls = threading.Condition(threading.Lock())  # for the two below
        self._served: dict[socket.socket, _ServerConnection] = {}  # admitted
        self._retired_calls = 0  # served by connections no longer in _served
        # Set once, by stop(); a connection marks itself busy before reading it (begin), so
        # without a lock per call either it sees the flag or stop() sees it busy.
        self._draining = False

    def ticket(self, peer: str) -> bytes:
        """The ``Lane`` reply for ``peer``: this port and a new secret."""
        return _TICKET.pack(MAGIC, self.port, self._tickets.issue(peer))

    def _serve(self, connection: socket.socket, peer: str) -> None:
        hello = bytearray(_MESSAGE.size + _SECRET_BYTES)
        deadline = time.monotonic() + self._limits.handshake_timeout_seconds
        # ``connection`` is what the port's tables hold; ``wire`` carries the bytes.
        wire: socket.socket | lane_tls.TlsStream = connection
        if self._tls is not None:
            try:
                wire = lane_tls.accept(connection, self._tls, deadline)
            except (OSError, ValueError) as err:  # silent, slow, not TLS, or refused
                _LOG.debug("Lane connection from %s refused at the TLS handshake: %s", peer,
                           err)
                return
        if not _receive_exactly(wire, memoryview(hello), deadline):
            return
        magic, op, length = _MESSAGE.unpack_from(hello)
        if magic != MAGIC or op != HELLO or length != _SECRET_BYTES:
            return
        owner = self._tickets.take(bytes(hello[_MESSAGE.size:]))
        if owner is None:  # a stranger's guess, expired or used: closed unanswered
            return
        wire.settimeout(self._limits.message_idle_timeout_seconds)
        if _address_of(owner) != _address_of(peer):
            wire.sendall(_error_message(
                errors.PERMISSION_DENIED, f"This lane ticket was issued to {owner}, not "
                f"{peer} (a proxy between them?): the calls go over gRPC."))
            return
        if not self._admit(connection, peer):
            wire.sendall(_error_message(
                errors.RESOURCE_EXHAUSTED, "The lane is at max_connections."))
            return
        served = _ServerConnection(self, wire, peer)
        with self._calls:
            if self._draining:
                return
            self._served[connection] = served
        try:
            wire.settimeout(None)  # kernel timeouts from here (no poll per receive)
            set_receive_timeout(wire, self._limits.message_idle_timeout_seconds)
            wire.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            timeval(self._limits.message_idle_timeout_seconds))
            served.send(message(READY))
            served.serve()
        finally:
            with self._calls:
                if self._served.pop(connection, None) is not None:
                    self._retired_calls += served.calls

    @property
    def calls(self) -> int:
        """Calls served over the lane so far."""
        with self._calls:
            return self._retired_calls + sum(served.calls for served in self._served.values())

    def begin(self, connection: _ServerConnection) -> bool:
        """``connection`` starts running a call; False (not to run) once stopping."""
        connection.busy = True
        if self._draining:
            self.end(connection)
            return False
        connection.calls += 1
        return True

    def end(self, connection: _ServerConnection) -> bool:
        """``connection``'s call was answered; False if it is to close (stopping)."""
        connection.busy = False
        if self._draining:
            with self._calls:
                self._calls.notify_all()
            return False
        return True

    def run(self, request: Frame) -> bytes:
        """The reply envelope for ``request``, the handler run under a work slot."""
        if not self.slots.acquire():
            raise errors.CancelledError(f"The server at {self._address} stopped.")
        try:
            response = self._handler(request)
        finally:
            self.slots.release()
        return self._respond(response)

    @property
    def limits(self) -> tuple[int, int]:
        """(max_message_bytes, the longest request envelope)."""
        return self._limit, self._message_limit

    @property
    def address(self) -> str:
        return self._address

    def _displace(self, connection: socket.socket) -> None:
        with self._calls:
            served = self._served.get(connection)
        if served is None:
            shutdown(connection, socket.SHUT_RDWR)
        else:
            served.close_when_idle()

    def stop(self, grace: float | None) -> None:
        """Take no more calls (idle connections are told CLOSING and closed); calls running
        get ``grace`` seconds, then are answered CancelledError."""
        with self._calls:
            self._draining = True
            admitted = dict(self._served)
            served = list(admitted.values())
        for sock in self._close_listening():
            if sock not in admitted:  # pending, or admitted and not serving yet
                shutdown(sock, socket.SHUT_RDWR)
        for connection in served:
            connection.close_when_idle()
        with self._calls:
            self._calls.wait_for(lambda: not any(c.busy for c in served), grace or 0.0)
            running = [connection for connection in served if connection.busy]
        for connection in running:
            connection.cancel()
        self.slots.close()
        # Not the threads of cancelled calls: their handlers end when they end (as on the
        # gRPC port); their connections are shut and answered already.
        self._join_acceptor()


def _address_of(peer: str) -> str:
    """A peer's IP address as one form (an IPv4 client of a dual-stack socket is
    ``::ffff:a.b.c.d`` there, ``a.b.c.d`` to gRPC)."""
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def _receive_exactly(connection: socket.socket, view: memoryview, deadline: float) -> bool:
    """Fill ``view`` by ``deadline``; False if the connection ended or the time ran out."""
    filled = 0
    try:
        while filled < view.nbytes:
            connection.settimeout(max(deadline - time.monotonic(), 0.0) or 1e-3)
            if time.monotonic() >= deadline:
                return False
            count = connection.recv_into(view[filled:])
            if not count:
                return False
            filled += count
    except TimeoutError:
        return False
    return True


class _ServerConnection:
    """The listener's side of one admitted lane connection (its own thread)."""

    def __init__(self, server: LaneServer, sock: socket.socket | lane_tls.TlsStream, peer: str):
        self._server = server
        self.sock = sock
        self.peer = peer
        self._lock = threading.Lock()  # one answer per call; CLOSING once
        self._answered = True
        self.busy = False  # running a call (LaneServer.begin to end)
        self.calls = 0  # calls begun
        self._closing = False
        self._waiting_since = self._started = 0.0  # of the read in progress

    def send(self, data: bytes | list[memoryview]) -> None:
        """Send a message, whole or as its parts."""
        send_views(self.sock, data if isinstance(data, list) else [memoryview(data)])

    def serve(self) -> None:
        server = self._server
        limit, message_limit = server.limits
        scratch = memoryview(bytearray(_SCRATCH_BYTES))
        serve_parking(server.slots)
        while True:
            self._waiting_since, self._started = time.monotonic(), 0.0
            try:
                received = read_message(self.sock, scratch, message_limit, self._idle_too_long,
                                        self._too_slow)
            except TimeoutError:
                self.close_when_idle()
                return
            except Oversized as err:  # no call runs: answered here, then closed
                self._send_quietly(_error_message(errors.RESOURCE_EXHAUSTED, (
                    f"A lane message of {err.args[0]} bytes is over the {message_limit} the "
                    "lane takes: larger requests go over gRPC.")))
                return
            except (Garbage, ConnectionError):
                return
            if received is None or received[0] != CALL or received[2]:
                return  # the client left, or is not speaking the protocol
            self._answered = False  # before begin(): from then on stop() may cancel it
            if not server.begin(self):
                self._answer(_error_message(errors.UNAVAILABLE, (
                    f"The server at {server.address} is stopping; the call was not run.")))
                return
            answered = self._answer(self._run(received[1], limit))
            if not server.end(self) or not answered or self._closing:
                self.close_when_idle()
                return

    def _idle_too_long(self) -> bool:
        """Whether to stop waiting for the next call (closing, or idle for IDLE_SECONDS)."""
        return self._closing or time.monotonic() - self._waiting_since > IDLE_SECONDS

    def _too_slow(self) -> bool:
        """Whether a request's bytes stopped arriving (``message_idle_timeout_seconds``)."""
        now = time.monotonic()
        if not self._started:
            self._started = now
        return now - self._started > self._server._limits.message_idle_timeout_seconds

    def _run(self, body: memoryview, limit: int) -> bytes | list[memoryview]:
        """The answer message to the request envelope ``body`` (or its parts)."""
        try:
            envelope = framing.LAYOUT.decode(body, limit)
            if BULK in envelope.kinds:
                raise errors.InvalidArgumentError("Malformed frame: a lane call has inline "
                                                  "buffers only.")
            request = Frame(envelope.header, split_inline(envelope), peer=self.peer)
            reply = self._server.run(request)
            return [memoryview(_MESSAGE.pack(MAGIC, REPLY, len(reply))), memoryview(reply)]
        except errors.OpError as err:
            return _error_message(err.error_code, err.message)
        except Exception as err:  # the handler's bug: an error answer, not a dead connection
            return _error_message(errors.INTERNAL,
                                  f"Handler failed: {type(err).__name__}: {err}")

    def _send_quietly(self, data: bytes) -> None:
        with self._lock, contextlib.suppress(OSError):
            self.send(data)

    def _answer(self, data: bytes | list[memoryview]) -> bool:
        """Send the call's answer unless ``cancel`` gave one; False if sending failed."""
        try:
            with self._lock:
                if self._answered:
                    return False
                self._answered = True
                self.send(data)
            return True
        except OSError:
            return False

    def cancel(self) -> None:
        """Answer the running call with CancelledError and close the connection."""
        with self._lock:
            if not self._answered:
                self._answered = True
                with contextlib.suppress(OSError):
                    self.send(_error_message(errors.CANCELLED, (
                        f"The server at {self._server.address} stopped during the call.")))
        shutdown(self.sock, socket.SHUT_RDWR)

    def close_when_idle(self) -> None:
        """Tell the client CLOSING and close now if no call runs, else after its answer."""
        with self._lock:
            self._closing = True
            if not self._answered:
                return  # serve() closes after the answer
            with contextlib.suppress(OSError):
                self.sock.send(message(CLOSING), socket.MSG_DONTWAIT)
        shutdown(self.sock, socket.SHUT_RDWR)


class LaneConnection(PooledConnection):
    """A channel's lane connection, with its receive buffer."""

    def __init__(self, sock: socket.socket | lane_tls.TlsStream):
        super().__init__(sock)
        self.scratch = memoryview(bytearray(_SCRATCH_BYTES))


_NOT_READ = object()  # the listener closed the connection without reading the call


class LaneClient:
    """A channel's calls over the fast lane of one listener.

    ``ticket(seconds)``: the listener's ``Lane`` reply (a gRPC call of at most ``seconds``;
    None: no deadline); it raises ``Unreachable`` if there is none. ``reply_limit``: the
    longest reply envelope taken. ``tls``: the channel's TLS (None: plain TCP), the lane's
    connections run inside it (``lane_tls``)."""

    def __init__(self, address: str, ticket: Callable[[float | None], bytes],
                 reply_limit: int, tls: TlsConfig | None = None):
        self._host = split_host_port(address)[0].strip("[]")
        self._address = address
        self._tls = None if tls is None else lane_tls.client_context(tls)
        self._ticket = ticket
        self._reply_limit = reply_limit
        self._connections: IdleConnections[LaneConnection] = IdleConnections(address)
        self._after = 0.0  # monotonic time from which the lane is tried again
        #: Calls answered with a reply (not an error) over the lane so far.
        self.calls = 0
        _clients.add(self)

    def call(self, parts: Sequence[memoryview], deadline: float | None) -> Any:
        """Send the request envelope ``parts`` (concatenated) on a lane connection; the
        reply envelope, or None: no lane connection now, the call is to go over gRPC."""
        for _ in range(2):  # an idle connection the listener closed: once more
            connection = self._connections.take()
            reused = connection is not None
            if connection is None:
                if time.monotonic() < self._after:
                    return None
                connection = self._connect(deadline)
                if connection is None:
                    return None
            outcome = self._exchange(connection, parts, deadline, reused)
            if outcome is not _NOT_READ:
                self.calls += 1
                return outcome
        return None

    def _lasting(self, err: Exception) -> None:
        _LOG.warning("Calls to %s go over gRPC for %.0f s: %s", self._address, _RETRY_S, err)
        self._after = time.monotonic() + _RETRY_S

    def _passing(self) -> None:
        """No new lane connection for ``_BUSY_S`` (the listener was at its limits, stopping
        or unreachable for the moment): calls without an idle one go over gRPC meanwhile,
        rather than each asking for a ticket first."""
        self._after = max(self._after, time.monotonic() + _BUSY_S)

    def _connect(self, deadline: float | None) -> LaneConnection | None:
        """A new admitted lane connection, or None (the call goes over gRPC)."""
        try:
            reply = self._ticket(left(deadline))
            magic, port, secret = _TICKET.unpack(reply) if len(reply) == _TICKET.size \
                else (b"", 0, b"")
            if magic != MAGIC or not port:
                raise Unreachable(f"{self._address} answered the lane ticket with something "
                                  "else", lasting=True)
        except Unreachable as err:
            if err.lasting:
                self._lasting(err)
            else:
                self._passing()
            return None
        remaining = left(deadline)
        timeout = _CONNECT_S if remaining is None else min(remaining, _CONNECT_S)
        try:
            sock = socket.create_connection((self._host, port), timeout=timeout)
        except OSError as err:
            if isinstance(err, TimeoutError) and timeout < _CONNECT_S:
                raise errors.DeadlineExceededError(
                    f"Connecting to the lane of {self._address} took past the deadline."
                ) from None
            self._lasting(err)
            return None
        wire: socket.socket | lane_tls.TlsStream = sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                wire = lane_tls.dial(sock, self._tls, self._host, time.monotonic() + timeout)
                sock.settimeout(timeout)  # for the HELLO's answer, as without TLS
            wire.sendall(message(HELLO, secret))
            connection = LaneConnection(wire)
            answer = read_message(wire, connection.scratch, _MESSAGE.size + _ERROR.size
                                  + _MAX_ERROR_TEXT, _never, _never)
        except (OSError, Garbage, Oversized) as err:
            sock.close()
            if isinstance(err, ssl.SSLCertVerificationError):  # not the listener's lane
                self._lasting(err)
                return None
            if isinstance(err, TimeoutError) and timeout < _CONNECT_S:
                raise errors.DeadlineExceededError(
                    f"The lane of {self._address} did not admit the connection within the "
                    "deadline.") from None
            self._passing()
            return None  # closed unanswered: at its limits, or stopping
        if answer is None or answer[0] != READY:
            sock.close()
            if answer is not None and answer[0] == ERROR and \
                    _decode_error(answer[1])[0] == errors.PERMISSION_DENIED:
                self._lasting(errors.PermissionDeniedError(_decode_error(answer[1])[1]))
            else:
                self._passing()
            return None
        wire.settimeout(None)  # blocking: calls wait with a kernel timeout (arm)
        try:
            self._connections.add(connection)
        except errors.CancelledError:
            sock.close()
            raise
        return connection

    def _exchange(self, connection: LaneConnection, parts: Sequence[memoryview],
                  deadline: float | None, reused: bool) -> Any:
        """One call on ``connection``: the reply envelope, or ``_NOT_READ``."""
        if deadline is not None and time.monotonic() >= deadline:
            self._connections.put_back(connection)
            left(deadline)  # raises
        length = 0
        for part in parts:
            length += part.nbytes
        try:
            send_views(connection.sock, [memoryview(_MESSAGE.pack(MAGIC, CALL, length)),
                                         *parts])
        except OSError as err:
            self._connections.discard(connection)
            if reused and isinstance(err, (BrokenPipeError, ConnectionResetError)) \
                    and not self._connections.closed:
                return _NOT_READ  # the listener closed this idle one: take another
            raise self._connections.closed_error(ConnectionFailed(
                f"Sending to the lane of {self._address} failed: {err}")) from None
        try:
            connection.arm(deadline)
            passed = _never if deadline is None else lambda: time.monotonic() >= deadline
            received = read_message(connection.sock, connection.scratch, self._reply_limit,
                                    passed, passed)
        except TimeoutError:  # its answer may still come: the connection is not reused
            self._connections.discard(connection)
            raise errors.DeadlineExceededError(
                f"No response from {self._address} within the deadline.") from None
        except (OSError, Garbage, Oversized) as err:
            self._connections.discard(connection)
            raise self._connections.closed_error(errors.UnavailableError(
                f"The lane connection to {self._address} failed during the call "
                f"({type(err).__name__}: {err}).")) from None
        if received is None:
            self._connections.discard(connection)
            raise self._connections.closed_error(errors.UnavailableError(
                f"The lane connection to {self._address} closed during the call (the server "
                "died?)."))
        op, body, more = received
        if op == CLOSING:
            self._connections.discard(connection)
            return _NOT_READ
        keep = not more  # more: a CLOSING follows the answer
        if op == ERROR:
            code, text = _decode_error(body)
            if code in (errors.CANCELLED, errors.UNAVAILABLE) or not keep:
                self._connections.discard(connection)
            else:
                self._connections.put_back(connection)
            if code == errors.UNAVAILABLE:  # only for a call it did not run
                raise ConnectionFailed(text)
            raise errors.error_from_code(code, text)
        if op != REPLY:
            self._connections.discard(connection)
            raise errors.UnavailableError(f"The lane of {self._address} sent an unexpected "
                                          "message.")
        reply = bytes(body) if body.obj is connection.scratch.obj else body
        if keep:
            self._connections.put_back(connection)
        else:
            self._connections.discard(connection)
        return reply

    def after_fork(self) -> None:
        """In a forked child: forget the parent's lane connections (closing only the
        child's copies), so that the two processes never share one."""
        self._connections.after_fork()

    def close(self) -> None:
        """Close every lane connection: calls waiting on one end with CancelledError."""
        self._connections.close()


_clients: weakref.WeakSet[LaneClient] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_clients):
        client.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _never() -> bool:
    return False
