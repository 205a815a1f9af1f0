"""The gRPC port's door (clusterwire.transports._grpc_common.door): which connection it
holds as pending, and which it closes first. Listeners in this process on loopback."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from conftest import wait_for

from clusterwire import errors
from clusterwire.security import Security
from clusterwire.testing.peer import echo_handler
from clusterwire.transport import Frame, ListenOptions
from clusterwire.transports._grpc_common.door import Door, context_peer
from clusterwire.transports._grpc_common.status import ERROR_CODE_KEY
from clusterwire.transports.grpc.transport import GrpcTransport

pytestmark = pytest.mark.timeout(60)
TOKEN = b"t" * 32


@contextlib.contextmanager
def listening(host: str = "127.0.0.1", **limits) -> Iterator:
    listener = GrpcTransport().listen(f"{host}:0", echo_handler,
                                      ListenOptions(security=Security(token=TOKEN), **limits))
    listener.start()
    try:
        yield listener, listener._control._door
    finally:
        listener.stop(0)


def open_to(listener) -> socket.socket:
    host, port = listener.address.rsplit(":", 1)
    return socket.create_connection((host.strip("[]"), int(port)), timeout=5)


def still_open(sock: socket.socket) -> bool:
    """True unless the server closed ``sock`` (what it sent, its SETTINGS, is read)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def test_grpc_peer_strings_name_the_socket_address():
    assert context_peer("ipv4:10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert context_peer("ipv6:%5B::1%5D:5000") == ("::1", 5000)
    assert context_peer("unix:/tmp/x") is None


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_a_token_holders_connection_stops_being_pending_at_its_first_call(host):
    if host == "[::1]" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    with listening(host) as (listener, door):
        channel = GrpcTransport().connect(listener.address, Security(token=TOKEN))
        try:
            reply = channel.call(Frame(b"x", [b"8 bytes!"]), timeout=10)
            assert bytes(reply.buffers[0]) == b"8 bytes!"
            assert not door.pending
        finally:
            channel.close()


def test_a_connection_that_called_without_the_token_is_closed_first():
    with listening(max_pending_connections=2, handshake_timeout_seconds=60) as (listener, door):
        silent = open_to(listener)
        try:
            with grpc.insecure_channel(listener.address) as tokenless:
                with pytest.raises(grpc.RpcError) as refused:
                    tokenless.unary_unary("/clusterwire.Transport/Call")(b"", timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                wait_for(lambda: len(door.pending) == 2, what="two pending connections")
                newest = open_to(listener)  # over the limit: the tokenless caller leaves
                try:
                    wait_for(lambda: set(door.pending) == {
                        context_peer(f"ipv4:127.0.0.1:{s.getsockname()[1]}")
                        for s in (silent, newest)}, what="the tokenless caller closed")
                    assert still_open(silent)  # older, but it may be a token holder's
                finally:
                    newest.close()
        finally:
            silent.close()


def test_a_first_call_waiting_for_a_thread_past_the_handshake_timeout_is_answered():
    """Sixteen new token holders at once, on a server with one thread for their calls:
    the last first calls start long after handshake_timeout_seconds and are still
    answered (the door closes only connections that called without the token)."""
    def slow(frame: Frame) -> Frame:
        time.sleep(0.2)  # the handler's work: 16 calls on one thread take 3.2 s
        return echo_handler(frame)

    listener = GrpcTransport().listen("127.0.0.1:0", slow, ListenOptions(
        security=Security(token=TOKEN), max_workers=2, small_call_reserve=1,
        handshake_timeout_seconds=0.5))
    listener.start()
    outcomes: list[object] = []

    def first_call() -> None:
        channel = GrpcTransport().connect(listener.address, Security(token=TOKEN))
        try:
            outcomes.append(bytes(channel.call(Frame(b"x", [b"8 bytes!"]), 30).buffers[0]))
        except errors.OpError as err:
            outcomes.append(err)
        finally:
            channel.close()

    callers = [threading.Thread(target=first_call) for _ in range(16)]
    try:
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(60)
    finally:
        listener.stop(0)
    assert outcomes == [b"8 bytes!"] * 16


def call_8_bytes(channel) -> bytes:
    return bytes(channel.call(Frame(b"x", [b"8 bytes!"]), timeout=10).buffers[0])


def test_a_token_holder_over_max_connections_is_refused_and_gets_in_when_one_closes():
    with listening(max_connections=1, handshake_timeout_seconds=60) as (listener, door):
        first = GrpcTransport().connect(listener.address, Security(token=TOKEN))
        second = GrpcTransport().connect(listener.address, Security(token=TOKEN))
        try:
            assert call_8_bytes(first) == b"8 bytes!"
            with pytest.raises(errors.ResourceExhaustedError, match=r"max_connections \(1\)"):
                call_8_bytes(second)
            assert len(door.admitted) == 1
            first.close()  # gRPC closes its end: the count frees at the next first call

            def second_gets_in() -> bool:
                try:
                    return call_8_bytes(second) == b"8 bytes!"
                except (errors.ResourceExhaustedError, errors.UnavailableError):
                    return False

            wait_for(second_gets_in, 20, "the second client admitted")
            assert len(door.admitted) == 1
        finally:
            first.close()
            second.close()


@contextlib.contextmanager
def door_and_connections(timeout: float, count: int = 1, max_connections: int = 1024,
                         sources: list[str] | None = None) -> Iterator:
    """A started door (no gRPC server) that has recorded ``count`` accepted loopback
    connections (the i-th from ``sources[i]``, default 127.0.0.1); yields (door, [(the
    client's socket, gRPC's peer string of the client, the accepted socket: gRPC's)])."""
    door = Door(ListenOptions(handshake_timeout_seconds=timeout,
                              max_connections=max_connections), "test")
    door.start()
    try:
        with socket.create_server(("127.0.0.1", 0)) as server, contextlib.ExitStack() as held:
            connections = []
            for i in range(count):
                source = sources[i] if sources else "127.0.0.1"
                client = held.enter_context(socket.create_connection(
                    server.getsockname(), source_address=(source, 0)))
                accepted = held.enter_context(server.accept()[0])
                door._accepted(accepted.fileno())
                connections.append(
                    (client, f"ipv4:{source}:{client.getsockname()[1]}", accepted))
            yield door, connections
    finally:
        door.close()


@contextlib.contextmanager
def door_and_connection(timeout: float) -> Iterator:
    """``door_and_connections`` with one: yields (door, the client's socket, its peer)."""
    with door_and_connections(timeout) as (door, [(client, peer, _)]):
        yield door, client, peer


class RefusedCall(Exception):
    pass


class EndedCall:
    """A ServicerContext's part that ``Door.admit`` uses, of a call that has ended."""

    def __init__(self, peer: str):
        self._peer = peer
        self.refusal: tuple[grpc.StatusCode, str] | None = None
        self.trailers: tuple[tuple[str, str], ...] = ()

    def peer(self) -> str:
        return self._peer

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailers = metadata

    def add_callback(self, callback) -> bool:
        return False

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.refusal = code, details
        raise RefusedCall


def test_authenticated_connections_are_counted_once_up_to_max_connections():
    with door_and_connections(60, count=3, max_connections=2) as (door, connections):
        peers = [peer for _, peer, _ in connections]
        assert door.authenticated(peers[0]) is None
        assert door.authenticated(peers[0]) is None  # its second call: counted once
        assert door.authenticated(peers[1]) is None
        assert door.admitted == set(peers[:2]) and not door.pending.keys() - {
            context_peer(peers[2])}
        call = EndedCall(peers[2])
        with pytest.raises(RefusedCall):
            door.admit(call)
        code, details = call.refusal
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(call.trailers) == {
            ERROR_CODE_KEY: str(errors.ResourceExhaustedError.error_code)}
        assert "max_connections (2)" in details and "raise max_connections" in details
        assert closed_by_server(connections[2][0])  # shut
        assert still_open(connections[0][0]) and still_open(connections[1][0])
        assert door.admitted == set(peers[:2])
        assert door.authenticated(peers[2]) is not None  # its other calls are refused too


def test_at_max_connections_a_peer_holding_the_most_gives_its_oldest_up():
    """Fair shares of max_connections: a new peer displaces (shuts) the oldest connection
    of the peer holding the most while that one holds more than one more; then it is
    refused, and so is the peer holding the most."""
    sources = ["127.0.0.2"] * 4 + ["127.0.0.1"] * 2
    with door_and_connections(60, count=6, max_connections=3, sources=sources) as (
            door, connections):
        peers = [peer for _, peer, _ in connections]
        for peer in peers[:3]:
            assert door.authenticated(peer) is None
        assert door.authenticated(peers[3]) is not None  # 127.0.0.2 over the limit
        assert door.authenticated(peers[4]) is None  # 127.0.0.1: 3 > 0 + 1
        assert closed_by_server(connections[0][0])  # 127.0.0.2's oldest
        assert door.admitted == {peers[1], peers[2], peers[4]}
        assert door.authenticated(peers[5]) is not None  # 2 is not > 1 + 1
        assert all(still_open(connections[i][0]) for i in (1, 2, 4))


def test_a_connection_grpc_closed_leaves_the_count_when_it_is_full():
    with door_and_connections(60, count=3, max_connections=2) as (door, connections):
        peers = [peer for _, peer, _ in connections]
        for peer in peers[:2]:
            assert door.authenticated(peer) is None
        connections[0][2].close()  # gRPC closed the first
        assert door.authenticated(peers[2]) is None
        assert door.admitted == set(peers[1:])


def test_a_connection_past_its_late_time_is_still_counted_at_its_first_token_call():
    """A token holder's first call that waited for a server thread past twice the
    handshake timeout still makes its connection count."""
    with door_and_connections(0.2, count=2, max_connections=1) as (door, connections):
        wait_for(lambda: not door.pending and len(door._dormant) == 2,
                 what="the connections to pass their late time")
        assert door.authenticated(connections[0][1]) is None
        assert door.admitted == {connections[0][1]}
        assert door.authenticated(connections[1][1]) is not None  # over max_connections


def closed_by_server(sock: socket.socket) -> bool:
    return not still_open(sock)


def test_a_connection_that_called_without_the_token_is_closed_at_its_deadline():
    with door_and_connection(0.3) as (door, client, peer):
        door.refused(peer)
        wait_for(lambda: closed_by_server(client), what="the connection closed")
        assert not door.pending


def test_a_silent_connection_is_left_open_at_its_deadline_but_closed_at_a_late_refusal():
    """Past its deadline a connection that made no call is gRPC's to close (a token
    holder's first call may still be waiting); a call without the token then closes it at
    once, so one timed just after the deadline gains nothing."""
    with door_and_connection(0.3) as (door, client, peer):
        wait_for(lambda: door._late, what="the deadline")
        assert still_open(client)
        door.refused(peer)
        wait_for(lambda: closed_by_server(client), what="the connection closed")
        assert not door.pending


def test_a_late_connection_that_shows_the_token_stays_open():
    with door_and_connection(0.3) as (door, client, peer):
        wait_for(lambda: door._late, what="the deadline")
        door.authenticated(peer)
        door.refused(peer)  # a mixed connection: once authenticated, never closed by it
        wait_for(lambda: not door.pending, what="the door to forget it")
        assert still_open(client)
