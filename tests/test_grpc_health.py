"""The standard gRPC health service on every gRPC-based listener: SERVING while the server
takes work, NOT_SERVING from the moment it drains (before its port closes), answered without
the cluster token (a Kubernetes probe carries none)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from conftest import wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clusterwire import errors
from clusterwire.local_cluster import LocalCluster
from clusterwire.plugins import get_plugin_manager
from clusterwire.security import Security
from clusterwire.shell import Shell, listen_options
from clusterwire.testing.peer import echo_handler
from clusterwire.transport import Frame
from clusterwire.transports._grpc_common.client import TOKEN_METADATA
from clusterwire.transports.grpc.transport import _message_limit

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


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.fixture
def token_task(tmp_path):
    """A task process with a cluster token (and ``tmp_path/limits`` as extra config)."""
    token_file = tmp_path / "token"
    token_file.write_bytes(b"t" * 32)

    def start(**limits):
        config = {"auth_token_file": str(token_file), **limits}
        return LocalCluster({"w": 1}, config=config), config

    return start


def watch(address: str, name: str, metadata=None, timeout: float | None = 30):
    """A Watch on a channel of its own (its own connection)."""
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1),
                                                      ("grpc.max_send_message_length", -1)])
    call = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=name), timeout=timeout, metadata=metadata)
    return channel, call


def ending(call) -> grpc.StatusCode:
    """How a Watch ended (its answers read until then)."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.timeout(120)
def test_only_served_names_are_answered_and_nothing_is_kept_for_others(token_task):
    cluster, _ = token_task()
    with cluster:
        pid, address = cluster.process("w").pid, cluster.target("w").split("://")[1]
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for served in ("", "clusterwire.Transport"):
                assert stub.Check(health_pb2.HealthCheckRequest(service=served),
                                  timeout=5).status == SERVING
            with pytest.raises(grpc.RpcError) as unknown:
                stub.Check(health_pb2.HealthCheckRequest(service="invented"), timeout=5)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        _, invented = watch(address, "invented")
        assert ending(invented) == grpc.StatusCode.NOT_FOUND  # at once, not kept open
        before, grown = rss_mib(pid), 0.0
        for _ in range(2):  # the attack of the issue (20 Watches on 16 MiB names), twice
            calls = [watch(address, "x" * (16 << 20) + str(i)) for i in range(20)]
            try:
                assert {ending(call) for _, call in calls} == {grpc.StatusCode.NOT_FOUND}
            finally:
                for channel, _ in calls:
                    channel.close()
            grown = max(grown, rss_mib(pid) - before)
        # Measured: about +160 MiB after the first round (gRPC's receive buffers, kept by
        # the allocator), no more after the second; it was +390 MiB a round, kept.
        assert grown < 250, f"the task grew by {grown:.0f} MiB"
        print(f"\n2 x 20 Watches on 16 MiB names: NOT_FOUND, RSS +{grown:.0f} MiB")


@pytest.mark.timeout(180)
def test_a_health_name_is_bounded_by_the_listeners_max_message_only(token_task):
    """grpcio has no smaller receive limit for one service's methods (a server ignores a
    service config's maxRequestMessageBytes; gRPC core's server-side size check reads the
    channel's arguments only), so a health request may be as large as the listener's
    largest message, and is received whole before it is refused. What bounds it: the
    health service's two reading threads, and gRPC refusing a longer one at its length
    prefix."""
    limit = _message_limit(1 << 20, 1 << 20)  # the grpc listener's, with default options
    cluster, _ = token_task()
    with cluster:
        pid, address = cluster.process("w").pid, cluster.target("w").split("://")[1]
        before = rss_mib(pid)
        calls = [watch(address, "x" * (limit - 64) + str(i)) for i in range(12)]
        try:
            assert {ending(call) for _, call in calls} == {grpc.StatusCode.NOT_FOUND}
        finally:
            for channel, _ in calls:
                channel.close()
        grown = rss_mib(pid) - before
        channel, longer = watch(address, "x" * limit)
        try:
            assert ending(longer) == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            channel.close()
    # Measured: +175 MiB for these 12 names of 65.6 MiB, +297 MiB for 2 x 20, +336 MiB for
    # 2 x 60: at most about five of the largest message, whatever the number of requests.
    assert grown < 6 * limit / (1 << 20), f"the task grew by {grown:.0f} MiB"
    print(f"\n12 Watches on {limit / (1 << 20):.1f} MiB names: NOT_FOUND, RSS +{grown:.0f} MiB")


@pytest.mark.timeout(60)
def test_tokenless_watches_end_at_the_handshake_timeout_and_a_token_holders_lasts(token_task):
    cluster, _ = token_task(handshake_timeout_seconds=1.0)
    with cluster:
        address = cluster.target("w").split("://")[1]
        token = ((TOKEN_METADATA, b"t" * 32),)
        held_channel, held = watch(address, "", metadata=token, timeout=None)
        tokenless = [watch(address, "") for _ in range(4)]
        try:
            assert next(held).status == SERVING
            start = time.monotonic()
            for _, call in tokenless:
                assert next(call).status == SERVING  # a probe learns the status ...
            for _, call in tokenless:  # ... and its watch ends at the handshake timeout
                assert ending(call) in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                        grpc.StatusCode.UNAVAILABLE)
            took = time.monotonic() - start
            assert 0.5 < took < 10, took
            assert not held.done()  # open since before them: past the handshake timeout
        finally:
            held_channel.close()
            for channel, _ in tokenless:
                channel.close()


@pytest.mark.timeout(60)
def test_tokenless_watches_beyond_the_pending_limit_end_the_oldest(token_task):
    cluster, _ = token_task(max_pending_connections=4, handshake_timeout_seconds=20.0)
    with cluster:
        address = cluster.target("w").split("://")[1]
        calls = []
        try:
            for _ in range(6):
                calls.append(watch(address, ""))
                assert next(calls[-1][1]).status == SERVING
            first_two = [ending(call) for _, call in calls[:2]]  # pushed out by the 5th, 6th
            assert set(first_two) <= {grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      grpc.StatusCode.UNAVAILABLE}, first_two
            assert not any(call.done() for _, call in calls[2:])
        finally:
            for channel, _ in calls:
                channel.close()


@pytest.mark.timeout(60)
def test_health_requests_that_never_arrive_take_no_server_thread_and_are_cancelled():
    stall = threading.Event()

    def never():
        stall.wait(30)
        yield b""

    shell = Shell("grpc", "127.0.0.1:0", echo_handler, "health test", listen_options(
        security=Security(token=b"cluster-secret"), handshake_timeout_seconds=0.5))
    shell.start()
    try:
        with grpc.insecure_channel(shell.address) as raw:
            # A token holder's connection (its Watch shows the token), so the door keeps it
            # open past the handshake timeout: the reads' own deadline ends the calls.
            held = health_pb2_grpc.HealthStub(raw).Watch(
                health_pb2.HealthCheckRequest(service=""),
                metadata=((TOKEN_METADATA, b"cluster-secret"),))
            assert next(held).status == SERVING
            check = raw.stream_unary("/grpc.health.v1.Health/Check")
            stalled = [check.future(never(), timeout=30) for _ in range(16)]
            channel = shell.transport.connect(shell.address, Security(token=b"cluster-secret"))
            try:
                start = time.monotonic()
                assert bytes(channel.call(Frame(b"x", [b"8 bytes!"]), 10).buffers[0]) == \
                    b"8 bytes!"
                assert time.monotonic() - start < 1.0
            finally:
                channel.close()
            try:
                # Read two at a time, each given handshake_timeout_seconds: about 4 s.
                for future in stalled:
                    assert future.exception(20).code() == grpc.StatusCode.CANCELLED
                assert probe(shell.address) == SERVING
                assert not held.done()
            finally:
                stall.set()
                held.cancel()
    finally:
        shell.stop(1)
