"""A token holder speaking raw ZMTP sends part after part of one message and never the last.

libzmq hands nothing over until the last part arrives and bounds only each part, so the
listener sees no message: before the connection byte budget (budget.py), 300 parts of
1 MiB grew a listener with a 1 MiB limit by 301 MiB and would have grown it without end.
Now the guard shuts such a connection down once libzmq holds more than its budget
(max_message_bytes, the first part's largest envelope and 1 MiB of ZMTP overhead) plus
what arrives within two of its checks (every 10 ms, later when the guard's thread waits for
a CPU); token holders' calls are served meanwhile.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from clusterwire_zmq import auth, budget, wire
from zmq_test_support import (
    channel_to,
    listener_process,
    payload,
    peak_rss_mib,
    rss_mib,
    serving,
)
from zmtp_peer import ZmtpPeer

from clusterwire import errors
from clusterwire.transport import Frame, ListenOptions

pytestmark = pytest.mark.timeout(120)
_MiB = 1 << 20
LIMIT = _MiB
#: Parts a round offers (the listener must cut the connection long before).
SEND_MIB = 1024
ROUNDS = 8
#: What libzmq may hold beyond the budget: what arrives within two checks. A typical round
#: (the median) gets two 10 ms checks' worth at up to 3.2 GiB/s; the peak of all rounds
#: allows a check up to 100 ms late at 1.6 GiB/s (the guard thread waits for a CPU on a
#: loaded machine: 215 ms once in 80 rounds here, at load 3).
TYPICAL_OVERSHOOT_MIB = 2 * 3.2 * 1024 * budget.CHECK_SECONDS
PEAK_OVERSHOOT_MIB = 2 * 1.6 * 1024 * (budget.CHECK_SECONDS + 0.1)


def _budget_mib(limit: int) -> float:
    return (limit + wire.PART0_OVERHEAD + 9 * wire.MAX_PARTS + budget.SLACK_BYTES) / _MiB


class _Caller(threading.Thread):
    """A token holder making 8-byte calls until stopped: their latencies and errors."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address = address
        self.latencies: list[float] = []
        self.errors: list[Exception] = []
        self.stop = threading.Event()

    def run(self) -> None:
        value = np.arange(1, dtype=np.int64)
        with channel_to(self.address) as channel:
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    reply = channel.call(Frame(b"8", [value]), timeout=10)
                    assert bytes(reply.buffers[0]) == value.tobytes()
                except Exception as err:  # noqa: BLE001  (reported by the test)
                    self.errors.append(err)
                    return
                self.latencies.append(time.monotonic() - start)


def _attack(address: str) -> int:
    """One round: MiB of parts the kernel accepted before the listener cut the connection."""
    peer = ZmtpPeer(address, auth.USERNAME, auth.NO_TOKEN)
    blob = bytes(_MiB)
    sent = 0
    try:
        peer.send_part(b"\0" * 40, more=True)
        while sent < SEND_MIB:
            peer.send_part(blob, more=True)
            sent += 1
    except (BrokenPipeError, ConnectionResetError):
        return sent
    finally:
        peer.close()
    raise AssertionError(f"the listener took {SEND_MIB} MiB of one unfinished message")


def test_a_message_that_never_ends_is_cut_at_the_connection_budget():
    with listener_process(LIMIT) as (process, address):
        caller = _Caller(address)
        caller.start()
        deadline = time.monotonic() + 30
        while not caller.latencies and not caller.errors:
            assert time.monotonic() < deadline, "the token holder's first call never returned"
            time.sleep(0.01)
        before = rss_mib(process.pid)
        try:
            sent = [_attack(address) for _ in range(ROUNDS)]
        finally:
            caller.stop.set()
            caller.join(30)
        grown = peak_rss_mib(process.pid) - before
        typical = sorted(sent)[ROUNDS // 2]
        assert not caller.errors, caller.errors
        assert typical < _budget_mib(LIMIT) + TYPICAL_OVERSHOOT_MIB, sent
        bound = _budget_mib(LIMIT) + PEAK_OVERSHOOT_MIB
        assert grown < bound, f"the listener grew by {grown:.0f} MiB (bound {bound:.0f})"
        calls = len(caller.latencies)
        slowest = max(caller.latencies)
        assert slowest < 1, f"a token holder's 8-byte call took {slowest:.2f} s"
        with channel_to(address) as channel:
            assert bytes(channel.call(Frame(b"after", []), timeout=10).header) == b"after"
        print(f"\n{ROUNDS} rounds of unfinished 1 MiB parts, cut after {min(sent)}-"
              f"{max(sent)} MiB sent (median {typical}); the listener's peak grew by "
              f"{grown:.0f} MiB (budget "
              f"{_budget_mib(LIMIT):.0f} MiB, bound {bound:.0f}); {calls} 8-byte calls "
              f"meanwhile, slowest {slowest * 1000:.1f} ms")


def _descriptors(pid: int) -> tuple[int, int]:
    """``(open, soft limit)`` of process ``pid``'s descriptors."""
    with open(f"/proc/{pid}/limits") as limits:
        soft = next(int(line.split()[3]) for line in limits if line.startswith("Max open files"))
    return len(os.listdir(f"/proc/{pid}/fd")), soft


def _fill(pid: int, address: str) -> tuple[list[ZmtpPeer], int]:
    """Open connections (two descriptors each in the listener) until at most one descriptor
    is left; the connections and how many are left."""
    held: list[ZmtpPeer] = []
    while True:
        count, soft = _descriptors(pid)
        if soft - count <= 1:
            return held, soft - count
        held.append(ZmtpPeer(address, auth.USERNAME, auth.NO_TOKEN))
        deadline = time.monotonic() + 10
        while _descriptors(pid)[0] < count + 2:  # the guard's duplicate, taken at its accept
            assert time.monotonic() < deadline, "the guard did not take the duplicate"
            time.sleep(0.01)


def test_a_connection_the_guard_cannot_budget_is_closed():
    """Each connection holds two descriptors in the listener (libzmq's and the guard's
    duplicate). When libzmq can accept a connection but the guard finds no descriptor left
    for its duplicate, the guard closes it: never left unbudgeted (without that, this raw
    peer's unfinished message grew the listener by 1,024 MiB). Once the others close, a
    channel is served again. Run with 20, 21, ... spare descriptors until one run leaves
    exactly one after the connections that fill them (the parity decides it, and a
    descriptor the listener opens or closes meanwhile, as on a loaded machine, shifts it)."""
    attacked = 0
    for spare in range(20, 28):
        if attacked:
            break
        with listener_process(LIMIT, spare_descriptors=spare) as (process, address):
            held, left = _fill(process.pid, address)
            try:
                if left == 1:
                    attacked += 1
                    before = rss_mib(process.pid)
                    with pytest.raises(ConnectionError):  # closed in its handshake
                        _attack(address)
                    grown = peak_rss_mib(process.pid) - before
                    assert grown < 16, f"the listener grew by {grown:.0f} MiB"
            finally:
                for peer in held:
                    peer.close()
            deadline = time.monotonic() + 30
            while True:  # the closed connections' descriptors are freed soon after
                try:
                    with channel_to(address) as channel:
                        reply = channel.call(Frame(b"back", []), timeout=10)
                    assert bytes(reply.header) == b"back"
                    break
                except errors.OpError:
                    assert time.monotonic() < deadline, "the listener serves no one"
                    time.sleep(0.05)
    assert attacked, "no run left exactly one descriptor"


def test_honest_calls_leave_no_bytes_unaccounted():
    """The guard counts every byte of the messages a channel sends: after 300 calls of
    8 bytes to 1 MiB (inline and zero-copy buffers, 2 to 3 parts) what the kernel received
    and the guard counted differ by the greeting, PLAIN handshake and heartbeats only, so
    honest connections never drift toward their budget however long they live."""
    sizes = [8, 1000, 70_000, 1 << 20]
    unaccounted = []
    with (serving(options=ListenOptions(max_message_bytes=4 << 20)) as listener,
          channel_to(listener.address) as channel):
        for _ in range(3):
            for index in range(100):
                size = sizes[index % len(sizes)]
                buffers = [payload(size, index), payload(size // 3, index)]
                reply = channel.call(Frame(b"h" * index, buffers), timeout=10)
                assert len(reply.buffers) == 2
            (conn,) = listener._guard._conns.values()
            unaccounted.append(budget.bytes_received(conn.sock) - conn.delivered)
    assert all(0 < count < 1024 for count in unaccounted), unaccounted
    print(f"\nunaccounted bytes after 100, 200, 300 calls: {unaccounted}")
    assert max(unaccounted) - min(unaccounted) < 64, unaccounted
