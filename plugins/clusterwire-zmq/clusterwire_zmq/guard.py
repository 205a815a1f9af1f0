"""A listener's connection limits, which libzmq does not keep: ``max_connections`` and
``max_pending_connections``, and the handshake deadline past the ZMTP handshake.

libzmq's ``HANDSHAKE_IVL`` closes a connection whose ZMTP handshake (greeting, PLAIN and
the ZAP token check) is not done in time; ZAP itself cannot count connections (it never
hears of one closing). So the guard follows the ROUTER's monitor events (a connection
accepted or gone, by descriptor) and counts a connection as authenticated once its first
message arrives (``SRCFD`` names its descriptor; only a token holder gets a message
through). Until then it is pending: when a new one would exceed
``max_pending_connections``, the oldest pending one of the peer (IP address) holding the
most is closed (``clusterwire.pending``), and one still pending after
``handshake_timeout_seconds`` is closed. With ``max_connections`` authenticated, a first
message displaces the oldest connection of the peer holding the most when that peer holds
more than one more than the new one's (``FairConnections``), else it is refused and its
connection stays pending. The guard also names each admitted connection's peer
(``Frame.peer``), and shuts down a connection whose bytes libzmq holds past its budget
(``budget.py``: a multipart message that never ends).

Ordering: libzmq reports a connection's end before its descriptor is reused and its
acceptance before any of its messages, so draining the events before looking up a
message's descriptor finds that message's connection. At its accept the guard keeps a
duplicate of a connection's descriptor, once the duplicate shows it is a connection to
this listener (libzmq may have closed it and reused the number meanwhile), until its end
is reported: it reads the connection's TCP counters and shuts it down through it.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import select
import socket
import struct
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from clusterwire.pending import FairConnections, PendingConnections
from clusterwire.transport import ListenOptions
from clusterwire_zmq import wire
from clusterwire_zmq.budget import SLACK_BYTES, Budgeted, check_interval, wire_bytes
from clusterwire_zmq.sockets import NOBLOCK, readable

_ACCEPTED, _DISCONNECTED = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED)
_SRCFD = int(zmq.SRCFD)
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: the last close sends RST
_monitor_ids = itertools.count()


def _peer_address(part: zmq.Frame) -> str:
    """The peer's IP address libzmq gives a message (a connection the guard did not see)."""
    try:
        return part.get("Peer-Address")
    except zmq.ZMQError:  # not over TCP
        return ""


class ConnectionGuard:
    """Watches one ROUTER socket's connections (a thread) and admits their first messages.

    Create it before the socket binds; the socket's owner disables the monitor before it
    closes the socket (see ``SharedRouter.close``), then calls ``close``.
    """

    def __init__(self, context: zmq.Context, sock: zmq.Socket, options: ListenOptions):
        self._max_connections = options.max_connections
        self._timeout = options.handshake_timeout_seconds
        # One message in flight (its envelope, buffers and ZMTP frame headers) and the rest.
        self._budget = (options.max_message_bytes + wire.PART0_OVERHEAD
                        + 9 * wire.MAX_PARTS + SLACK_BYTES)
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(int(self._timeout * 1000), 1))
        self._events = context.socket(zmq.PAIR)
        self._events.setsockopt(zmq.LINGER, 0)
        # Unbounded: libzmq's I/O thread blocks on a full monitor pipe.
        self._events.setsockopt(zmq.RCVHWM, 0)
        endpoint = f"inproc://clusterwire-zmq-guard-{next(_monitor_ids)}"
        sock.monitor(endpoint, _ACCEPTED | _DISCONNECTED)
        self._events.connect(endpoint)
        self._lock = threading.Lock()
        self._pending: PendingConnections[int] = PendingConnections(  # by descriptor
            options.max_pending_connections, self._timeout)
        self._admitted: dict[int, bytes] = {}  # descriptor -> routing id
        self._shares: FairConnections[int] = FairConnections(self._max_connections)
        self._conns: dict[int, Budgeted] = {}  # descriptor -> connection, from its accept
        self._by_ident: dict[bytes, Budgeted] = {}  # routing id -> connection
        self._idents: dict[bytes, str] = {}  # routing id -> peer of admitted connections
        self._ip, self._port = "", 0  # where the socket is bound, set by ``watch``
        self._closed = False
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="clusterwire-zmq-guard",
                                         daemon=True)

    def watch(self, ip: str, port: int) -> None:
        """Start the thread, once the socket is bound to ``ip`` (maybe a wildcard), ``port``."""
        self._ip, self._port = ip, port
        self._thread.start()

    def admitted(self) -> int:
        """Authenticated connections held now."""
        with self._lock:
            return len(self._admitted)

    def received(self, ident: bytes, parts: list[zmq.Frame]) -> None:
        """Count message ``parts`` (routing id first, then at least one part) as received
        from the connection of routing id ``ident``."""
        conn = self._by_ident.get(ident)  # the common case: no lock
        if conn is None:
            with self._lock:
                if self._closed:
                    return
                self._drain()
                conn = self._conns.get(parts[1].get(_SRCFD))
                if conn is None:  # gone already
                    return
                conn.ident = ident
                self._by_ident[ident] = conn
        conn.delivered += wire_bytes(parts)

    def admit(self, ident: bytes, part: zmq.Frame) -> str | None:
        """The peer (IP address) of the connection that sent ``part`` if it may be served:
        admitted already, or admitted now as its first message by the rule above; None
        when it is refused."""
        peer = self._idents.get(ident)  # the common case: no lock
        if peer is not None:
            return peer
        with self._lock:
            if self._closed:
                return _peer_address(part)
            self._drain()
            fd = part.get(_SRCFD)
            conn = self._conns.get(fd)
            if fd not in self._pending:  # admitted, or gone (unknown): serve it
                return conn.peer if conn is not None and conn.peer else _peer_address(part)
            peer = conn.peer if conn is not None else ""
            admitted, displaced = self._shares.add(fd, peer)
            if not admitted:
                return None
            if displaced is not None:  # its end is reported when libzmq closes it
                self._idents.pop(self._admitted.pop(displaced), None)
                self._shut_down(displaced)
            self._pending.discard(fd)
            self._admitted[fd] = ident
            self._idents[ident] = peer
            return peer

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._events.getsockopt(zmq.FD), select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        next_check = time.monotonic()
        while True:
            with self._lock:
                if self._closed:
                    return
                self._drain()
                now = time.monotonic()
                self._expire(now)
                if now >= next_check:
                    cpu = time.thread_time()
                    self._check_budgets()
                    next_check = now + check_interval(time.thread_time() - cpu)
                deadline = self._pending.next_deadline()
                if self._conns:
                    deadline = next_check if deadline is None else min(deadline, next_check)
                wait = None if deadline is None else max(deadline - time.monotonic(), 0)
            poller.poll(None if wait is None else wait * 1000 + 1)

    def _drain(self) -> None:
        """Under the lock: apply every monitor event libzmq has sent so far."""
        while readable(self._events):
            event = parse_monitor_message(self._events.recv_multipart(NOBLOCK))
            fd = int(event["value"])
            if event["event"] == _ACCEPTED:
                conn = self._adopt(fd)
                if conn is not None:
                    self._conns[fd] = conn
                evicted = self._pending.add(fd, conn.peer if conn else "", time.monotonic())
                if evicted is not None:
                    self._shut_down(evicted)
            else:
                self._pending.discard(fd)
                self._shares.discard(fd)
                self._idents.pop(self._admitted.pop(fd, b""), None)
                conn = self._conns.pop(fd, None)
                if conn is not None:
                    self._by_ident.pop(conn.ident, None)
                    conn.sock.close()

    def _check_budgets(self) -> None:
        """Under the lock: shut down the connections holding more than their budget."""
        for fd, conn in self._conns.items():
            try:
                over = conn.over(self._budget)
            except OSError:  # shut down already; its end is on the way
                continue
            if over:
                self._shut_down(fd, reset=True)

    def _expire(self, now: float) -> None:
        """Under the lock: close the pending connections past their deadline."""
        for fd in self._pending.expire(now):
            self._shut_down(fd)

    def _shut_down(self, fd: int, reset: bool = False) -> None:
        """Shut connection ``fd`` down (libzmq then closes it and reports it gone); with
        ``reset``, its close resets it: a sender blocked on a full window learns at once."""
        conn = self._conns.get(fd)
        if conn is not None:
            with contextlib.suppress(OSError):
                if reset:
                    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                conn.sock.shutdown(socket.SHUT_RDWR)

    def _adopt(self, fd: int) -> Budgeted | None:
        """Connection ``fd``, through a duplicate of its descriptor, if it is still one to
        this listener (libzmq may have closed and reused the number), else None."""
        try:
            duplicate = os.dup(fd)
        except OSError as err:  # closed meanwhile, or no descriptor left for the duplicate
            if err.errno in (errno.EMFILE, errno.ENFILE):
                self._refuse_unbudgeted(fd)
            return None
        try:
            sock = socket.socket(fileno=duplicate)
        except OSError:  # not a socket any more
            os.close(duplicate)
            return None
        try:
            peer = sock.getpeername()[0]
        except OSError:
            sock.close()
            return None
        if not self._is_ours(sock):
            sock.close()
            return None
        return Budgeted(sock, peer)

    def _is_ours(self, sock: socket.socket) -> bool:
        """Whether ``sock`` is a connection accepted by this listener's socket."""
        try:
            ip, port = sock.getsockname()[:2]
        except OSError:
            return False
        return port == self._port and (ip == self._ip or self._ip in ("0.0.0.0", "::"))

    def _refuse_unbudgeted(self, fd: int) -> None:
        """Shut down connection ``fd``, which cannot be budgeted (the process has no
        descriptor left to duplicate it), through libzmq's own descriptor."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return
        try:
            with contextlib.suppress(OSError):
                if self._is_ours(sock):
                    sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.detach()  # libzmq's descriptor: never closed here

    def close(self) -> None:
        """Stop the thread and close the monitor's reader (after the monitor is disabled)."""
        with self._lock:
            self._closed = True
        os.write(self._stop_w, b"\0")
        if self._thread.ident is not None:
            self._thread.join(10)
        self._events.close(linger=0)
        for conn in self._conns.values():
            conn.sock.close()
        self._conns.clear()
        self._by_ident.clear()
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
