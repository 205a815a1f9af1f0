"""Fair shares of a server's bounded tables between the peers that fill them: one rule.

A server tells its clients apart only by peer (``Frame.peer``: a TCP peer's IP address, a
Unix peer's ``uid:N``; ``""`` for callers in its own process, and for an entry whose creator
a restart forgot). Each entry of a table counts for the peer whose request created it. When
a table is full, a new entry of ``size`` from peer P takes the place of:

1. when the peer holding the most holds more than P would with the new entry: that peer's
   oldest entry nobody uses (the table says which: a job nobody read, a dataset no job
   used, a stream every reader released), else that peer's oldest entry;
2. else P's own oldest entry nobody uses;
3. else nothing: P holds its fair share and is refused (``ResourceExhaustedError``).

A peer flooding a table therefore only ever displaces its own entries once other peers hold
theirs, a peer holding less than the biggest always finds room, and a peer's entry it has
not used yet (a job it is about to read) goes for its own new one only while no peer holds
more than it would. Whoever used a displaced entry is told why at its next use
(``Displaced``), never left to find it silently gone. Pending connections
(``clusterwire.pending``) keep a simpler rule of their own: a new one is never refused, it
displaces the oldest of the peer holding the most.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from clusterwire import errors

K = TypeVar("K", bound=Hashable)


def peer_name(peer: str) -> str:
    """How a peer is named in messages."""
    return f"peer {peer}" if peer else "this server's own process (or a peer a restart forgot)"


class FairShares(Generic[K]):
    """The entries of one table with their peers and sizes, oldest first (not thread-safe)."""

    def __init__(self) -> None:
        self._entries: dict[K, tuple[str, int]] = {}  # entry -> (peer, size), oldest first
        self._by_peer: dict[str, dict[K, None]] = {}
        self._held: dict[str, int] = {}

    def add(self, entry: K, peer: str, size: int = 1) -> None:
        """Count ``entry`` (newest) for ``peer``; an entry added again keeps its first peer."""
        if entry in self._entries:
            return
        self._entries[entry] = (peer, size)
        self._by_peer.setdefault(peer, {})[entry] = None
        self._held[peer] = self._held.get(peer, 0) + size

    def discard(self, entry: K) -> bool:
        """Forget ``entry``; False if it was not counted."""
        found = self._entries.pop(entry, None)
        if found is None:
            return False
        peer, size = found
        entries = self._by_peer[peer]
        del entries[entry]
        self._held[peer] -= size
        if not entries:
            del self._by_peer[peer], self._held[peer]
        return True

    def peer_of(self, entry: K) -> str | None:
        """The peer ``entry`` counts for (None: not counted)."""
        found = self._entries.get(entry)
        return None if found is None else found[0]

    def held(self, peer: str) -> int:
        """What ``peer``'s entries add up to (their sizes)."""
        return self._held.get(peer, 0)

    @property
    def total(self) -> int:
        """What all entries add up to."""
        return sum(self._held.values())

    def biggest(self) -> tuple[str, int]:
        """The peer holding the most and what it holds (("", 0) when empty)."""
        if not self._held:
            return "", 0
        peer = max(self._held, key=self._held.__getitem__)
        return peer, self._held[peer]

    def make_room(self, peer: str, need: int, size: int = 1,
                  unused: Iterable[K] = ()) -> list[K] | None:
        """The entries a new entry of ``size`` from ``peer`` displaces to free ``need`` (in
        units of size) of a full table, by the module's rule; ``unused`` lists the entries
        nobody uses, oldest first. None when the rule refuses (then nothing is to go)."""
        held = dict(self._held)
        chosen: OrderedDict[K, None] = OrderedDict()
        freed = 0

        def choose(entry: K) -> None:
            nonlocal freed
            owner, entry_size = self._entries[entry]
            chosen[entry] = None
            held[owner] -= entry_size
            freed += entry_size

        unused = [e for e in unused if e in self._entries]

        def oldest_unused(owner: str) -> K | None:
            return next((e for e in unused if e not in chosen and self._entries[e][0] == owner),
                        None)

        while freed < need:
            owner = max(held, key=held.__getitem__, default=None)
            if owner is not None and held[owner] > held.get(peer, 0) + size:
                found = oldest_unused(owner)
                choose(found if found is not None else
                       next(e for e in self._by_peer[owner] if e not in chosen))
                continue
            own = oldest_unused(peer)
            if own is None:
                return None
            choose(own)
        return list(chosen)

    def refusal(self, table: str, limit: str, peer: str, size: int, advice: str,
                retry_later: bool = False) -> errors.ResourceExhaustedError:
        """The error refusing a new entry of ``size`` from ``peer`` (the rule chose none);
        ``retry_later`` where the table's entries end by themselves (``OpError``)."""
        biggest, most = self.biggest()
        return errors.ResourceExhaustedError(
            f"{table} is full ({limit}), and {peer_name(peer)} holds {self.held(peer)} of it "
            f"(with {size} more, as much as the peer holding the most, {peer_name(biggest)}, "
            f"holds: {most}): a full table is shared fairly between peers, and a new entry "
            f"displaces only one of a peer holding more. {advice}", retry_later=retry_later)

    def displacement(self, what: str, table: str, limit: str, entry: K, peer: str) -> str:
        """Why ``entry`` (``what``) goes to make room for ``peer``'s (call before discarding
        it): what its users are told at their next use."""
        owner = self.peer_of(entry) or ""
        needed = ("needed room for a newer one nobody used yet" if owner == peer else
                  f"{peer_name(peer)} needed room")
        return (f"{what} was displaced: {table} was full ({limit}), {peer_name(owner)} held "
                f"{self.held(owner)} of it, the most, and {needed} (a full table is shared "
                "fairly between peers: see the README's Reliability list). Create it again "
                "when the table has room, or use fewer at once from that peer.")


class Displaced(Generic[K]):
    """Entries displaced from a table and why, the newest ``limit`` of them (not
    thread-safe): their users are told at their next use."""

    def __init__(self, limit: int):
        self._limit = max(limit, 1)
        self._why: OrderedDict[K, str] = OrderedDict()

    def remember(self, entry: K, why: str) -> None:
        """Record that ``entry`` was displaced, and why."""
        self._why[entry] = why
        self._why.move_to_end(entry)
        while len(self._why) > self._limit:
            self._why.popitem(last=False)

    def forget(self, entry: K) -> None:
        """``entry`` exists again (created anew under the same key)."""
        self._why.pop(entry, None)

    def why(self, entry: K) -> str | None:
        """Why ``entry`` was displaced (None: it was not, or too long ago)."""
        return self._why.get(entry)
