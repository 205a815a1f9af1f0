"""A token holder's oversized multipart messages against a zmq listener in another process.

libzmq hands a multipart message over only once all of its parts arrived, and bounds each
part (ZMQ_MAXMSGSIZE) but neither their number nor their sum: what it buffers is what the
peer sent, up to the connection's byte budget (budget.py). The listener must refuse such a
message with RESOURCE_EXHAUSTED and add no more than a bounded amount on top of libzmq's
buffer (it used to keep a Python frame for every part: 2,000,000 empty parts, 4 MB on the
wire, grew a listener by 521 MiB), then serve on.
"""

from __future__ import annotations

import struct
import subprocess
import time
from collections.abc import Iterator

import pytest
import zmq
from clusterwire_zmq import auth, wire
from zmq_test_support import channel_to, listener_process, payload, peak_rss_mib, rss_mib

from clusterwire import errors
from clusterwire.envelope import BULK
from clusterwire.transport import Frame

pytestmark = pytest.mark.timeout(120)
LIMIT = 1 << 20
_MiB = 1 << 20


@pytest.fixture
def listener() -> Iterator[tuple[subprocess.Popen, str]]:
    with listener_process(LIMIT) as started:
        yield started


def _send_oversized(address: str, pid: int, parts: int, part_bytes: int
                    ) -> tuple[wire.Message, float]:
    """Send a request declaring one 10-byte buffer with ``parts`` buffer parts of
    ``part_bytes`` each (PLAIN credentials: libzmq lets it in); its reply and how much the
    listener grew (peak RSS, MiB) before it answered."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    sock.plain_username, sock.plain_password = auth.USERNAME, auth.NO_TOKEN
    try:
        sock.connect(f"tcp://{address}")
        sock.send_multipart(wire.encode(wire.HELLO, 1, b"", [], 0))
        assert sock.poll(10000), "no WELCOME"
        sock.recv_multipart()
        before = rss_mib(pid)
        sock.send(struct.pack("<4sB3xQIII", wire.MAGIC, wire.REQUEST, 29, 0, 0, 1)
                  + struct.pack("<BQ", BULK, 10), zmq.SNDMORE)
        blob = bytes(part_bytes)
        for _ in range(parts - 1):
            sock.send(blob, zmq.SNDMORE, copy=False)
        sock.send(blob)
        deadline = time.monotonic() + 90
        while not sock.poll(50):
            assert time.monotonic() < deadline, "the oversized message was never answered"
        reply = wire.decode(sock.recv_multipart(), 1 << 40)
        return reply, peak_rss_mib(pid) - before
    finally:
        sock.close()
        context.term()


def _still_serves(address: str) -> None:
    with channel_to(address) as channel:
        reply = channel.call(Frame(b"ok?", [payload(100_000)]), timeout=10)
        assert bytes(reply.header) == b"ok?"


def test_a_message_of_a_million_empty_parts_is_refused_without_a_frame_per_part(listener):
    """1,000,000 empty parts (2 MB on the wire): libzmq holds a message struct per part
    (about 64 MiB); the listener keeps at most wire.MAX_PARTS of them as frames."""
    process, address = listener
    reply, grown = _send_oversized(address, process.pid, 1_000_000, 0)
    assert reply.kind == wire.REPLY and reply.request_id == 29
    assert reply.status == errors.RESOURCE_EXHAUSTED, reply.header
    assert b"max_message_bytes" in reply.header
    assert grown < 128, f"the listener grew by {grown:.0f} MiB"
    _still_serves(address)
    print(f"\n1,000,000 empty parts: the listener grew by {grown:.0f} MiB, then refused it")


def test_parts_summing_past_the_limit_are_refused_holding_no_more_than_was_sent(listener):
    """40 parts of 1 MiB (each within ZMQ_MAXMSGSIZE) against a 1 MiB limit, within the
    connection's byte budget (budget.py; test_zmq_unfinished.py goes past it): libzmq
    buffers what was sent before the listener sees the message; the listener adds no copy
    of it and refuses it as RESOURCE_EXHAUSTED."""
    process, address = listener
    sent_mib = 40
    reply, grown = _send_oversized(address, process.pid, sent_mib, _MiB)
    assert reply.status == errors.RESOURCE_EXHAUSTED, reply.header
    assert grown < sent_mib + 32, f"the listener grew by {grown:.0f} MiB for {sent_mib} sent"
    _still_serves(address)
    print(f"\n{sent_mib} MiB in parts of 1 MiB against a 1 MiB limit: the listener grew by "
          f"{grown:.0f} MiB, then refused it")
