"""Faults: killed peers, restarted servers, atomic puts, bounded concurrency."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import cw_test_functions as fns
import numpy as np
import pytest
from conftest import child_env

from clusterwire import Server, Session
from clusterwire.errors import ResourceExhaustedError, UnavailableError


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("protocol", ["grpc", "grpc+local"])
def test_put_from_a_client_killed_mid_transfer_stores_nothing(protocol):
    with Server({"w": ["127.0.0.1:0"]}, protocol=protocol) as server:
        code = textwrap.dedent("""
            import sys, numpy as np, clusterwire
            session = clusterwire.Session(sys.argv[1])
            print("SENDING", flush=True)
            session.put("partial", np.ones(512 << 20, np.uint8))
        """)
        client = subprocess.Popen([sys.executable, "-c", code, server.target],
                                  stdout=subprocess.PIPE, text=True, env=child_env())
        try:
            assert client.stdout.readline().strip() == "SENDING"
            client.send_signal(signal.SIGKILL)
            client.wait(10)
        finally:
            client.stdout.close()
        with Session(server.target) as session:
            assert "partial" not in session.list()
            session.put("after", np.arange(10))
            assert session.get("after").sum() == 45


def test_clients_reconnect_to_a_server_restarted_on_the_same_port():
    port = free_port()
    cluster = {"w": [f"127.0.0.1:{port}"]}
    with Session(f"grpc://127.0.0.1:{port}", timeout=20) as session:
        with Server(cluster):
            session.put("x", 1)
            assert session.get("x") == 1
        results: list[object] = []
        caller = threading.Thread(target=lambda: results.append(session.list()))
        caller.start()  # retries with backoff while nothing listens on the port
        with Server(cluster):
            caller.join(20)
            assert results == [[]]  # a fresh server: its store is empty
            session.put("y", 2)
            assert session.get("y") == 2


def test_too_many_concurrent_calls_are_resource_exhausted():
    config = {"max_concurrent_calls": 2, "max_workers": 8}
    with Server({"w": ["127.0.0.1:0"]}, config=config) as server:
        outcomes: list[str] = []

        def call() -> None:
            with Session(server.target) as session:
                try:
                    outcomes.append(session.call(fns.hang, 1.0, timeout=20))
                except ResourceExhaustedError:
                    outcomes.append("exhausted")

        threads = [threading.Thread(target=call) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert outcomes.count("exhausted") >= 1
        assert 1 <= outcomes.count("done") <= 5


def test_peer_killed_mid_forwarded_transfer_is_unavailable_and_survivor_serves():
    from clusterwire.local_cluster import LocalCluster

    with LocalCluster({"a": 1, "b": 1}, config={"peer_timeout_seconds": 3},
                      imports=["cw_test_functions"], env=child_env()) as cluster:
        with Session(cluster.target("a"), timeout=30) as session:
            session.put("big", np.ones(64 << 20, np.uint8), task="/job:b/task:0")
            failures: list[BaseException] = []

            def fetch() -> None:
                try:
                    while True:
                        session.get("big", task="/job:b/task:0")
                except UnavailableError as err:
                    failures.append(err)

            reader = threading.Thread(target=fetch)
            reader.start()
            victim = cluster.process("b")
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            reader.join(30)
            assert not reader.is_alive() and failures
            assert session.status()["job"] == "a"


SECOND_CLIENT = textwrap.dedent("""
    import json, sys, numpy as np, clusterwire
    with clusterwire.Session(sys.argv[1], config=json.loads(sys.argv[2]), timeout=10) as session:
        try:
            session.put("x", np.ones(1 << 20))
            print("ACCEPTED")
        except clusterwire.errors.OpError as err:
            print(f"{type(err).__name__}: {err}")
""")


def accepted_session(target: str, config: dict | None = None) -> Session:
    """A session once the server has a free connection (earlier clients' closes take effect
    asynchronously: the server sees the Unix EOF or the client's bye)."""
    deadline = time.monotonic() + 10
    while True:
        session = Session(target, config=config, timeout=10)
        try:
            session.list()
            return session
        except (ResourceExhaustedError, UnavailableError):
            session.close()
            assert time.monotonic() < deadline, "the server never freed the connection"


@pytest.mark.parametrize("token", [False, True], ids=["no_token", "token"])
@pytest.mark.parametrize("protocol", ["grpc", "grpc+local", "grpc+verbs"])
def test_connections_over_the_limit_are_refused_and_freed_on_close(protocol, token, tmp_path):
    if protocol == "grpc+verbs":
        pytest.importorskip("ucxx")
    from clusterwire.local_cluster import LocalCluster

    config = {"max_connections": 1, "max_pending_connections": 1}
    client: dict = {}
    if token:
        (tmp_path / "token").write_bytes(b"t" * 32)
        client = {"auth_token_file": str(tmp_path / "token")}
        config.update(client)
    with LocalCluster({"w": 1}, protocol=protocol, config=config,
                      env=child_env()) as cluster:
        # After the launcher's own session.
        first = accepted_session(cluster.target("w"), client)
        # Without a token gRPC core has one quota for authenticated and pending connections
        # together (max_connections + max_pending_connections): a second connection fills
        # it. With one, the port's door counts the authenticated connections.
        extra = (accepted_session(cluster.target("w"), client)
                 if protocol == "grpc" and not token else None)
        # Another process: gRPC shares one connection among a process's channels.
        second = subprocess.run(
            [sys.executable, "-c", SECOND_CLIENT, cluster.target("w"), json.dumps(client)],
            capture_output=True, text=True, timeout=60, env=child_env())
        # gRPC's connection quota closes the socket at accept (UnavailableError); the
        # others, and the door, answer ResourceExhaustedError.
        refusal = ("ResourceExhaustedError" if protocol != "grpc" or token
                   else "UnavailableError")
        assert re.search(rf"^{refusal}: .*max_connections", second.stdout, re.MULTILINE), (
            second.stdout + second.stderr)
        first.close()
        if extra is not None:
            extra.close()
        with accepted_session(cluster.target("w"), client) as third:
            third.put("y", np.ones(1 << 20))
            assert third.list() == ["y"]
