"""Cut-through forwarding over the grpc transport: a forwarded response passes through."""

from __future__ import annotations

import numpy as np
import pytest

from clusterwire import Server, Session
from clusterwire.errors import UnavailableError
from clusterwire.local_cluster import LocalCluster
from clusterwire.transport import Frame, ListenOptions
from clusterwire.transports.grpc import bulk, relay
from clusterwire.transports.grpc.transport import GrpcTransport

_MiB = 1 << 20
PAYLOAD = (np.arange(24 * _MiB) % 251).astype(np.uint8)


class Counting:
    """Wraps a function and counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch):
    """How often a response was spliced through, and fetched whole, in this process."""
    spliced, fetched = Counting(relay.splice), Counting(bulk.BulkClient.fetch)
    monkeypatch.setattr(bulk, "splice", spliced)
    monkeypatch.setattr(bulk.BulkClient, "fetch", lambda self, *a, **k: fetched(self, *a, **k))
    return spliced, fetched


def _owner(transport: GrpcTransport):
    """A listener answering every request with PAYLOAD."""
    listener = transport.listen("127.0.0.1:0", lambda _frame: Frame(b"owner", [PAYLOAD]),
                                ListenOptions())
    listener.start()
    return listener


def _forwarder(transport: GrpcTransport, owner_address: str, after=lambda: None):
    """A listener passing each request to the owner and its response back, relayed."""
    upstream = transport.connect(owner_address)

    def forward(frame: Frame) -> Frame:
        reply = upstream.call_relayed(frame, 10)
        after()
        return reply

    listener = transport.listen("127.0.0.1:0", forward, ListenOptions())
    listener.start()
    return listener, upstream


@pytest.mark.parametrize("plane", ["tcp", "grpc"])
def test_a_relayed_response_arrives_whole_and_is_never_stored(plane, counted):
    spliced, fetched = counted
    transport = GrpcTransport({"bulk_plane": plane})
    owner = _owner(transport)
    forwarder, upstream = _forwarder(transport, owner.address)
    client = GrpcTransport({"bulk_plane": plane}).connect(forwarder.address)
    try:
        for _ in range(2):  # the second reuses the bulk connections
            reply = client.call(Frame(b"ask"), timeout=30)
            assert reply.header == b"owner"
            assert np.array_equal(np.frombuffer(reply.buffers[0], np.uint8), PAYLOAD)
        # The client fetched it whole; the forwarder passed it on without fetching it.
        if plane == "tcp":
            assert spliced.calls == 2 and fetched.calls == 2
        else:
            assert spliced.calls == 0 and fetched.calls == 0
    finally:
        client.close()
        upstream.close()
        forwarder.stop(0)
        owner.stop(0)


def test_an_owner_gone_before_the_fetch_is_unavailable_at_the_client():
    transport = GrpcTransport()
    owner = _owner(transport)
    forwarder, upstream = _forwarder(transport, owner.address, after=lambda: owner.stop(0))
    client = transport.connect(forwarder.address)
    try:
        with pytest.raises(UnavailableError, match="forwarded this response"):
            client.call(Frame(b"ask"), timeout=30)
    finally:
        client.close()
        upstream.close()
        forwarder.stop(0)


def test_a_small_forwarded_response_is_sent_inline():
    transport = GrpcTransport()
    owner = transport.listen("127.0.0.1:0", lambda frame: Frame(b"small", [b"12345678"]),
                             ListenOptions())
    owner.start()
    forwarder, upstream = _forwarder(transport, owner.address)
    client = transport.connect(forwarder.address)
    try:
        reply = client.call(Frame(b"ask"), timeout=30)
        assert reply.header == b"small" and bytes(reply.buffers[0]) == b"12345678"
    finally:
        client.close()
        upstream.close()
        forwarder.stop(0)
        owner.stop(0)


def test_a_task_forwards_a_large_get_cut_through(counted):
    spliced, _ = counted
    with LocalCluster({"ps": 1}) as cluster:
        ps = cluster.target("ps", 0).split("://")[1]
        with Session(cluster.target("ps", 0)) as direct:
            direct.put("weights", PAYLOAD)
        with Server({"ps": [ps], "worker": ["127.0.0.1:0"]}, job_name="worker",
                    task_index=0) as worker:
            # A client on the wire (not this process's shortcut) reads through the worker.
            with Session(worker.target, in_process=False) as session:
                got = session.get("weights", task="/job:ps/task:0")
            assert np.array_equal(got, PAYLOAD)
            assert spliced.calls == 1
