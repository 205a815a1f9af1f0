"""Rogue zmq peers: malformed multipart messages, oversized parts, vanishing clients.

The listener must answer what it can with a clusterwire error, never call the handler
with a malformed frame, never die, and keep serving well-formed clients.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Iterator

import pytest
import zmq
from clusterwire_zmq import auth, wire
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import parse_monitor_message
from zmq_test_support import channel_to, payload, serving

from clusterwire import errors
from clusterwire.envelope import BULK, MAX_BUFFERS
from clusterwire.transport import Frame, ListenOptions

pytestmark = pytest.mark.timeout(60)
LIMIT = 1 << 20


class Rogue:
    """A raw DEALER speaking whatever it is told, with the PLAIN credentials to get in."""

    def __init__(self, address: str, context: zmq.Context):
        self.sock = context.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.plain_username, self.sock.plain_password = auth.USERNAME, auth.NO_TOKEN
        self.sock.connect(f"tcp://{address}")

    def exchange(self, parts: list[bytes], timeout_ms: int = 10000) -> wire.Message | None:
        self.sock.send_multipart(parts)
        if not self.sock.poll(timeout_ms):
            return None
        return wire.decode(self.sock.recv_multipart(), 1 << 40)


@pytest.fixture(scope="module")
def handled() -> list[Frame]:
    return []


@pytest.fixture(scope="module")
def listener(handled) -> Iterator:
    def handler(frame: Frame) -> Frame:
        handled.append(frame)
        return Frame(frame.header, list(frame.buffers))

    with serving(handler, ListenOptions(max_message_bytes=LIMIT)) as listener:
        yield listener


@pytest.fixture(scope="module")
def rogue(listener) -> Iterator[Rogue]:
    context = zmq.Context()
    rogue = Rogue(listener.address, context)
    yield rogue
    rogue.sock.close()
    context.term()


def _still_serves(address: str) -> None:
    with channel_to(address) as channel:
        reply = channel.call(Frame(b"ok?", [payload(100_000)]), timeout=10)
        assert bytes(reply.header) == b"ok?"


def _prefix(kind: int, count: int, request_id: int = 77) -> bytes:
    return struct.pack("<4sB3xQIII", wire.MAGIC, kind, request_id, 0, 0, count)


@pytest.mark.parametrize("parts,code", [
    ([b""], errors.INVALID_ARGUMENT),
    ([b"GET / HTTP/1.1\r\n\r\n"], errors.INVALID_ARGUMENT),
    ([_prefix(wire.REQUEST, 1) + struct.pack("<BQ", BULK, 10)], errors.INVALID_ARGUMENT),
    ([_prefix(wire.REQUEST, 0), b"unannounced part"], errors.INVALID_ARGUMENT),
    ([_prefix(wire.REQUEST, 1) + struct.pack("<BQ", BULK, LIMIT + 1)],
     errors.RESOURCE_EXHAUSTED),
    ([_prefix(wire.REQUEST, MAX_BUFFERS + 1)], errors.RESOURCE_EXHAUSTED),
    ([_prefix(wire.REPLY, 0)], errors.INVALID_ARGUMENT),
    ([_prefix(wire.WELCOME, 0)], errors.INVALID_ARGUMENT),
    ([_prefix(42, 0)], errors.INVALID_ARGUMENT),
])
def test_malformed_messages_get_an_error_reply(listener, rogue, handled, parts, code):
    before = len(handled)
    reply = rogue.exchange(parts)
    assert reply is not None and reply.kind == wire.REPLY and reply.status == code
    if parts[0][:4] == wire.MAGIC:
        assert reply.request_id == 77
    assert len(handled) == before, "a malformed message reached the handler"
    _still_serves(listener.address)


def _await_event(monitor: zmq.Socket, wanted: int, timeout_ms: int = 10000) -> int:
    """The first event in ``wanted`` that ``monitor`` (made before the action) reports."""
    while monitor.poll(timeout_ms):
        event = parse_monitor_message(monitor.recv_multipart())["event"]
        if event & wanted:
            return event
    raise AssertionError(f"no monitor event in {wanted:#x} within {timeout_ms} ms")


def test_a_part_over_the_size_limit_drops_the_peer_before_allocating(listener, handled):
    context = zmq.Context()
    rogue = Rogue(listener.address, context)
    monitor = rogue.sock.get_monitor_socket()
    try:
        assert rogue.exchange(wire.encode(wire.HELLO, 1, b"", [], 0)).kind == wire.WELCOME
        # One part bigger than ZMQ_MAXMSGSIZE (limit + room for a header): libzmq drops the
        # connection as soon as it reads the part's size, before allocating it.
        before = len(handled)
        rogue.sock.send(bytes(LIMIT + wire.PART0_OVERHEAD + 1))
        _await_event(monitor, zmq.EVENT_DISCONNECTED)
        assert len(handled) == before
    finally:
        rogue.sock.disable_monitor()
        monitor.close(linger=0)
        rogue.sock.close()
        context.term()
    _still_serves(listener.address)


def test_clients_without_plain_credentials_cannot_get_in(listener, handled):
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(f"tcp://{listener.address}")
        before = len(handled)
        sock.send_multipart(wire.encode(wire.REQUEST, 1, b"", [], 0))
        _await_event(monitor, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        assert len(handled) == before and not sock.poll(0)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close()
        context.term()


def test_many_idle_connections_and_a_vanishing_caller(listener):
    context = zmq.Context()
    idle = [Rogue(listener.address, context) for _ in range(40)]
    try:
        gone = Rogue(listener.address, context)
        gone.sock.send_multipart(wire.encode(wire.REQUEST, 5, b"bye", [payload(1 << 19)], 0))
        gone.sock.close()  # the reply will have nowhere to go
        _still_serves(listener.address)
    finally:
        for rogue in idle:
            rogue.sock.close()
        context.term()
    _still_serves(listener.address)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.integers(0, 6), counts=st.lists(st.integers(0, 1 << 21), max_size=4),
       header=st.binary(max_size=30),
       tail=st.binary(max_size=60), extra=st.lists(st.binary(max_size=30), max_size=3),
       truncate=st.integers(0, 80))
def test_fuzzed_messages_always_get_a_well_formed_answer(rogue, handled, kind, counts,
                                                        header, tail, extra, truncate):
    kinds = [count % 3 for count in counts]  # inline, bulk and unknown buffer kinds
    first = (struct.pack("<4sB3xQIII", wire.MAGIC, kind, 9, 0, len(header), len(counts))
             + struct.pack(f"<{len(counts)}B{len(counts)}Q", *kinds, *counts) + header + tail)
    if truncate:
        first = first[:-truncate]
    reply = rogue.exchange([first, *extra])
    assert reply is not None and reply.kind in (wire.REPLY, wire.WELCOME)
    assert 0 <= reply.status <= 16


def test_connections_over_max_connections_are_refused_until_one_closes():
    with serving(options=ListenOptions(max_connections=1)) as listener:
        with channel_to(listener.address) as first:
            first.call(Frame(b"in", []), timeout=10)
            with channel_to(listener.address) as second, pytest.raises(
                    errors.ResourceExhaustedError, match="max_connections"):
                second.call(Frame(b"over", []), timeout=10)
        deadline = time.monotonic() + 10
        while True:  # the first connection's end reaches the listener soon after close()
            with channel_to(listener.address) as third:
                try:
                    third.call(Frame(b"again", []), timeout=10)
                    break
                except errors.ResourceExhaustedError:
                    assert time.monotonic() < deadline, "the closed connection still counts"
            time.sleep(0.02)


def test_at_max_connections_another_peer_displaces_the_peer_holding_the_most():
    """Three channels of 127.0.0.2 (through a proxy connecting from there) against
    max_connections 2: two are admitted, the third refused; a 127.0.0.1 channel then gets in
    by displacing the older of 127.0.0.2's, and sees itself as 127.0.0.1."""
    from clusterwire.testing.peer import PEER
    from clusterwire.testing.proxy import TrickleProxy

    with serving(options=ListenOptions(max_connections=2)) as listener:
        proxy = TrickleProxy(listener.address, burst=1 << 62, source="127.0.0.2")
        try:
            with contextlib.ExitStack() as hogs:
                others = [hogs.enter_context(channel_to(proxy.address)) for _ in range(3)]
                for other in others[:2]:
                    assert bytes(other.call(Frame(PEER, []), timeout=10).header) == \
                        b"127.0.0.2"
                with pytest.raises(errors.ResourceExhaustedError, match="max_connections"):
                    others[2].call(Frame(b"over", []), timeout=10)
                with channel_to(listener.address) as mine:
                    assert bytes(mine.call(Frame(PEER, []), timeout=10).header) == \
                        b"127.0.0.1"
                assert listener.connections() <= 2
        finally:
            proxy.close()
