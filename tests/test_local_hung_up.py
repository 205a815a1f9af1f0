"""grpc+local's listener forgets, when its connection table is full, the connections whose
clients have gone before their threads noticed: ``unix.hung_up`` tells them at once."""

import socket

from clusterwire.transports.local import unix


def test_hung_up_tells_a_closed_peer_from_a_live_or_busy_one():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        assert not unix.hung_up(ours)
        theirs.send(b"a message not yet read")
        assert not unix.hung_up(ours)  # readable is not gone
        theirs.close()
        assert unix.hung_up(ours)
    finally:
        ours.close()
    assert unix.hung_up(ours)  # closed here: nothing to count either
