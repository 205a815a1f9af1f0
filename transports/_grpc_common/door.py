"""The gRPC port's pending connections, held to the rules of every other listener.

gRPC core accepts connections in C and counts them all in one quota, so a peer without the
token that keeps reconnecting could hold that quota and lock token holders out. gRPC has
no accept hook in Python, but it applies a *socket mutator* (``grpc.socket_mutator``, a C
struct passed as a pointer argument) to every socket it accepts: ``Door`` is one, built
with ctypes, that records each accepted connection. From then on the connection is pending
(``clusterwire.pending``) for ``handshake_timeout_seconds``: at most
``max_pending_connections`` are, a new one beyond that closing first one whose call came
without the token (``refused``), else the oldest of the peer (IP address) holding the most.
A call that shows the token (``authenticated``) ends its connection's pending state and
makes it one of the authenticated connections, at most ``max_connections`` (gRPC core's
quota cannot count them apart from the pending ones), shared fairly between peers
(``clusterwire.pending.FairConnections``): one more from peer P displaces (shuts) the
oldest authenticated connection of the peer holding the most when that peer holds more
than one more than P, else its call is refused (RESOURCE_EXHAUSTED) and its connection
shut; one gRPC closed (checked by the descriptor's inode) leaves the count when the count
is full. At the
deadline, a connection that called without the token is closed; one that made no call is
left to gRPC's own limits, which close it at the same deadline if it is silent
(``connection_args``) and keep it if its first call is waiting for a server thread, but for
as long again it is closed at its first call without the token; then, if gRPC still
holds it, the door keeps it (``_dormant``) only to count it if a call shows the token.

The door closes a connection with ``shutdown`` on a duplicate of gRPC's descriptor, taken
only after checking that it still is the socket accepted (same inode): gRPC sees the
connection end as if the peer had closed it. The mutator is always told "applied": a
refusal there would make gRPC stop accepting altogether. The structs are gRPC core's
(``src/core/lib/iomgr/socket_mutator.h``, with ``mutate_fd_2``, which grpcio >= 1.85 has:
pyproject's floor); ``tests/test_grpc_door.py`` fails if a grpcio stops calling it.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import socket
import threading
import time
import urllib.parse
import weakref

import grpc

from clusterwire import errors
from clusterwire.pending import FairConnections, PendingConnections
from clusterwire.transport import ListenOptions
from clusterwire.transports._grpc_common.status import abort

_LOG = logging.getLogger(__name__)
_SERVER_CONNECTION = 2  # grpc_fd_usage: GRPC_FD_SERVER_CONNECTION_USAGE
_PURGE = 32  # closed connections looked for, oldest first, when the pending ones are full


class _SocketInfo(ctypes.Structure):  # grpc_mutate_socket_info
    _fields_ = [("fd", ctypes.c_int), ("usage", ctypes.c_int)]


_MUTATE = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_int, ctypes.c_void_p)
_COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_DESTROY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_MUTATE_2 = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.POINTER(_SocketInfo), ctypes.c_void_p)


class _VTable(ctypes.Structure):  # grpc_socket_mutator_vtable
    _fields_ = [("mutate_fd", _MUTATE), ("compare", _COMPARE), ("destroy", _DESTROY),
                ("mutate_fd_2", _MUTATE_2)]


class _Mutator(ctypes.Structure):  # grpc_socket_mutator: vtable, gpr_refcount
    _fields_ = [("vtable", ctypes.POINTER(_VTable)), ("refcount", ctypes.c_ssize_t)]


_doors: dict[int, weakref.ref[Door]] = {}  # by their mutator's address


def _accepted(info, mutator: int) -> bool:
    try:
        if info.contents.usage == _SERVER_CONNECTION:
            door = _doors.get(mutator or 0)
            if door is not None and (door := door()) is not None:
                door._accepted(info.contents.fd)
    except Exception:  # noqa: BLE001 - an exception would make gRPC stop accepting
        _LOG.exception("The gRPC port's door failed to record a connection.")
    return True


def _compare(a: int, b: int) -> int:
    return ((a or 0) > (b or 0)) - ((a or 0) < (b or 0))


# The callbacks live as long as the process: gRPC may call them until its server is freed.
_VTABLE = _VTable(_MUTATE(lambda fd, mutator: True), _COMPARE(_compare),
                  _DESTROY(lambda mutator: None), _MUTATE_2(_accepted))
_mutators: list[_Mutator] = []  # never freed: gRPC holds their address (a few bytes each)


class _Pointer:
    """What grpcio passes as a pointer argument: an object whose ``int()`` is the address."""

    def __init__(self, address: int):
        self._address = address

    def __int__(self) -> int:
        return self._address


class _Connection:
    """An accepted socket: gRPC's descriptor, its inode, its peer address and, once
    authenticated, gRPC's peer string of it."""

    __slots__ = ("fd", "inode", "peer", "name")

    def __init__(self, fd: int, inode: int, peer: tuple[str, int]):
        self.fd, self.inode, self.peer = fd, inode, peer
        self.name = ""


def peer_key(address: tuple) -> tuple[str, int]:
    """(IP address, port) of a socket address, IPv4-mapped IPv6 as IPv4."""
    return address[0].removeprefix("::ffff:"), address[1]


def context_peer(peer: str) -> tuple[str, int] | None:
    """(IP address, port) of gRPC's peer string: a URI ("ipv4:10.0.0.1:5000",
    "ipv6:%5B::1%5D:5000")."""
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return None
    host, _, port = urllib.parse.unquote(rest).rpartition(":")
    return peer_key((host.strip("[]"), int(port)))


def peer_host(peer: str) -> str:
    """The peer a request of gRPC's peer string came from, for ``Frame.peer``: its IP
    address, or the whole string for a peer that has none (a Unix socket)."""
    key = context_peer(peer)
    return peer if key is None else key[0]


class Door:
    """The pending connections of one gRPC server (see the module's docstring)."""

    def __init__(self, limits: ListenOptions, name: str):
        self._pending: PendingConnections[_Connection] = PendingConnections(
            limits.max_pending_connections, limits.handshake_timeout_seconds)
        self._timeout = limits.handshake_timeout_seconds
        self._max_connections = limits.max_connections
        #: gRPC's peer strings of the authenticated connections: a call from one of them
        #: needs nothing more of the door (read without the lock).
        self.admitted: set[str] = set()
        self._admitted: dict[tuple[str, int], _Connection] = {}  # the same, by peer address
        self._shares: FairConnections[_Connection] = FairConnections(limits.max_connections)
        #: The pending connections by peer address, and those past their deadline for as
        #: long again (``_late``); empty (false) when there are none.
        self.pending: dict[tuple[str, int], _Connection] = {}
        self._tokenless: dict[_Connection, None] = {}  # pending ones a call showed tokenless
        # Unauthenticated connections past their deadline, left to gRPC's limits but closed
        # at their first call without the token: one timed to arrive just after the
        # deadline (gRPC's idle limit would then never close it). Values: when forgotten.
        self._late: dict[_Connection, float] = {}
        # Past their late time and still held by gRPC: looked up only when a call shows the
        # token; those gRPC closed are dropped when there are more than ``_dormant_bound``.
        self._dormant: dict[tuple[str, int], _Connection] = {}
        self._dormant_floor = limits.max_connections + limits.max_pending_connections
        self._dormant_bound = self._dormant_floor
        self._lock = threading.Condition()
        self._closed = False
        mutator = _Mutator(ctypes.pointer(_VTABLE), 1)  # one reference: ours, never dropped
        _mutators.append(mutator)
        self._address = ctypes.addressof(mutator)
        _doors[self._address] = weakref.ref(self)
        self._reaper = threading.Thread(target=self._reap, daemon=True,
                                        name=f"clusterwire-{name}-door")

    def argument(self) -> tuple[str, object]:
        """The gRPC server argument that installs the door."""
        return "grpc.socket_mutator", _Pointer(self._address)

    def start(self) -> None:
        self._reaper.start()

    def close(self) -> None:
        """Stop watching (the server has stopped)."""
        _doors.pop(self._address, None)
        with self._lock:
            self._closed = True
            self.pending.clear()
            self._late.clear()
            self._dormant.clear()
            self._admitted.clear()
            self._shares = FairConnections(self._max_connections)
            self.admitted.clear()
            self._lock.notify_all()

    def admit(self, context: grpc.ServicerContext) -> None:
        """A call on ``context`` showed the token: its connection counts against
        ``max_connections`` (``authenticated``), or the call is refused RESOURCE_EXHAUSTED
        and the connection shut once the refusal is sent."""
        refused = self.authenticated(context.peer())
        if refused is None:
            return
        if not context.add_callback(lambda: _shut(refused)):  # the call has ended already
            _shut(refused)
        abort(context, errors.ResourceExhaustedError(
            "The server refused the connection: it holds its max_connections "
            f"({self._max_connections}) authenticated connections, and no other peer holds "
            "more than this one. Close idle clients, or raise max_connections."))

    def authenticated(self, peer: str) -> _Connection | None:
        """A call from ``peer`` (gRPC's peer string) showed the token: its connection is no
        longer pending and is one of the authenticated connections; unless
        ``max_connections`` others are, live, and none may be displaced (see the module's
        docstring): then it is returned, for the caller to refuse the call and shut it. A
        connection the door does not hold, closed already, is let be."""
        key = context_peer(peer)
        displaced = None
        with self._lock:
            if peer in self.admitted:
                return None
            pending = self.pending.get(key)
            connection = pending or self._dormant.get(key)
            if connection is None:
                return None
            if self._shares.full():
                for old in [c for c in self._shares if not _alive(c)]:
                    self._drop(old)
            admitted, displaced = self._shares.add(connection, connection.peer[0])
            if not admitted:
                # Its other calls are refused too until it is shut; if pending, it is the
                # first to close when room is needed.
                if pending is not None:
                    self._tokenless[pending] = None
                return connection
            if displaced is not None:
                self._drop(displaced)
            if pending is not None:
                self._forget(pending)
            else:
                del self._dormant[key]
            connection.name = peer
            self._admitted[key] = connection
            self.admitted.add(peer)
        if displaced is not None:  # its calls in flight fail UNAVAILABLE; it may reconnect
            _shut(displaced)
        return None

    def _drop(self, connection: _Connection) -> None:
        """``connection`` no longer counts as authenticated."""
        del self._admitted[connection.peer]
        self._shares.discard(connection)
        self.admitted.discard(connection.name)

    def refused(self, peer: str) -> None:
        """A call from ``peer`` came without the token: its connection is the first to close
        when a new one needs room (before any whose first call has not come yet, which may
        be a token holder's), and at its deadline; past the deadline, at once."""
        with self._lock:
            connection = self.pending.get(context_peer(peer))
            if connection is None:
                return
            late = connection in self._late
            if late:
                self._forget(connection)
            else:
                self._tokenless[connection] = None
        if late:
            _shut(connection)

    def _forget(self, connection: _Connection) -> None:
        self._pending.discard(connection)
        self._late.pop(connection, None)
        del self.pending[connection.peer]
        self._tokenless.pop(connection, None)

    def _accepted(self, fd: int) -> None:
        probe = socket.socket(fileno=fd)
        try:
            peer = peer_key(probe.getpeername())
        except OSError:  # reset by the peer already: gRPC finds it closed
            return
        finally:
            probe.detach()  # gRPC's descriptor: not ours to close
        connection = _Connection(fd, os.fstat(fd).st_ino, peer)
        with self._lock:
            if self._closed:
                return
            stale = self.pending.get(peer)  # its port reused: that one is gone
            if stale is not None:
                self._forget(stale)
            self._dormant.pop(peer, None)
            stale = self._admitted.get(peer)
            if stale is not None:
                self._drop(stale)
            if len(self._pending) >= self._pending.limit:
                # Those gRPC closed itself (garbage, a reset) leave first: they take no room.
                for old in list(itertools.islice(self._pending, _PURGE)):
                    if _alive(old):
                        break
                    self._forget(old)
            evicted = None
            if len(self._pending) >= self._pending.limit and self._tokenless:
                evicted = next(iter(self._tokenless))
                self._forget(evicted)
            displaced = self._pending.add(connection, peer[0], time.monotonic())
            if displaced is not None:  # none known tokenless: the oldest of the biggest peer
                evicted = displaced
                del self.pending[displaced.peer]
            self.pending[peer] = connection
            self._lock.notify_all()
        if evicted is not None:
            _shut(evicted)

    def _reap(self) -> None:
        """At a pending connection's deadline, close it if it called without the token,
        else keep it as late for as long again; then keep it as dormant if gRPC still holds
        it."""
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                expired = self._pending.expire(now)
                closing = [c for c in expired if c in self._tokenless]
                for connection in expired:
                    if connection in self._tokenless:
                        del self.pending[connection.peer]
                        del self._tokenless[connection]
                    else:
                        self._late[connection] = now + self._timeout
                while self._late:
                    connection, until = next(iter(self._late.items()))
                    if until > now:
                        break
                    self._forget(connection)
                    if _alive(connection):
                        self._keep_dormant(connection)
                if not expired:
                    deadlines = [d for d in (self._pending.next_deadline(),
                                             next(iter(self._late.values()), None))
                                 if d is not None]
                    self._lock.wait(min(deadlines) - now if deadlines else None)
                    continue
            for connection in closing:
                _shut(connection)

    def _keep_dormant(self, connection: _Connection) -> None:
        self._dormant[connection.peer] = connection
        if len(self._dormant) > self._dormant_bound:  # drop those gRPC closed since
            for old in [c for c in self._dormant.values() if not _alive(c)]:
                del self._dormant[old.peer]
            self._dormant_bound = max(self._dormant_floor, 2 * len(self._dormant))


def _alive(connection: _Connection) -> bool:
    """Whether gRPC still holds ``connection`` (its descriptor still is the socket)."""
    try:
        return os.fstat(connection.fd).st_ino == connection.inode
    except OSError:
        return False


def _shut(connection: _Connection) -> None:
    """Shut ``connection`` down if its descriptor still is the socket accepted (gRPC may
    have closed it, and the number may name another file since)."""
    with contextlib.suppress(OSError):  # closed already
        duplicate = os.dup(connection.fd)
        try:
            if os.fstat(duplicate).st_ino == connection.inode:
                probe = socket.socket(fileno=duplicate)
                try:
                    probe.shutdown(socket.SHUT_RDWR)
                finally:
                    probe.detach()
        finally:
            os.close(duplicate)
