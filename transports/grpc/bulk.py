"""The grpc transport's bulk plane: announced response buffers over plain TCP.

grpcio's Python binding copies every message it receives twice (gRPC slices
into bytes objects, then their join), which held a receiver to about
0.6-0.8 ms of CPU per MiB on the machines we measure. On this plane the
receiver reads straight into its own buffers (``recv_into``: the kernel's
copy only) and the sender writes the caller's buffers with ``sendmsg``.

Only the bytes of a large response (over the transport's ``bulk_bytes``)
take this path; the request, the response header and every status stay on
gRPC. The listener
opens one extra TCP port on its own host and announces it in each large
reply, together with the reply's fetch id. The exchange on a connection,
repeated any number of times::

    client -> server   fetch id u64
    server -> client   "CWB1" | status u8 (0: ok, 1: unknown id, 2: the task the response
                       is forwarded from failed to send it) | total length u64 | the bytes

A forwarded response (``relay``) is sent as it arrives from the task that owns it; if
that task fails midway, the connection closes before the announced length.

The fetch id is an unguessable single-use ticket that the client received
over the (token-checked) gRPC reply, so it is the only credential the plane
needs. The plane carries no TLS: a listener with TLS never opens it, and its
large replies are fetched over gRPC as before.

Limits (the listener's ``ListenOptions``): a connection is pending until its
first fetch id arrives, which must happen within ``handshake_timeout_seconds``;
at most ``max_pending_connections`` are pending, a new one beyond that closing
the oldest of the peer (IP address) holding the most (``clusterwire.pending``).
A connection whose first id is answered counts against ``max_connections``,
shared fairly between peers (``clusterwire.pending.FairConnections``): over it, a
new one displaces (closes) the oldest of the peer holding the most when that peer
holds more than one more than the new one's, else the new one's id is left unread
and it is closed (the client fetches over gRPC). A client that stops reading a
response for ``message_idle_timeout_seconds`` is cut off.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.buffers import MIN_POOLED_BYTES, receive_buffers, split
from clusterwire.transport import ListenOptions
from clusterwire.transports._grpc_common.call_pool import left
from clusterwire.transports.grpc.relay import Incoming, Relay, splice
from clusterwire.transports.grpc.ticket_port import TicketPort, send_views
from clusterwire.transports.grpc.ticket_port import shutdown as _shutdown

_TICKET = struct.Struct("<Q")
_STATUS = struct.Struct("<4sBQ")
_MAGIC = b"CWB1"
_OK, _UNKNOWN, _UPSTREAM_FAILED = 0, 1, 2
#: A connection that sends no further fetch id for this long is closed (its client reconnects).
IDLE_SECONDS = 300.0
_CONNECT_S = 5.0  # longer, and the port is taken for unreachable (firewalled)
_MAX_IDLE = 4  # idle connections kept per server


class Unreachable(Exception):
    """The fetch id never reached a bulk server: fetch this response over gRPC.

    ``lasting``: the port could not be connected to (or is not a bulk port), so
    the channel should not try it again for a while; otherwise the server was
    only busy (it closed a new connection at its connection limit).
    """

    def __init__(self, message: str, lasting: bool):
        super().__init__(message)
        self.lasting = lasting


class BulkServer(TicketPort):
    """Serves announced responses on a TCP port of the listener's host."""

    def __init__(self, host: str, take: Callable[[int], Sequence[memoryview] | Relay | None],
                 limits: ListenOptions):
        super().__init__(host, limits, "clusterwire-grpc-bulk")
        self._take = take

    def stop(self, grace: float | None) -> None:
        """Refuse new fetches; transfers running get ``grace`` seconds, then are cut."""
        for connection in self._close_listening():  # idle ones end at once, busy ones
            _shutdown(connection, socket.SHUT_RD)  # after sending
        self._join(time.monotonic() + (grace or 0.0))
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            _shutdown(connection, socket.SHUT_RDWR)
        self._join_rest()

    def _serve(self, connection: socket.socket, peer: str) -> None:
        ticket = bytearray(_TICKET.size)
        deadline = time.monotonic() + self._limits.handshake_timeout_seconds
        if not (_receive_into(connection, memoryview(ticket), deadline)
                and self._admit(connection, peer)):
            return  # silent, too slow, pushed out, or over the limit: the id stays unread
        while True:
            source = self._take(_TICKET.unpack(ticket)[0])
            if source is None:  # expired, fetched already, or a stranger's guess
                connection.sendall(_STATUS.pack(_MAGIC, _UNKNOWN, 0))
                return
            connection.settimeout(self._limits.message_idle_timeout_seconds)
            if isinstance(source, Relay):
                if not _send_relay(connection, source,
                                   self._limits.message_idle_timeout_seconds):
                    return
            else:
                connection.sendall(_STATUS.pack(_MAGIC, _OK, sum(v.nbytes for v in source)))
                send_views(connection, list(source))
            connection.settimeout(IDLE_SECONDS)
            if not _receive_into(connection, memoryview(ticket)):
                return


class BulkClient:
    """Fetches announced responses from one server's bulk port; keeps idle connections."""

    def __init__(self, address: str):
        self._host = split_host_port(address)[0]
        self._address = address
        self._idle: dict[int, list[socket.socket]] = {}
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False

    def fetch(self, port: int, fetch_id: int, lengths: Sequence[int],
              deadline: float | None) -> list:
        """The announced buffers of ``lengths``; ``Unreachable`` if the port cannot be reached."""
        connection = self._open_fetch(port, fetch_id, lengths, deadline)
        try:
            buffers = _receive_buffers(connection, lengths, deadline)
        except BaseException as err:
            self._discard(connection)
            raise self._error(err) from None
        self._keep(port, connection)
        return buffers

    def open_incoming(self, port: int, fetch_id: int, lengths: Sequence[int],
                      deadline: float | None, chunk_bytes: int) -> Incoming:
        """The announced response, answered and ready to read (see ``relay``); chunks of
        at most ``chunk_bytes``. ``Unreachable`` as ``fetch``."""
        connection = self._open_fetch(port, fetch_id, lengths, deadline)
        return _BulkIncoming(self, port, connection, sum(lengths), deadline, chunk_bytes)

    def _open_fetch(self, port: int, fetch_id: int, lengths: Sequence[int],
                    deadline: float | None) -> socket.socket:
        """A connection on which ``fetch_id`` was answered OK, its bytes next."""
        connection = None
        try:
            for reuse in (True, False):
                connection, reused = self._connection(port, deadline, reuse)
                try:
                    code, total = self._ask(connection, fetch_id, deadline)
                    break
                except ConnectionError:
                    self._discard(connection)
                    connection = None
                    if not reused:  # a new connection closed unanswered: the id is unread
                        raise Unreachable(f"{self._host}:{port} is at its connection limit",
                                          lasting=False) from None
                    # else the server had closed this idle connection: retry on a new one
            if code == _UPSTREAM_FAILED:
                raise errors.UnavailableError(
                    f"{self._address} forwarded this response from another task, which "
                    "failed to send it.")
            if code != _OK:
                raise errors.NotFoundError(
                    f"No pending response {fetch_id} at {self._address}: it expired or was "
                    "fetched already.")
            if total != sum(lengths):
                raise errors.DataLossError(
                    f"{self._address} sent {total} bytes for a response announced as "
                    f"{sum(lengths)}.")
        except BaseException as err:
            if connection is not None:
                self._discard(connection)
            raise self._error(err) from None
        return connection

    def _keep(self, port: int, connection: socket.socket) -> None:
        """Keep a connection whose exchange ended for the next fetch (or close it)."""
        with self._lock:
            idle = self._idle.setdefault(port, [])
            kept = not self._closed and len(idle) < _MAX_IDLE
            if kept:
                idle.append(connection)
            else:
                self._open.discard(connection)
        if not kept:
            connection.close()

    def close(self) -> None:
        """Close every connection, cutting fetches in flight (they raise CancelledError)."""
        with self._lock:
            self._closed = True
            connections, self._open, self._idle = list(self._open), set(), {}
        for connection in connections:
            _shutdown(connection, socket.SHUT_RDWR)
            connection.close()

    def _connection(self, port: int, deadline: float | None,
                    reuse: bool = True) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._closed:
                raise errors.CancelledError(f"Channel to {self._address} is closed.")
            for stale in [p for p in self._idle if p != port]:  # the server restarted
                for connection in self._idle.pop(stale):
                    self._open.discard(connection)
                    connection.close()
            idle = self._idle.get(port)
            if reuse and idle:
                return idle.pop(), True
        timeout = _CONNECT_S if deadline is None else min(left(deadline, TimeoutError), _CONNECT_S)
        try:
            connection = socket.create_connection((self._host, port), timeout=timeout)
        except TimeoutError:
            if timeout < _CONNECT_S:
                raise  # the call's deadline, not the port, ran out
            raise Unreachable(f"bulk port {self._host}:{port}: connect timed out",
                              lasting=True) from None
        except OSError as err:
            raise Unreachable(f"bulk port {self._host}:{port}: {err}", lasting=True) from None
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            closed = self._closed
            if not closed:
                self._open.add(connection)
        if closed:
            connection.close()
            raise errors.CancelledError(f"Channel to {self._address} is closed.")
        return connection, False

    def _ask(self, connection: socket.socket, fetch_id: int,
             deadline: float | None) -> tuple[int, int]:
        """Send the fetch id; the server's (status, total length)."""
        connection.settimeout(left(deadline, TimeoutError))
        connection.sendall(_TICKET.pack(fetch_id))
        status = bytearray(_STATUS.size)
        if not _receive_into(connection, memoryview(status), deadline):
            raise ConnectionResetError("the bulk connection closed")
        magic, code, total = _STATUS.unpack(status)
        if magic != _MAGIC:
            raise Unreachable(f"the bulk port announced by {self._address} answers as another "
                              "service", lasting=True)
        return code, total

    def _discard(self, connection: socket.socket) -> None:
        with self._lock:
            self._open.discard(connection)
        connection.close()

    def _error(self, err: BaseException) -> BaseException:
        if isinstance(err, (errors.OpError, Unreachable)):
            return err
        if isinstance(err, TimeoutError):
            return errors.DeadlineExceededError(
                f"Deadline exceeded while receiving a response from {self._address}.")
        if isinstance(err, OSError):
            if self._closed:
                return errors.CancelledError(f"Channel to {self._address} was closed.")
            return errors.UnavailableError(
                f"The connection to {self._address} broke during a transfer: {err}")
        return err


def _receive_into(connection: socket.socket, view: memoryview,
                  deadline: float | None = None) -> bool:
    """Fill ``view``; False on a clean end of stream before the first byte."""
    filled = 0
    while filled < view.nbytes:
        if deadline is not None:
            connection.settimeout(left(deadline, TimeoutError))
        count = connection.recv_into(view[filled:])
        if count == 0:
            if filled == 0:
                return False
            raise ConnectionResetError(f"the bulk connection closed after {filled} bytes")
        filled += count
    return True


def _receive_buffers(connection: socket.socket, lengths: Sequence[int],
                     deadline: float | None) -> list:
    """Writable buffers of ``lengths`` read from ``connection``: large ones from the pool,
    each run of small ones in one read (one system call, not one per buffer)."""
    buffers: list = []
    index = 0
    while index < len(lengths):
        if lengths[index] >= MIN_POOLED_BYTES:
            buffer = receive_buffers.take(lengths[index])
            _receive_exactly(connection, memoryview(buffer), deadline)
            buffers.append(buffer)
            index += 1
            continue
        end = index
        while end < len(lengths) and lengths[end] < MIN_POOLED_BYTES:
            end += 1
        whole = memoryview(np.empty(sum(lengths[index:end]), np.uint8))
        _receive_exactly(connection, whole, deadline)
        buffers.extend(split(whole, lengths[index:end]))
        index = end
    return buffers


def _receive_exactly(connection: socket.socket, view: memoryview,
                     deadline: float | None) -> None:
    if view.nbytes and not _receive_into(connection, view, deadline):
        raise ConnectionResetError("the bulk connection closed before the data")


class _BulkIncoming(Incoming):
    """A response being read from a bulk connection (the fetch id was answered OK)."""

    def __init__(self, client: BulkClient, port: int, connection: socket.socket, total: int,
                 deadline: float | None, chunk_bytes: int):
        self._client, self._port, self._connection = client, port, connection
        self._left, self._deadline, self._chunk_bytes = total, deadline, chunk_bytes

    def chunks(self) -> Iterator[memoryview]:
        chunk = memoryview(bytearray(min(self._chunk_bytes, self._left)))
        try:
            while self._left:
                view = chunk[:min(self._left, chunk.nbytes)]
                _receive_exactly(self._connection, view, self._deadline)
                self._left -= view.nbytes
                yield view
        except (OSError, TimeoutError) as err:
            raise self._client._error(err) from None

    def send_to(self, connection: socket.socket, idle: float) -> None:
        try:
            splice(self._connection, connection, self._left, self._deadline, idle)
        except TimeoutError:
            raise errors.DeadlineExceededError("A forwarded response stalled.") from None
        self._left = 0

    def close(self) -> None:
        if self._left:  # the rest is unread: the connection cannot serve another fetch
            self._client._discard(self._connection)
        else:
            self._client._keep(self._port, self._connection)


def _send_relay(connection: socket.socket, relay: Relay, idle: float) -> bool:
    """Send a forwarded response as it arrives; False if its owner could not send it (the
    client was told so)."""
    try:
        incoming = relay.open()
    except errors.OpError:
        connection.sendall(_STATUS.pack(_MAGIC, _UPSTREAM_FAILED, 0))
        return False
    with incoming:
        connection.sendall(_STATUS.pack(_MAGIC, _OK, relay.nbytes))
        try:
            incoming.send_to(connection, idle)
        except errors.OpError as err:  # the owner failed midway: cut the client off
            raise ConnectionAbortedError(err.message) from None
    return True


