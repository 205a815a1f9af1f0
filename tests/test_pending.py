"""The pending-connection rule every transport applies (clusterwire.pending)."""

from __future__ import annotations

from clusterwire.pending import FairConnections, PendingConnections


def test_a_flooding_peer_evicts_only_its_own_connections():
    pending: PendingConnections[str] = PendingConnections(limit=4, timeout=5.0)
    assert pending.add("alice-1", "alice", 0.0) is None
    for n in range(3):
        assert pending.add(f"mallory-{n}", "mallory", 0.1) is None
    evicted = [pending.add(f"mallory-{n}", "mallory", 0.2) for n in range(3, 10)]
    assert evicted == [f"mallory-{n}" for n in range(7)]
    assert "alice-1" in pending and len(pending) == 4


def test_one_peer_gives_up_its_oldest_and_deadlines_expire_in_order():
    pending: PendingConnections[int] = PendingConnections(limit=2, timeout=1.0)
    pending.add(1, "p", 0.0)
    pending.add(2, "p", 0.5)
    assert pending.add(3, "p", 0.6) == 1
    assert pending.next_deadline() == 1.5
    assert pending.expire(1.55) == [2]
    assert pending.discard(3) and not pending.discard(3)
    assert len(pending) == 0 and pending.next_deadline() is None


def test_authenticated_connections_are_shared_fairly_at_the_limit():
    shares: FairConnections[str] = FairConnections(limit=4)
    for n in range(4):
        assert shares.add(f"mallory-{n}", "mallory") == (True, None)
    assert shares.add("mallory-4", "mallory") == (False, None)  # its own share is full
    assert shares.admits("alice") and not shares.admits("mallory")
    assert shares.add("alice-0", "alice") == (True, "mallory-0")  # 4 > 0 + 1: the oldest
    assert shares.add("alice-1", "alice") == (True, "mallory-1")  # 3 > 1 + 1
    assert shares.add("alice-2", "alice") == (False, None)  # 2 is not > 2 + 1
    assert shares.add("bob-0", "bob") == (True, "mallory-2")  # 2 > 0 + 1
    assert sorted(map(shares.peer, shares)) == ["alice", "alice", "bob", "mallory"]
    assert shares.discard("bob-0") and not shares.discard("bob-0")
    assert not shares.full() and shares.add("mallory-5", "mallory") == (True, None)
