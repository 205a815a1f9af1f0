"""A client's channels are capped (``RequestClient(max_channels=)``): past the cap the least
recently used one is closed, once no call uses it, and opened again on demand."""

from __future__ import annotations

import threading

import pytest

import clusterwire
from clusterwire import errors
from clusterwire.protos.service_pb2 import Request
from clusterwire.rpc import RequestClient
from clusterwire.transport import Frame


class FakeChannel:
    def __init__(self, address: str, gate: threading.Event | None):
        self.address, self.gate, self.closed = address, gate, False
        self.entered = threading.Event()

    def call(self, frame: Frame, timeout: float | None = None) -> Frame:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.closed:
            raise errors.CancelledError("closed during the call")
        return Frame(b"", [])

    def close(self) -> None:
        self.closed = True


class FakeTransport:
    def __init__(self, gates: dict[str, threading.Event]):
        self.gates, self.opened = gates, []

    def connect(self, address, security):
        channel = FakeChannel(address, self.gates.get(address))
        self.opened.append(channel)
        return channel


def client_over(transport: FakeTransport, max_channels: int) -> RequestClient:
    client = RequestClient("grpc", in_process=False, max_channels=max_channels)
    client._transport = transport
    return client


def send(client: RequestClient, address: str) -> Frame:
    return client.send_frame(address, Frame(b"x", []), "status", timeout=10)


def test_the_least_recently_used_channel_is_closed_and_reopened_on_demand():
    transport = FakeTransport({})
    client = client_over(transport, 2)
    for address in ("a:1", "b:1", "a:1", "c:1"):  # b is the least recently used at c
        send(client, address)
    assert list(client._channels) == ["a:1", "c:1"]
    assert [(c.address, c.closed) for c in transport.opened] == [
        ("a:1", False), ("b:1", True), ("c:1", False)]
    send(client, "b:1")  # opened again, closing a
    assert list(client._channels) == ["c:1", "b:1"]
    assert transport.opened[0].closed and not transport.opened[-1].closed
    client.close()
    assert all(channel.closed for channel in transport.opened)


def test_a_channel_in_use_is_closed_only_when_its_call_ends():
    gate = threading.Event()
    transport = FakeTransport({"slow:1": gate})
    client = client_over(transport, 1)
    answers: list = []
    caller = threading.Thread(target=lambda: answers.append(send(client, "slow:1")))
    caller.start()
    try:
        assert transport.opened[0].entered.wait(30)
        send(client, "other:1")  # evicts slow's channel while its call runs
        assert list(client._channels) == ["other:1"]
        assert not transport.opened[0].closed
    finally:
        gate.set()
        caller.join(30)
    assert len(answers) == 1  # answered, not cancelled
    assert transport.opened[0].closed  # and closed once its call ended
    client.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_a_bad_cap_is_refused(bad):
    with pytest.raises(errors.InvalidArgumentError, match="max_channels"):
        RequestClient("grpc", max_channels=bad)


def test_real_tasks_are_reached_again_after_their_channel_was_closed():
    servers = [clusterwire.Server({"worker": ["127.0.0.1:0"]}, job_name="worker",
                                  task_index=0) for _ in range(3)]
    client = RequestClient("grpc", timeout=10, in_process=False, max_channels=2)
    try:
        addresses = [server.target.split("://")[1] for server in servers]
        for _ in range(2):
            for address in addresses:
                response, _ = client.send(address, Request(method="status"))
                assert response.status.code == 0
                assert len(client._channels) <= 2
    finally:
        client.close()
        for server in servers:
            server.stop()
