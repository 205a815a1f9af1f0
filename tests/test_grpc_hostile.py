"""A rogue peer sending garbage to the grpc transport must not take the server down."""

from __future__ import annotations

import socket

import grpc
import numpy as np
import pytest

from clusterwire import Server, Session
from clusterwire.errors import InvalidArgumentError, ResourceExhaustedError, UnimplementedError
from clusterwire.protos.service_pb2 import Request
from clusterwire.transport import Frame
from clusterwire.transports.grpc import framing
from clusterwire.transports.grpc.transport import GrpcTransport


@pytest.fixture
def server():
    server = Server({"w": ["127.0.0.1:0"]}, config={"max_message_bytes": 64 << 20})
    yield server
    server.stop()


@pytest.fixture
def raw(server):
    channel = grpc.insecure_channel(server.target.removeprefix("grpc://"))
    yield channel
    channel.close()


def still_serving(server) -> None:
    with Session(server.target, timeout=10) as session:
        session.put("ok", np.arange(3))
        assert session.get("ok").tolist() == [0, 1, 2]


def rpc_code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_tcp_garbage_then_close(server):
    port = int(server.target.rsplit(":", 1)[1])
    for payload in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 40):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(payload)
    still_serving(server)


@pytest.mark.parametrize("message", [b"", b"xx", b"NOPE" + b"\x00" * 40,
                                     framing.LAYOUT.encode_table((0, 0), b"", [3])])
def test_malformed_unary_frames_are_invalid_argument(server, raw, message):
    call = raw.unary_unary("/clusterwire.Transport/Call")
    assert rpc_code(lambda: call(message, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    still_serving(server)


def test_garbage_header_gets_an_invalid_argument_response(server):
    channel = GrpcTransport().connect(server.target.removeprefix("grpc://"))
    try:
        from clusterwire.rpc import parse_response, raise_for_status

        response = parse_response(channel.call(Frame(b"\xff\xff\xff garbage", []), timeout=5))
        with pytest.raises(InvalidArgumentError, match="Malformed request header"):
            raise_for_status(response)
        bad_value = Request(method="put", name="x")
        bad_value.value.tensor.dtype = "<f8"
        bad_value.value.tensor.shape.append(1000)
        response = parse_response(channel.call(Frame(bad_value.SerializeToString(),
                                                     [b"short"]), timeout=5))
        with pytest.raises(InvalidArgumentError, match="needs 8000 bytes"):
            raise_for_status(response)
        response = parse_response(channel.call(
            Frame(Request(method="explode").SerializeToString(), []), timeout=5))
        with pytest.raises(UnimplementedError, match="Unknown method 'explode'"):
            raise_for_status(response)
    finally:
        channel.close()
    with Session(server.target) as session:
        assert "x" not in session.list()  # nothing stored by the rejected put
    still_serving(server)


@pytest.mark.parametrize("field, value", [("value", {"not": "a list"}), ("kwargs", [1, 2]),
                                          ("kwargs", {3: "a non-str key"})])
def test_malformed_call_arguments_are_invalid_argument(server, field, value):
    from clusterwire import codec, remote
    from clusterwire.rpc import parse_response, raise_for_status

    @remote(name="hostile.identity")
    def identity(*args, **kwargs):
        return args, kwargs

    request = Request(method="call", name="hostile.identity")
    buffers = codec.encode_into(getattr(request, field), value)
    channel = GrpcTransport().connect(server.target.removeprefix("grpc://"))
    try:
        response = parse_response(channel.call(Frame(request.SerializeToString(), buffers),
                                               timeout=5))
        with pytest.raises(InvalidArgumentError, match="positional arguments as a list"):
            raise_for_status(response)
    finally:
        channel.close()
    with Session(server.target) as session:
        assert session.call(identity, 1, key="k") == ((1,), {"key": "k"})


def test_upload_claiming_100_gb_is_refused_without_allocating(server, raw):
    upload = raw.stream_unary("/clusterwire.Transport/Upload")
    claim = framing.encode_bulk(Request(method="put", name="x").SerializeToString(),
                                [100 << 30])
    code = rpc_code(lambda: upload(iter([claim, b"x" * 100]), timeout=5))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    still_serving(server)


def test_truncated_and_overrunning_uploads_are_refused(server, raw):
    upload = raw.stream_unary("/clusterwire.Transport/Upload")
    header = Request(method="put", name="x").SerializeToString()
    prefix = framing.encode_bulk(header, [10 << 20])
    assert rpc_code(lambda: upload(iter([prefix, b"x" * 1000]), timeout=5)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert rpc_code(lambda: upload(iter([framing.encode_bulk(header, [4]), b"x" * 8]),
                                   timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc_code(lambda: upload(iter([]), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    with Session(server.target) as session:
        assert "x" not in session.list()
    still_serving(server)


def test_fetch_of_unknown_id_is_not_found(server, raw):
    fetch = raw.unary_stream("/clusterwire.Transport/Fetch")
    assert rpc_code(lambda: list(fetch((12345).to_bytes(8, "little"), timeout=5))) == \
        grpc.StatusCode.NOT_FOUND
    assert rpc_code(lambda: list(fetch(b"abc", timeout=5))) == grpc.StatusCode.NOT_FOUND
    still_serving(server)


def test_message_over_the_limit_is_resource_exhausted(server):
    with Session(server.target) as session:
        with pytest.raises(ResourceExhaustedError, match="exceeds the limit"):
            session.put("huge", np.zeros(65 << 20, np.uint8))
        assert "huge" not in session.list()
    still_serving(server)


def test_unknown_grpc_method_is_unimplemented(server, raw):
    call = raw.unary_unary("/clusterwire.Transport/Nope")
    assert rpc_code(lambda: call(b"", timeout=5)) == grpc.StatusCode.UNIMPLEMENTED
    still_serving(server)
