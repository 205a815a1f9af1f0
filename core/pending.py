"""Connections that have not authenticated yet: one rule for every transport.

A listener holds a connection as pending from its accept until it shows the cluster token
(a HELLO, a first request, a ticket). Pending connections do not count against
``max_connections``; each has a deadline (``handshake_timeout_seconds``), and at most
``max_pending_connections`` are held. When a new one would exceed that, the oldest pending
connection *of the peer holding the most* is closed: a peer that floods a listener with
silent connections only ever evicts its own, never another peer's handshake in progress.
A peer is whatever the transport can tell apart: a TCP peer's IP address, a Unix peer's uid.

Authenticated connections (past the token) are held to ``max_connections`` by the same
measure (``FairConnections``): at the limit, a new one of peer P displaces the oldest
connection of the peer holding the most, when that peer holds more than one more than P;
else P's is refused. A token holder that opens connection after connection then only ever
displaces its own once it holds more than its share, never locks the other peers out.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

C = TypeVar("C", bound=Hashable)
_ABSENT = object()


class PendingConnections(Generic[C]):
    """Pending connections with their deadlines and peers, oldest first (not thread-safe)."""

    def __init__(self, limit: int, timeout: float):
        self.limit = max(limit, 1)
        self.timeout = timeout
        self._deadlines: dict[C, tuple[float, Hashable]] = {}
        self._by_peer: dict[Hashable, dict[C, None]] = {}

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, connection: object) -> bool:
        return connection in self._deadlines

    def __iter__(self) -> Iterator[C]:
        return iter(self._deadlines)

    def add(self, connection: C, peer: Hashable, now: float) -> C | None:
        """Hold ``connection`` of ``peer`` until ``now + timeout``; return the connection it
        displaces (to be closed by the caller), if the limit was reached."""
        evicted = None
        if len(self._deadlines) >= self.limit:
            biggest = max(self._by_peer.values(), key=len)
            evicted = next(iter(biggest))
            self.discard(evicted)
        self._deadlines[connection] = (now + self.timeout, peer)
        self._by_peer.setdefault(peer, {})[connection] = None
        return evicted

    def discard(self, connection: C) -> bool:
        """Forget ``connection`` (authenticated or closed); False if it was not pending."""
        entry = self._deadlines.pop(connection, None)
        if entry is None:
            return False
        peer_connections = self._by_peer[entry[1]]
        del peer_connections[connection]
        if not peer_connections:
            del self._by_peer[entry[1]]
        return True

    def next_deadline(self) -> float | None:
        """The earliest deadline, or None when nothing is pending."""
        for deadline, _peer in self._deadlines.values():
            return deadline
        return None

    def expire(self, now: float) -> list[C]:
        """Forget and return the connections whose deadline has passed (to be closed)."""
        expired = []
        for connection, (deadline, _peer) in self._deadlines.items():
            if deadline > now:
                break
            expired.append(connection)
        for connection in expired:
            self.discard(connection)
        return expired


class FairConnections(Generic[C]):
    """Authenticated connections with their peers, oldest first, at most ``limit`` held by
    the rule above (not thread-safe)."""

    def __init__(self, limit: int):
        self.limit = max(limit, 1)
        self._peers: dict[C, Hashable] = {}
        self._by_peer: dict[Hashable, dict[C, None]] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, connection: object) -> bool:
        return connection in self._peers

    def __iter__(self) -> Iterator[C]:
        return iter(self._peers)

    def full(self) -> bool:
        """Whether ``limit`` connections are held (a new one displaces one or is refused)."""
        return len(self._peers) >= self.limit

    def peer(self, connection: C) -> Hashable:
        """The peer ``connection`` was added with."""
        return self._peers[connection]

    def admits(self, peer: Hashable) -> bool:
        """Whether a new connection of ``peer`` would be counted now (see ``add``)."""
        if len(self._peers) < self.limit:
            return True
        return max(map(len, self._by_peer.values())) > len(self._by_peer.get(peer, ())) + 1

    def add(self, connection: C, peer: Hashable) -> tuple[bool, C | None]:
        """Count ``connection`` of ``peer``: (whether it was, the connection it displaced, to
        be closed by the caller). Not counted when the limit is reached and no other peer
        holds more than one more connection than ``peer``."""
        displaced = None
        if len(self._peers) >= self.limit:
            if not self.admits(peer):
                return False, None
            displaced = next(iter(max(self._by_peer.values(), key=len)))
            self.discard(displaced)
        self._peers[connection] = peer
        self._by_peer.setdefault(peer, {})[connection] = None
        return True, displaced

    def discard(self, connection: C) -> bool:
        """Forget ``connection`` (closed); False if it was not counted."""
        peer = self._peers.pop(connection, _ABSENT)
        if peer is _ABSENT:
            return False
        peer_connections = self._by_peer[peer]
        del peer_connections[connection]
        if not peer_connections:
            del self._by_peer[peer]
        return True

