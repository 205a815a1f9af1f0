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
        # Malformed input is the client's fault: never INTERNAL (a server bug).
        assert response.status.code in set(range(17)) - {errors.INTERNAL}, response.status
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
        # Malformed input is the client's fault: never INTERNAL (a server bug).
        assert response.status.code in set(range(17)) - {errors.INTERNAL}, response.status
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
        prefix = struct.pack("<4sI8sII", b"CWV1", 0, bytes(8), 3, 1)
        for candidate in (data, b"CWV1" + data, prefix + data):
            with contextlib.suppress(errors.OpError):
                wire.decode(candidate, 1 << 20)


@pytest.fixture(scope="module")
def data_service():
    from clusterwire import data

    dispatcher = data.DispatchServer(port=0)
    worker = data.WorkerServer(port=0, dispatcher_address=dispatcher.target.split("://")[1])
    yield dispatcher, worker
    worker.stop()
    dispatcher.stop()


def _data_requests() -> list[bytes]:
    """Well-formed data-service requests of every kind, serialized (to be mutated)."""
    from clusterwire import data
    from clusterwire.data import graph
    from clusterwire.protos import data_service_pb2 as pb

    definition, _ = graph.to_def(data.Dataset.range(4).batch(2).pipeline)
    spec = pb.StreamSpec(job_id=5, dataset_id="x", is_split=True, unit_end=4, grant=b"g" * 32)
    requests = [
        pb.DataRequest(register_dataset=pb.RegisterDatasetRequest(dataset=definition)),
        pb.DataRequest(get_dataset=pb.GetDatasetRequest(dataset_id="x")),
        pb.DataRequest(get_or_create_job=pb.GetOrCreateJobRequest(dataset_id="x", job_key="k")),
        pb.DataRequest(client_heartbeat=pb.ClientHeartbeatRequest(job_id=5, consumer_id="c")),
        pb.DataRequest(get_split=pb.GetSplitRequest(job_id=5, consumer_id="c", done=[1, 2])),
        pb.DataRequest(worker_heartbeat=pb.WorkerHeartbeatRequest(
            worker=pb.WorkerInfo(address="localhost:1", protocol="grpc"))),
        pb.DataRequest(get_elements=pb.GetElementsRequest(stream=spec, consumer_id="c")),
    ]
    return [r.SerializeToString() for r in requests]


mutated_data_requests = st.tuples(
    st.sampled_from(_data_requests()),
    st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
).map(lambda t: bytes(_mutate(bytearray(t[0]), t[1])))


def _mutate(data: bytearray, edits: list[tuple[int, int]]) -> bytearray:
    for position, byte in edits:
        if data:
            data[position % len(data)] = byte
    return data


@FUZZ
@given(header=st.one_of(st.binary(max_size=300), mutated_data_requests), payload=buffers,
       to_worker=st.booleans())
def test_random_data_service_requests_are_never_internal(data_service, header, payload,
                                                         to_worker):
    from clusterwire.data.rpc import parse
    from clusterwire.plugins import get_plugin_manager
    from clusterwire.protos.data_service_pb2 import DataResponse

    dispatcher, worker = data_service
    address = worker.address if to_worker else dispatcher.target.split("://")[1]
    channel = get_plugin_manager().transport("grpc").connect(address)
    try:
        reply = channel.call(Frame(header, payload), timeout=10)
        status = DataResponse.FromString(reply.header).status
        assert status.code != errors.INTERNAL, status
        if status.code == errors.OK:
            parse(reply)
    except errors.OpError as err:
        assert not isinstance(err, errors.InternalError), err
    finally:
        channel.close()
