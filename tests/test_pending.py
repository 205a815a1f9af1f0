"""The pending-connection rule every transport applies (clusterwire.pending)."""

from __future__ import annotations

from clusterwire.pending import PendingConnections


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
