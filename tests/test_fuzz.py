"""Random and mutated input to every transport and to the cluster service.

The server must never crash, never leak threads, answer with a clusterwire
error where it answers at all, and keep serving well-formed clients.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterwire import Server, Session, errors
from clusterwire.protos.service_pb2 import Request, Response, Value
from clusterwire.transport import Frame
from clusterwire.transports.grpc import framing
from clusterwire.transports.local import wire as local_wire

FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
METHODS = ["status", "put", "get", "delete", "list", "call", "barrier", "complete_cluster",
           "nope", ""]


def values() -> st.SearchStrategy[Value]:
    leaves = st.one_of(
        st.builds(lambda: Value(none={})), st.booleans().map(lambda b: Value(bool_value=b)),
        st.integers(-(1 << 63), (1 << 63) - 1).map(lambda i: Value(int_value=i)),
        st.text(max_size=20).map(lambda t: Value(big_int_value=t)),
        st.integers(0, 5).map(lambda i: Value(bytes_buffer=i)),
        st.tuples(st.sampled_from(["<f4", "|u1", "<U3", "|O", "[('a', '<i4')]", "junk", ""]),
                  st.lists(st.integers(-2, 1 << 40), max_size=3), st.integers(0, 4))
        .map(lambda t: _tensor(*t)))
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=4).map(
        lambda items: Value(list_value={"items": items})), max_leaves=10)


def _tensor(dtype: str, shape: list[int], buffer: int) -> Value:
    value = Value()
    value.tensor.dtype, value.tensor.buffer = dtype, buffer
    value.tensor.shape.extend(shape)
    return value


requests = st.builds(
    lambda method, name, value, hops, timeout: Request(
        method=method, name=name, value=value, hops=hops, timeout_seconds=timeout),
    st.sampled_from(METHODS), st.text(max_size=30), values(), st.integers(0, 3),
    st.floats(0, 0.05))
buffers = st.lists(st.binary(max_size=64), max_size=5)


@pytest.fixture(scope="module", params=["grpc", "grpc+local", "grpc+verbs"])
def server(request):
    if request.param == "grpc+verbs":
        pytest.importorskip("ucxx")
    server = Server({"w": ["127.0.0.1:0"]}, protocol=request.param,
                    config={"max_message_bytes": 16 << 20, "peer_timeout_seconds": 0.2})
    yield server
    server.stop()


def served(server) -> None:
    with Session(server.target, timeout=10) as session:
        session.put("ok", np.arange(5))
        assert session.get("ok").tolist() == [0, 1, 2, 3, 4]


@FUZZ
@given(request=requests, payload=buffers)
def test_random_requests_get_error_responses_never_crashes(server, request, payload):
    from clusterwire.plugins import get_plugin_manager

    channel = get_plugin_manager().transport(server.server_def.protocol).connect(
        server.target.split("://")[1])
    try:
        response = Response.FromString(channel.call(
            Frame(request.SerializeToString(), payload), timeout=10).header)
        assert response.status.code in range(17)
    except errors.OpError:
        pass  # a transport-level refusal is a clusterwire error, which is fine
    finally:
        channel.close()


@FUZZ
@given(header=st.binary(max_size=200), payload=buffers)
def test_random_header_bytes(server, header, payload):
    from clusterwire.plugins import get_plugin_manager

    channel = get_plugin_manager().transport(server.server_def.protocol).connect(
        server.target.split("://")[1])
    try:
        response = Response.FromString(channel.call(Frame(header, payload), timeout=10).header)
        assert response.status.code in range(17)
    except errors.OpError:
        pass
    finally:
        channel.close()


def test_server_still_serves_and_leaks_no_threads_after_fuzzing(server):
    served(server)
    baseline = threading.active_count()
    for _ in range(50):
        served(server)
    assert threading.active_count() <= baseline + 2


@FUZZ
@given(message=st.binary(max_size=300), mutate=st.integers(0, 40))
def test_mutated_grpc_frames(message, mutate):
    server = _GRPC[0]
    valid = framing.encode_inline(Request(method="list").SerializeToString(),
                                  framing.buffer_views([b"x" * 8]))
    data = bytearray(valid)
    if mutate < len(data):
        data[mutate] ^= 0xFF
    channel = grpc.insecure_channel(server.target.split("://")[1])
    try:
        for payload in (bytes(data), message):
            try:
                channel.unary_unary("/clusterwire.Transport/Call")(payload, timeout=5)
            except grpc.RpcError as err:
                assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                      grpc.StatusCode.RESOURCE_EXHAUSTED)
        try:
            upload = channel.stream_unary("/clusterwire.Transport/Upload")
            upload(iter([bytes(data), message]), timeout=5)
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED)
    finally:
        channel.close()


_GRPC: list[Server] = []


@pytest.fixture(scope="module", autouse=True)
def grpc_server():
    server = Server({"w": ["127.0.0.1:0"]}, config={"max_message_bytes": 16 << 20})
    _GRPC.append(server)
    yield
    _GRPC.clear()
    served(server)
    server.stop()


@FUZZ
@given(messages=st.lists(st.binary(max_size=100), min_size=1, max_size=4))
def test_random_unix_socket_messages_to_grpc_local(messages):
    with Server({"w": ["127.0.0.1:0"]}, protocol="grpc+local") as server:
        address = server.target.split("://")[1]
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(f"\0clusterwire-local:{address}")
            for message in messages:
                try:
                    sock.send(message)
                    if message[:1] == b"C":
                        r, w = os.pipe()
                        socket.send_fds(sock, [local_wire.encode_unix(
                            local_wire.SEGMENTS, 1, 2)], [r, w])
                        os.close(r)
                        os.close(w)
                except OSError:
                    break  # the server closed the connection: that is the expected answer
        served(server)


@settings(FUZZ, max_examples=20)  # each address that kills the checker costs its restart
@given(address=st.binary(max_size=120))
def test_random_ucx_addresses_in_hello(address):
    pytest.importorskip("ucxx")
    server = _verbs_server()
    channel = grpc.insecure_channel(server.target.split("://")[1])
    try:
        channel.unary_unary("/clusterwire.Verbs/Hello")(address, timeout=60)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    finally:
        channel.close()


_VERBS: list[Server] = []


def _verbs_server() -> Server:
    if not _VERBS:
        _VERBS.append(Server({"w": ["127.0.0.1:0"]}, protocol="grpc+verbs"))
    return _VERBS[0]


def teardown_module() -> None:
    for server in _VERBS:
        served(server)
        server.stop()


def test_verbs_control_decoder_on_random_bytes():
    from clusterwire.transports.verbs import wire

    rng = np.random.default_rng(0)
    for size in range(0, 200):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        for candidate in (data, b"CWV1" + data, struct.pack("<4sIIIQ", b"CWV1", 0, 3, 1, 0) + data):
            with contextlib.suppress(errors.OpError):
                wire.decode(candidate, 1 << 20)
