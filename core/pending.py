"""Connections that have not authenticated yet: one rule for every transport.

A listener holds a connection as pending from its accept until it shows the cluster token
(a HELLO, a first request, a ticket). Pending connections do not count against
``max_connections``; each has a deadline (``handshake_timeout_seconds``), and at most
``max_pending_connections`` are held. When a new one would exceed that, the oldest pending
connection *of the peer holding the most* is closed: a peer that floods a listener with
silent connections only ever evicts its own, never another peer's handshake in progress.
A peer is whatever the transport can tell apart: a TCP peer's IP address, a Unix peer's uid.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

C = TypeVar("C", bound=Hashable)


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
