"""A TCP port beside the gRPC port whose connections authenticate with a ticket (a secret
the client received in a token-checked gRPC reply): the bulk port (``bulk``) and the fast
lane (``lane``).

The rules both keep (the listener's ``ListenOptions``): a connection is pending until its
first message arrives, which must happen within ``handshake_timeout_seconds``; at most
``max_pending_connections`` are pending, a new one beyond that closing the oldest of the
peer (IP address) holding the most (``clusterwire.pending``). A connection whose first
message is good (``admit``) counts against ``max_connections``, shared fairly between
peers (``clusterwire.pending.FairConnections``): over it, a new one displaces (closes) the
oldest of the peer holding the most when that peer holds more than one more than the new
one's, else the new one is refused. Each connection is served on a thread of its own.
"""

from __future__ import annotations

import abc
import contextlib
import socket
import threading
import time

from clusterwire.pending import FairConnections, PendingConnections
from clusterwire.transport import ListenOptions

_SEND_BATCH = 256  # buffers per sendmsg (well under IOV_MAX)


class TicketPort(abc.ABC):
    """A listening TCP socket on ``host`` (any free port) and its connections' threads."""

    def __init__(self, host: str, limits: ListenOptions, name: str):
        self._limits = limits
        self._name = name
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # "::" serves IPv4 clients too, as gRPC's own wildcard listener does.
        self._socket = socket.create_server(
            (host, 0), family=family, backlog=128,
            dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6())
        self.port: int = self._socket.getsockname()[1]
        # No first message yet (each thread keeps its own deadline).
        self._pending: PendingConnections[socket.socket] = PendingConnections(
            limits.max_pending_connections, limits.handshake_timeout_seconds)
        # Admitted with their first message, by peer (IP address).
        self._connections: FairConnections[socket.socket] = FairConnections(
            limits.max_connections)
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._acceptor = threading.Thread(target=self._accept, name=name, daemon=True)

    def start(self) -> None:
        """Accept connections."""
        self._acceptor.start()

    @abc.abstractmethod
    def _serve(self, connection: socket.socket, peer: str) -> None:
        """Serve one connection of ``peer`` on its own thread (read its first message
        within the handshake deadline, ``_admit`` it); ``_forget`` it when done."""

    def _close_listening(self) -> list[socket.socket]:
        """Refuse new connections; the pending and admitted ones now."""
        with self._lock:
            self._stopping = True
            connections = [*self._connections, *self._pending]
        shutdown(self._socket, socket.SHUT_RDWR)
        self._socket.close()
        return connections

    def _join(self, deadline: float) -> None:
        """Wait until ``deadline`` for the connections' threads to end."""
        for thread in self._serving():
            thread.join(max(deadline - time.monotonic(), 0.0))

    def _join_acceptor(self) -> None:
        """Wait (bounded) for the acceptor to end (after ``_close_listening``)."""
        if self._acceptor.is_alive():
            self._acceptor.join(5)

    def _join_rest(self) -> None:
        """Wait (bounded) for the acceptor and the threads of cut connections."""
        self._join_acceptor()
        for thread in self._serving():
            thread.join(5)

    def _serving(self) -> list[threading.Thread]:
        with self._lock:
            return list(self._threads)

    def _accept(self) -> None:
        while True:
            try:
                connection, peer = self._socket.accept()
            except OSError:
                if self._stopping:
                    return  # stop() closed the socket
                time.sleep(0.1)  # out of descriptors or a connection aborted: keep serving
                continue
            with self._lock:
                refused = self._stopping
                if not refused:
                    evicted = self._pending.add(connection, peer[0], time.monotonic())
                    if evicted is not None:
                        shutdown(evicted, socket.SHUT_RDWR)  # its thread wakes and closes it
                    thread = threading.Thread(target=self._run, args=(connection, peer[0]),
                                              name=self._name, daemon=True)
                    self._threads.add(thread)
                    thread.start()  # under the lock: stop() never joins an unstarted thread
            if refused:
                connection.close()

    def _run(self, connection: socket.socket, peer: str) -> None:
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._serve(connection, peer)
        except OSError:
            pass  # the client went away, was too slow, or stop() cut the connection
        finally:
            with self._lock:
                self._pending.discard(connection)
                self._connections.discard(connection)
                self._threads.discard(threading.current_thread())
            connection.close()

    def _admit(self, connection: socket.socket, peer: str) -> bool:
        """Move a connection of ``peer`` that sent a good first message from pending to
        admitted; False if it was closed as the oldest pending one, or ``max_connections``
        are admitted and none may be displaced."""
        with self._lock:
            if not self._pending.discard(connection):
                return False
            admitted, displaced = self._connections.add(connection, peer)
        if displaced is not None:  # its thread wakes and closes it
            self._displace(displaced)
        return admitted

    def _displace(self, connection: socket.socket) -> None:
        """Close an admitted connection pushed out by a new one (its thread ends)."""
        shutdown(connection, socket.SHUT_RDWR)


def send_views(connection: socket.socket, views: list[memoryview]) -> None:
    """Write every byte of ``views`` (partial sendmsg results resumed); ``views`` is left
    as it was."""
    sent = connection.sendmsg(views if len(views) <= _SEND_BATCH else views[:_SEND_BATCH])
    first, copied = 0, False
    while True:  # skip what was sent; most often all of it at the first sendmsg
        while first < len(views) and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if first == len(views):
            return
        if sent:
            if not copied:
                views, copied = list(views), True
            views[first] = views[first][sent:]
        sent = connection.sendmsg(views[first:first + _SEND_BATCH])


def shutdown(connection: socket.socket, how: int) -> None:
    """``connection.shutdown(how)``, if it is still connected."""
    with contextlib.suppress(OSError):  # not connected, or closed already
        connection.shutdown(how)
