"""The grpc transport's fast lane (``fast_lane = true``): fallback to gRPC, and its TCP port
under abuse (silent connections, a flood, oversized frames, per-peer caps, stolen tickets).
The lane under TLS: ``test_grpc_lane_tls``.

Listeners run on 127.0.0.1 in this process; every wait polls an outcome with a deadline,
and every socket, channel and listener is closed at the end.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest
from conftest import wait_for
from grpc_listeners import TOKEN, channel_to, listening

from clusterwire import errors
from clusterwire.security import Security
from clusterwire.testing.floods import SilentFlood, require_descriptors
from clusterwire.testing.peer import SLEEP, echo_handler
from clusterwire.transport import Frame, ListenOptions
from clusterwire.transports.grpc import lane
from clusterwire.transports.grpc.transport import GrpcTransport

FLOOD = 1024
LANE = {"fast_lane": True}


def echo(channel, payload: bytes = b"8 bytes!", timeout: float = 10) -> float:
    """Seconds an echo of ``payload`` took (checked)."""
    started = time.monotonic()
    reply = channel.call(Frame(b"small", [payload]), timeout=timeout)
    assert bytes(reply.buffers[0]) == payload
    return time.monotonic() - started


def hello(port: int, secret: bytes) -> socket.socket:
    """A raw lane connection that sent ``secret`` in its HELLO."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(lane.message(lane.HELLO, secret))
    return sock


def answer(sock: socket.socket) -> tuple[int, bytes] | None:
    """The next lane message on a raw connection (op, body), None at its end."""
    scratch = memoryview(bytearray(1 << 16))
    received = lane.read_message(sock, scratch, 1 << 16, lambda: True, lambda: True)
    return None if received is None else (received[0], bytes(received[1]))


def secret_of(listener, peer: str = "127.0.0.1") -> bytes:
    return listener.lane.ticket(peer)[-16:]


# -- fallback -----------------------------------------------------------------------------


def test_a_peer_without_the_lane_is_called_over_grpc():
    with listening({}) as listener, channel_to(listener.address, transport_options=LANE) as channel:
        assert listener.lane is None
        for _ in range(3):
            echo(channel)
        assert channel._lane.calls == 0
        assert channel._lane._after > time.monotonic()  # not asked again for a while


@pytest.mark.timeout(60)
@pytest.mark.parametrize("blocked", ["refused", "silent"])
def test_a_lane_port_that_cannot_be_reached_keeps_calls_on_grpc(monkeypatch, blocked):
    monkeypatch.setattr(lane, "_CONNECT_S", 1.0)
    with contextlib.ExitStack() as stack:
        wall = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=0))
        if blocked == "refused":
            port = wall.getsockname()[1]
            wall.close()
        else:  # its accept queue full, and never accepted: new SYNs are dropped (a firewall)
            port = wall.getsockname()[1]
            for _ in range(8):
                filler = socket.socket()
                filler.setblocking(False)
                stack.callback(filler.close)
                filler.connect_ex(("127.0.0.1", port))
        listener = stack.enter_context(listening(LANE))
        monkeypatch.setattr(listener.lane, "port", port)  # the tickets announce that port
        channel = stack.enter_context(channel_to(listener.address, transport_options=LANE))
        took = echo(channel)
        assert took < lane._CONNECT_S + 2.0, f"the first call took {took:.2f} s"
        assert echo(channel) < 1.0  # the lane is not tried again for a while
        assert channel._lane.calls == 0 and listener.lane.calls == 0


def test_a_stopped_listener_fails_the_next_call_at_once():
    with listening(LANE) as listener:
        address = listener.address
        channel = GrpcTransport(LANE).connect(address, Security(token=TOKEN))
        try:
            echo(channel)
            listener.stop(0)  # the channel's idle lane connection is told CLOSING
            started = time.monotonic()
            with pytest.raises(errors.UnavailableError):
                channel.call(Frame(b"after", [b"x"]), timeout=10)
            assert time.monotonic() - started < 5
        finally:
            channel.close()


def test_an_idle_connection_the_listener_closed_is_replaced():
    with listening(LANE) as listener, \
            channel_to(listener.address, transport_options=LANE) as channel:
        echo(channel)
        (served,) = listener.lane._served.values()
        served.close_when_idle()  # as when displaced: CLOSING, then closed
        echo(channel)
        assert channel._lane.calls == 2


def test_a_call_past_its_deadline_leaves_the_lane_usable():
    with listening(LANE) as listener, \
            channel_to(listener.address, transport_options=LANE) as channel:
        with pytest.raises(errors.DeadlineExceededError):
            channel.call(Frame(SLEEP + b"2", []), timeout=0.2)
        echo(channel)
        assert channel._lane.calls == 1


def test_stop_cancels_a_call_on_the_lane_after_its_grace():
    entered = threading.Event()

    def handler(frame: Frame) -> Frame:
        entered.set()
        time.sleep(3)
        return frame

    with listening(LANE, handler=handler) as listener, \
            channel_to(listener.address, transport_options=LANE) as channel:
        outcome: list[object] = []

        def call() -> None:
            try:
                outcome.append(channel.call(Frame(b"block", []), timeout=30))
            except errors.OpError as err:
                outcome.append(err)

        caller = threading.Thread(target=call)
        caller.start()
        assert entered.wait(10)
        listener.stop(0.2)
        caller.join(10)
        assert isinstance(outcome[0], errors.CancelledError), outcome
        assert listener.lane.calls == 1


# -- the lane's port under abuse ------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_token_holders_call_is_answered_within_1s_under_a_lane_connection_flood():
    require_descriptors(4 * FLOOD + 4096)
    with listening(LANE, handshake_timeout_seconds=0.5) as listener:
        flood = SilentFlood(FLOOD, socket.AF_INET, socket.SOCK_STREAM,
                            ("127.0.0.1", listener.lane.port))
        try:
            opened = time.monotonic()
            with channel_to(listener.address, transport_options=LANE) as channel:
                took = echo(channel)  # a fresh channel: ticket, lane connection, call
                assert took < 1.0, f"a token holder's call took {took:.3f} s"
                assert channel._lane.calls == 1  # it went over the lane, beside the flood
            wait_for(lambda: flood.closed() == FLOOD, 0.5 + 10,
                     f"the lane closing {FLOOD} silent connections")
            assert time.monotonic() - opened > 0.3  # closed by the deadline, not at accept
            print(f"\n{FLOOD} silent lane connections: a token holder's 8-byte call took "
                  f"{took * 1000:.1f} ms; all closed {time.monotonic() - opened:.2f} s "
                  "after opening")
        finally:
            flood.close()


@pytest.mark.timeout(60)
def test_the_lane_keeps_the_newest_pending_connections():
    with listening(LANE, handshake_timeout_seconds=60, max_pending_connections=4) as listener:
        flood = SilentFlood(10, socket.AF_INET, socket.SOCK_STREAM,
                            ("127.0.0.1", listener.lane.port))
        try:
            wait_for(lambda: flood.closed() >= 6, 10, "the 6 oldest closed")
            assert flood.closed() == 6
            with channel_to(listener.address, transport_options=LANE) as channel:
                assert echo(channel) < 1.0 and channel._lane.calls == 1
        finally:
            flood.close()


def test_a_wrong_or_used_secret_is_closed_unanswered():
    with listening(LANE) as listener:
        with hello(listener.lane.port, b"\x00" * 16) as guess:
            assert answer(guess) is None
        secret = secret_of(listener)
        with hello(listener.lane.port, secret) as first:
            assert answer(first) == (lane.READY, b"")
            with hello(listener.lane.port, secret) as again:
                assert answer(again) is None


def test_a_ticket_of_another_peer_is_refused():
    with listening(LANE) as listener:
        with hello(listener.lane.port, secret_of(listener, "127.0.0.2")) as sock:
            op, body = answer(sock)
            assert op == lane.ERROR and b"127.0.0.2" in body
            assert answer(sock) is None


def test_an_oversized_frame_is_refused_before_it_is_read():
    with listening(LANE) as listener, hello(listener.lane.port, secret_of(listener)) as sock:
        assert answer(sock) == (lane.READY, b"")
        sock.sendall(lane._MESSAGE.pack(lane.MAGIC, lane.CALL, 1 << 40))
        op, body = answer(sock)
        assert op == lane.ERROR and int.from_bytes(body[:4], "little") == \
            errors.RESOURCE_EXHAUSTED
        assert b"over the" in body
        assert answer(sock) is None  # then closed
        with channel_to(listener.address, transport_options=LANE) as channel:
            echo(channel)


def test_a_request_over_max_message_bytes_is_resource_exhausted_on_the_lane():
    with listening(LANE, max_message_bytes=1024) as listener, \
            channel_to(listener.address, transport_options=LANE) as channel:
        with pytest.raises(errors.ResourceExhaustedError):
            channel.call(Frame(b"big", [b"x" * 4096]), timeout=10)
        echo(channel)  # the same connection serves on
        assert listener.lane.calls == 2 and len(listener.lane._served) == 1


def test_garbage_on_the_lane_closes_that_connection_only():
    with listening(LANE) as listener, hello(listener.lane.port, secret_of(listener)) as sock:
        assert answer(sock) == (lane.READY, b"")
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert answer(sock) is None
        with channel_to(listener.address, transport_options=LANE) as channel:
            echo(channel)
            assert channel._lane.calls == 1


def test_connections_over_max_connections_are_refused_and_calls_go_over_grpc():
    with listening(LANE, max_connections=2) as listener:
        held = []
        try:
            for _ in range(2):
                held.append(hello(listener.lane.port, secret_of(listener)))
                assert answer(held[-1]) == (lane.READY, b"")
            with hello(listener.lane.port, secret_of(listener)) as third:
                op, body = answer(third)
                assert op == lane.ERROR and b"max_connections" in body
            with channel_to(listener.address, transport_options=LANE) as channel:
                echo(channel)  # over gRPC: the lane is full
                assert channel._lane.calls == 0
                # Not asked again for every call meanwhile (a ticket, a refused connection).
                assert channel._lane._after > time.monotonic()
        finally:
            for sock in held:
                sock.close()


def test_a_connection_from_another_peer_displaces_the_peer_holding_the_most():
    with listening(LANE, max_connections=3) as listener:
        held = []
        try:
            for _ in range(3):  # admitted one after the other: held[0] is the oldest
                held.append(hello(listener.lane.port, secret_of(listener)))
                assert answer(held[-1]) == (lane.READY, b"")
            other = socket.create_connection(("127.0.0.1", listener.lane.port), timeout=10,
                                              source_address=("127.0.0.2", 0))
            with other:
                other.sendall(lane.message(lane.HELLO, secret_of(listener, "127.0.0.2")))
                assert answer(other) == (lane.READY, b"")
                assert answer(held[0]) == (lane.CLOSING, b"")  # the oldest of 127.0.0.1
        finally:
            for sock in held:
                sock.close()


def test_without_the_token_no_ticket_and_no_call():
    with listening(LANE) as listener, \
            channel_to(listener.address, token=b"x" * 32, transport_options=LANE) as channel:
        with pytest.raises(errors.UnauthenticatedError):
            echo(channel)
        assert listener.lane.calls == 0


def test_option_errors_name_the_fix():
    with pytest.raises(errors.InvalidArgumentError, match="bulk_plane"):
        GrpcTransport({"fast_lane": True, "bulk_plane": "grpc"})
    with pytest.raises(errors.InvalidArgumentError, match="fast_lane"):
        GrpcTransport({"fast_lane": "yes"})
    assert "small_calls" in GrpcTransport(LANE).info()
    assert "small_calls" not in GrpcTransport().info()


def test_a_wildcard_ipv6_listener_serves_ipv4_clients_over_the_lane():
    if not socket.has_dualstack_ipv6():
        pytest.skip("no dual-stack IPv6 here")
    listener = GrpcTransport(LANE).listen("[::]:0", echo_handler, ListenOptions())
    listener.start()
    channel = GrpcTransport(LANE).connect(f"127.0.0.1:{listener.address.rsplit(':', 1)[1]}")
    try:
        echo(channel)
        assert channel._lane.calls == 1  # its ticket's peer matched the v4-mapped one
    finally:
        channel.close()
        listener.stop(0)


def test_a_forked_child_does_not_share_the_parents_lane_connections():
    with listening(LANE) as listener, \
            channel_to(listener.address, transport_options=LANE) as channel:
        echo(channel)
        (parent_side,) = channel._lane._connections._open
        pid = os.fork()
        if pid == 0:  # the child: no grpc call here, only what the fork left it
            pool = channel._lane._connections
            os._exit(0 if pool.take() is None and not pool._open
                     and parent_side.sock.fileno() == -1 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        echo(channel)  # the parent's connection still serves it
        assert channel._lane.calls == 2 and len(listener.lane._served) == 1


class _ShortWrites:
    """A socket whose sendmsg writes at most ``most`` bytes, as a full send buffer under a
    send timeout does (the lane's listener sets SO_SNDTIMEO)."""

    def __init__(self, sock: socket.socket, most: int):
        self._sock, self._most = sock, most
        self.sendmsg_calls = 0

    def sendmsg(self, views: list) -> int:
        self.sendmsg_calls += 1
        room, taken = self._most, []
        for view in views:
            if room <= 0:
                break
            taken.append(memoryview(view)[:room])
            room -= taken[-1].nbytes
        return self._sock.sendmsg(taken)


def test_send_views_resumes_partial_sends_and_leaves_the_parts_as_they_were():
    """sendmsg takes part of the parts at a time, and every byte still arrives once, in
    order (empty parts skipped); the caller's list is unchanged; 600 parts go in batches."""
    parts = [memoryview(bytes([index]) * size)
             for index, size in enumerate([0, 5, 30_000, 0, 7, 100_000, 1])]
    parts += [memoryview(b"%03d" % index) for index in range(600)]
    expected = b"".join(parts)
    before = list(parts)
    writer, reader = socket.socketpair()
    with writer, reader:
        received = bytearray()

        def read() -> None:
            while len(received) < len(expected):
                chunk = reader.recv(65536)
                if not chunk:
                    return
                received.extend(chunk)

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        short = _ShortWrites(writer, 4099)
        lane.send_views(short, parts)
        thread.join(30)
        assert not thread.is_alive()
    assert bytes(received) == expected
    assert parts == before
    assert short.sendmsg_calls >= len(expected) // 4099
