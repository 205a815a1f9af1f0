"""The standard gRPC health service on every gRPC-based listener: SERVING while the server
takes work, NOT_SERVING from the moment it drains (before its port closes), answered without
the cluster token (a Kubernetes probe carries none)."""

from __future__ import annotations

import threading

import grpc
import pytest
from conftest import wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clusterwire import errors
from clusterwire.plugins import get_plugin_manager
from clusterwire.security import Security
from clusterwire.shell import Shell, listen_options
from clusterwire.testing.peer import echo_handler
from clusterwire.transport import Frame

pytestmark = pytest.mark.timeout(60)

GRPC_BASED = [p for p in ("grpc", "grpc+local", "grpc+verbs")
              if p in get_plugin_manager().protocols()]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def probe(address: str) -> int:
    """What a probe without credentials hears (grpc_health_probe's call)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


@pytest.mark.parametrize("protocol", GRPC_BASED)
def test_a_draining_server_reports_not_serving_before_its_port_closes(protocol):
    entered, release = threading.Event(), threading.Event()

    def handler(request: Frame) -> Frame:
        entered.set()
        release.wait(30)
        return echo_handler(request)

    token = Security(token=b"cluster-secret")
    shell = Shell(protocol, "127.0.0.1:0", handler, "health test",
                  listen_options(security=token))
    shell.start()
    assert probe(shell.address) == SERVING  # no token needed for health
    channel = shell.transport.connect(shell.address, token)
    outcome: list[object] = []
    caller = threading.Thread(target=lambda: outcome.append(channel.call(Frame(b"x", []), 30)))
    caller.start()
    stopper = threading.Thread(target=shell.stop, kwargs={"grace": 30})
    try:
        assert entered.wait(10)
        stopper.start()  # drains: the call in flight holds the port open
        wait_for(lambda: probe(shell.address) == NOT_SERVING, what="NOT_SERVING")
        assert stopper.is_alive()  # still draining, port open, and saying so
    finally:
        release.set()
        stopper.join(30)
        caller.join(30)
        channel.close()
    assert outcome and isinstance(outcome[0], Frame)  # the call in flight was answered
    with pytest.raises(grpc.RpcError) as refused:
        probe(shell.address)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # port closed


@pytest.mark.parametrize("protocol", GRPC_BASED)
def test_the_cluster_service_still_needs_the_token(protocol):
    shell = Shell(protocol, "127.0.0.1:0", echo_handler, "health test",
                  listen_options(security=Security(token=b"cluster-secret")))
    shell.start()
    channel = shell.transport.connect(shell.address, Security())
    try:
        assert probe(shell.address) == SERVING
        with pytest.raises(errors.UnauthenticatedError):
            channel.call(Frame(b"x", []), 10)
    finally:
        channel.close()
        shell.stop(1)
