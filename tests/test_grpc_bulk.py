"""The grpc transport's TCP bulk plane: large responses leave gRPC, safely."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import NamedTuple

import grpc
import numpy as np
import pytest

from clusterwire import errors
from clusterwire.envelope import BULK, INLINE
from clusterwire.security import Security, TlsConfig
from clusterwire.testing.peer import echo_handler
from clusterwire.transport import Frame, ListenOptions
from clusterwire.transports.grpc import bulk, framing
from clusterwire.transports.grpc.transport import GrpcTransport

_MiB = 1 << 20
_STATUS = struct.Struct("<4sBQ")


@pytest.fixture
def listener():
    listener = GrpcTransport().listen("127.0.0.1:0", echo_handler, ListenOptions())
    listener.start()
    yield listener
    listener.stop(0)


@pytest.fixture
def channel(listener):
    channel = GrpcTransport().connect(listener.address)
    yield channel
    channel.close()


class Announced(NamedTuple):
    bulk_port: int
    fetch_id: int


def announce(listener, payload: np.ndarray) -> Announced:
    """A raw gRPC call whose reply announces ``payload`` (bulk port and fetch id)."""
    with grpc.insecure_channel(listener.address) as raw:
        call = raw.unary_unary("/clusterwire.Transport/Call")
        reply = call(framing.encode_inline(b"raw", framing.buffer_views([payload])), timeout=10)
    envelope = framing.LAYOUT.decode(reply, 1 << 40)
    assert envelope.kinds == (BULK,)
    return Announced(*envelope.fields)


def fetch_raw(port: int, fetch_id: int) -> tuple[int, bytes]:
    """Status and bytes of one fetch on a fresh bulk connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(struct.pack("<Q", fetch_id))
        with sock.makefile("rb") as reader:
            magic, code, total = _STATUS.unpack(reader.read(_STATUS.size))
            assert magic == b"CWB1"
            return code, reader.read(total)


def test_large_responses_use_the_bulk_port(listener, channel):
    payload = np.random.default_rng(1).integers(0, 255, 3 * _MiB, np.uint8)
    small = np.arange(1000, dtype=np.uint8)
    reply = channel.call(Frame(b"big", [payload, small, payload[:10]]), timeout=30)
    assert listener.bulk_port
    assert [bytes(b) for b in reply.buffers] == [payload.tobytes(), small.tobytes(),
                                                 payload[:10].tobytes()]
    assert all(not memoryview(b).readonly for b in reply.buffers)
    prefix = announce(listener, payload)
    assert prefix.bulk_port == listener.bulk_port


def test_fetch_id_is_single_use(listener):
    payload = np.full(2 * _MiB, 9, np.uint8)
    prefix = announce(listener, payload)
    code, data = fetch_raw(prefix.bulk_port, prefix.fetch_id)
    assert code == 0 and data == payload.tobytes()
    assert fetch_raw(prefix.bulk_port, prefix.fetch_id) == (1, b"")


def test_garbage_on_the_bulk_port_does_not_take_the_listener_down(listener, channel):
    port = listener.bulk_port
    assert fetch_raw(port, int.from_bytes(os.urandom(8), "little")) == (1, b"")
    for garbage in (b"", b"\x01\x02\x03", b"GET / HTTP/1.1\r\n\r\n" * 100):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(garbage)
    payload = np.full(2 * _MiB, 3, np.uint8)
    reply = channel.call(Frame(b"after", [payload]), timeout=30)
    assert bytes(reply.buffers[0]) == payload.tobytes()


def test_unreachable_bulk_port_falls_back_to_grpc(listener, channel):
    listener._bulk.stop(0)  # the gRPC port still serves; the bulk port is gone
    payload = np.full(2 * _MiB, 5, np.uint8)
    for _ in range(2):
        reply = channel.call(Frame(b"fallback", [payload]), timeout=30)
        assert bytes(reply.buffers[0]) == payload.tobytes()


def test_idle_connection_closed_by_the_server_is_replaced(monkeypatch, listener, channel):
    monkeypatch.setattr(bulk, "IDLE_SECONDS", 0.2)
    payload = np.full(2 * _MiB, 1, np.uint8)
    channel.call(Frame(b"first", [payload]), timeout=30)
    deadline = time.monotonic() + 10
    while listener._bulk._connections and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the server's state: its idle timeout closes the connection
    assert not listener._bulk._connections
    reply = channel.call(Frame(b"second", [payload]), timeout=30)
    assert bytes(reply.buffers[0]) == payload.tobytes()


def test_stop_closes_the_bulk_port(listener):
    port = listener.bulk_port
    listener.stop(0)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_no_bulk_port_with_tls_or_when_disabled(tmp_path):
    pytest.importorskip("cryptography")
    from clusterwire.testing.certs import Authority

    authority = Authority(tmp_path)
    pair = authority.issue("server")
    tls = Security(tls=TlsConfig(certificate_chain=pair.cert.read_bytes(),
                                 private_key=pair.key.read_bytes()))
    for transport, options in ((GrpcTransport(), ListenOptions(security=tls)),
                               (GrpcTransport({"bulk_plane": "grpc"}), ListenOptions())):
        listener = transport.listen("127.0.0.1:0", echo_handler, options)
        try:
            assert listener.bulk_port is None
        finally:
            listener.stop(0)


def test_bad_bulk_plane_option():
    with pytest.raises(errors.InvalidArgumentError, match="bulk_plane"):
        GrpcTransport({"bulk_plane": "udp"})


def test_call_without_timeout_and_expired_deadline(listener, channel):
    payload = np.full(2 * _MiB, 4, np.uint8)
    assert bytes(channel.call(Frame(b"no timeout", [payload])).buffers[0]) == payload.tobytes()
    with pytest.raises(errors.DeadlineExceededError):
        bulk.BulkClient(listener.address).fetch(listener.bulk_port, 1, [8], time.monotonic() - 1)


def test_responses_over_bulk_bytes_take_the_bulk_port(listener):
    with grpc.insecure_channel(listener.address) as raw:
        call = raw.unary_unary("/clusterwire.Transport/Call")
        for size, kind in ((200 << 10, INLINE), (300 << 10, BULK)):
            payload = framing.buffer_views([np.zeros(size, np.uint8)])
            reply = call(framing.encode_inline(b"raw", payload), timeout=10)
            assert framing.LAYOUT.decode(reply, 1 << 40).kinds == (kind,), size


def test_a_wildcard_ipv6_listener_serves_ipv4_clients_over_the_bulk_port():
    if not socket.has_dualstack_ipv6():
        pytest.skip("no dual-stack IPv6 here")
    listener = GrpcTransport().listen("[::]:0", echo_handler, ListenOptions())
    listener.start()
    channel = GrpcTransport().connect(f"127.0.0.1:{listener.address.rsplit(':', 1)[1]}")
    try:
        payload = np.full(2 * _MiB, 6, np.uint8)
        assert bytes(channel.call(Frame(b"v4", [payload]), timeout=30).buffers[0]) == \
            payload.tobytes()
        assert channel._bulk_after == 0  # reached the bulk port, no fallback to gRPC
    finally:
        channel.close()
        listener.stop(0)


def test_a_bulk_port_at_its_connection_limit_sends_the_response_over_grpc():
    listener = GrpcTransport().listen("127.0.0.1:0", echo_handler,
                                      ListenOptions(max_connections=2))
    listener.start()
    hogs = []
    channel = GrpcTransport().connect(listener.address)
    try:
        payload = np.full(2 * _MiB, 8, np.uint8)
        for _ in range(2):  # connections holding the limit: admitted with a fetch, then idle
            hogs.append(socket.create_connection(("127.0.0.1", listener.bulk_port), timeout=5))
            hogs[-1].sendall(struct.pack("<Q", announce(listener, payload).fetch_id))
            with hogs[-1].makefile("rb") as reader:
                assert len(reader.read(_STATUS.size + payload.nbytes)) == \
                    _STATUS.size + payload.nbytes
        assert len(listener._bulk._connections) == 2
        reply = channel.call(Frame(b"busy", [payload]), timeout=30)
        assert bytes(reply.buffers[0]) == payload.tobytes()
        assert channel._bulk_after == 0  # busy, not unreachable: tried again next time
        for hog in hogs:
            hog.close()
        deadline = time.monotonic() + 10
        while listener._bulk._connections and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the server's state until it has seen the hogs leave
        reply = channel.call(Frame(b"free", [payload]), timeout=30)
        assert bytes(reply.buffers[0]) == payload.tobytes()
        assert listener._bulk._connections  # this time over the bulk port
    finally:
        for hog in hogs:
            hog.close()
        channel.close()
        listener.stop(0)


def test_a_bulk_port_at_its_connection_limit_displaces_the_peer_holding_the_most():
    """Two idle bulk connections of 127.0.0.2 hold max_connections (2): a 127.0.0.1 client's
    fetch closes the older of them and is served over the bulk port."""
    listener = GrpcTransport().listen("127.0.0.1:0", echo_handler,
                                      ListenOptions(max_connections=2))
    listener.start()
    hogs = []
    channel = GrpcTransport().connect(listener.address)
    try:
        payload = np.full(2 * _MiB, 8, np.uint8)
        for _ in range(2):
            hogs.append(socket.create_connection(("127.0.0.1", listener.bulk_port), timeout=5,
                                                 source_address=("127.0.0.2", 0)))
            hogs[-1].sendall(struct.pack("<Q", announce(listener, payload).fetch_id))
            with hogs[-1].makefile("rb") as reader:
                assert len(reader.read(_STATUS.size + payload.nbytes)) == \
                    _STATUS.size + payload.nbytes
        bulk_server = listener._bulk
        assert [bulk_server._connections.peer(c) for c in bulk_server._connections] == \
            ["127.0.0.2"] * 2
        reply = channel.call(Frame(b"mine", [payload]), timeout=30)
        assert bytes(reply.buffers[0]) == payload.tobytes()
        assert hogs[0].recv(1) == b""  # closed by the server (the timeout would raise)
        assert sorted(bulk_server._connections.peer(c) for c in bulk_server._connections) \
            == ["127.0.0.1", "127.0.0.2"]  # this client's, kept for its next fetch
    finally:
        for hog in hogs:
            hog.close()
        channel.close()
        listener.stop(0)


def test_a_port_answering_as_another_service_is_unreachable():
    with socket.create_server(("127.0.0.1", 0)) as impostor:
        def answer():
            connection, _ = impostor.accept()
            with connection:
                connection.recv(8)
                connection.sendall(b"HTTP/1.1 400\r\n\r\n")
        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        client = bulk.BulkClient(f"127.0.0.1:{impostor.getsockname()[1]}")
        try:
            with pytest.raises(bulk.Unreachable) as info:
                client.fetch(impostor.getsockname()[1], 1, [8], time.monotonic() + 10)
            assert info.value.lasting
        finally:
            client.close()
        thread.join(10)
