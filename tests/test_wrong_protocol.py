"""A client of one clusterwire protocol at a live listener of another gets, at once and not
retried, an error naming the protocol served (clusterwire.wrong_protocol)."""

from __future__ import annotations

import importlib.util
import time

import pytest

from clusterwire import errors
from clusterwire.server import Server
from clusterwire.session import Session

PROTOCOLS = ["grpc", "grpc+local"] + (
    ["grpc+verbs"] if importlib.util.find_spec("ucxx") is not None else [])
PAIRS = [(served, used) for served in PROTOCOLS for used in PROTOCOLS if served != used]
#: A Session's deadline far above what an answer takes: a retried call would use it up.
DEADLINE_S = 30.0


def _server(protocol: str, config: dict | None = None) -> Server:
    server = Server({"worker": ["127.0.0.1:0"]}, job_name="worker", task_index=0,
                    protocol=protocol, config=config)
    server.start()
    return server


@pytest.mark.parametrize(("served", "used"), PAIRS)
def test_a_client_of_another_protocol_is_told_the_protocol_served_at_once(served, used):
    server = _server(served)
    port = server.target.rsplit(":", 1)[1]
    try:
        with Session(f"{used}://127.0.0.1:{port}", timeout=DEADLINE_S,
                     in_process=False) as session:
            started = time.monotonic()
            with pytest.raises(errors.UnimplementedError) as raised:
                session.status()
            took = time.monotonic() - started
    finally:
        server.stop()
    assert raised.value.message == (
        f"This server serves {served}, not the protocol of this call: use "
        f"{served}://HOST:PORT as the target.")
    assert took < DEADLINE_S / 3, f"answered after {took:.1f} s: retried"


def test_a_tokenless_client_of_another_protocol_learns_only_that_it_needs_the_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("a-cluster-token-of-32-characters")
    server = _server("grpc+local", {"auth_token_file": str(token)})
    port = server.target.rsplit(":", 1)[1]
    try:
        with Session(f"grpc://127.0.0.1:{port}", timeout=DEADLINE_S,
                     in_process=False) as tokenless:
            with pytest.raises(errors.UnauthenticatedError) as raised:
                tokenless.status()
        assert "grpc+local" not in raised.value.message
        with Session(f"grpc://127.0.0.1:{port}", config={"auth_token_file": str(token)},
                     timeout=DEADLINE_S, in_process=False) as member:
            with pytest.raises(errors.UnimplementedError, match="serves grpc\\+local"):
                member.status()
    finally:
        server.stop()


def test_a_grpc_local_client_still_retries_a_port_where_nothing_listens():
    server = _server("grpc")
    port = server.target.rsplit(":", 1)[1]
    server.stop()
    with Session(f"grpc+local://127.0.0.1:{port}", timeout=1.0, in_process=False) as session:
        with pytest.raises(errors.UnavailableError) as raised:
            session.status()
    assert "cannot reach a grpc+local server" in raised.value.message


def test_a_grpc_peer_that_is_no_clusterwire_client_is_told_the_protocol_served():
    import grpc

    server = _server("grpc+local")
    address = server.target.split("://")[1]
    try:
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as raised:
                channel.unary_unary("/some.Other/Service")(b"hello", timeout=DEADLINE_S)
    finally:
        server.stop()
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert raised.value.details().startswith("This server serves grpc+local, not the protocol")


@pytest.mark.skipif(importlib.util.find_spec("clusterwire_zmq") is None,
                    reason="the zmq plugin is not installed: pip install plugins/clusterwire-zmq")
@pytest.mark.parametrize("used", ["grpc", "grpc+local"])
def test_a_grpc_client_at_a_zmq_task_is_told_at_once_the_port_speaks_no_grpc(used):
    server = _server("zmq")
    port = server.target.rsplit(":", 1)[1]
    try:
        with Session(f"{used}://127.0.0.1:{port}", timeout=DEADLINE_S,
                     in_process=False) as session:
            started = time.monotonic()
            with pytest.raises(errors.UnavailableError) as raised:
                session.status()
            took = time.monotonic() - started
    finally:
        server.stop()
    assert f"127.0.0.1:{port} does not speak gRPC" in raised.value.message
    assert "check the target's protocol" in raised.value.message
    assert took < DEADLINE_S / 3, f"answered after {took:.1f} s: retried"


@pytest.mark.skipif(importlib.util.find_spec("clusterwire_zmq") is None,
                    reason="the zmq plugin is not installed: pip install plugins/clusterwire-zmq")
def test_a_zmq_client_at_a_grpc_task_fails_at_once():
    server = _server("grpc")
    port = server.target.rsplit(":", 1)[1]
    try:
        with Session(f"zmq://127.0.0.1:{port}", timeout=DEADLINE_S,
                     in_process=False) as session:
            started = time.monotonic()
            with pytest.raises(errors.UnavailableError, match="not a clusterwire zmq listener"):
                session.status()
            took = time.monotonic() - started
    finally:
        server.stop()
    assert took < DEADLINE_S / 3, f"answered after {took:.1f} s: retried"
