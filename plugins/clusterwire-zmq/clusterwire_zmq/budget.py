"""A byte budget per connection for what libzmq holds and the listener has not received.

libzmq bounds each part of a multipart message (``ZMQ_MAXMSGSIZE``) but not their sum,
hands a message over only once its last part arrived, and counts its receive high-water
mark in whole messages: a peer that sends part after part and never the last one grows
the listener without limit, and nothing the listener receives shows it. The kernel does:
``TCP_INFO``'s ``tcpi_bytes_received`` counts a connection's bytes as they arrive. So for
every connection the guard compares that count with the ZMTP bytes of the messages the
listener received from it (``delivered``) every ``CHECK_SECONDS``, and resets a
connection whose difference grew by more than ``budget`` bytes since the check after its
last delivered message.

A connection's bytes arrive in order and this plugin's channels send one message at a
time, so an honest connection's difference is its one message in flight (at most
``max_message_bytes`` plus its first part's envelope and frame headers) and bytes that are
no message: the greeting and PLAIN handshake (a few hundred) and ZMTP heartbeats (6.4 bytes
a second measured at the default interval, counted until the next delivered message), in
``SLACK_BYTES``. The check after a delivery takes the difference as the new baseline, so
the next message's bytes that arrived before it are not counted; libzmq therefore holds
at most ``budget + 2 x rate x interval`` of one connection's unfinished message, where
rate is how fast its bytes reach libzmq and interval is ``CHECK_SECONDS``, or longer with
many connections (``check_interval``), and later when the guard's thread waits for a
CPU. One I/O thread per listener decodes every connection's bytes, so over all connections
the excess is at most twice what that thread decodes in an interval. Bytes counted here
are wire bytes: a message of many empty parts costs libzmq about 64 bytes a part on top
of its 2.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

#: The shortest interval between two of the guard's comparisons.
CHECK_SECONDS = 0.01
#: The guard spends at most this share of a CPU on the checks (a check of 1,000
#: connections costs 1,000 TCP_INFO reads): their interval grows with their cost.
CHECK_CPU_SHARE = 0.05
#: Bytes of a connection that are no message (greeting, PLAIN handshake, heartbeats).
SLACK_BYTES = 1 << 20
# struct tcp_info: tcpi_bytes_received (Linux 4.1) is the u64 at offset 128.
_TCP_INFO_BYTES = 136
_BYTES_RECEIVED = struct.Struct("=Q")
_BYTES_RECEIVED_OFFSET = 128


def wire_bytes(parts: list) -> int:
    """The ZMTP bytes of a received message's parts (after the ROUTER's routing id): each
    part's data and its frame header (2 bytes for a short frame, 9 for a long one)."""
    total = 0
    for index in range(1, len(parts)):
        size = len(parts[index])
        total += size + (2 if size < 256 else 9)
    return total


def check_interval(spent: float) -> float:
    """Seconds until the next check, after one that took ``spent`` seconds of the
    checking thread's CPU time."""
    return max(CHECK_SECONDS, spent / CHECK_CPU_SHARE)


def bytes_received(sock: socket.socket) -> int:
    """How many bytes the kernel has received on ``sock``'s TCP connection."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    if len(info) < _TCP_INFO_BYTES:
        raise OSError("this kernel's TCP_INFO has no tcpi_bytes_received (Linux 4.1+)")
    return _BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_OFFSET)[0]


@dataclass(eq=False)
class Budgeted:
    """One connection: a duplicate of its descriptor (kept open until its end is reported,
    so the number cannot be reused meanwhile) and its byte counts."""

    sock: socket.socket
    peer: str
    delivered: int = 0
    ident: bytes = b""
    _checked_delivered: int = field(default=0, repr=False)
    _baseline: int = field(default=0, repr=False)

    def over(self, budget: int) -> bool:
        """Whether the connection's undelivered bytes grew past ``budget`` since the check
        after its last delivered message (that check resets the baseline instead)."""
        received = bytes_received(self.sock)  # before ``delivered``: never undercounted
        delivered = self.delivered
        held = received - delivered
        if delivered != self._checked_delivered:
            self._checked_delivered, self._baseline = delivered, held
            return False
        return held - self._baseline > budget
