"""grpc+verbs over real UCX: which UCX transport carried the bytes, and clear failures."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import child_env

from clusterwire.local_cluster import LocalCluster
from clusterwire.transport import Frame

pytest.importorskip("ucxx", reason="the verbs extra is not installed: pip install '.[verbs]'")

CLIENT = textwrap.dedent("""
    import sys, numpy as np, clusterwire
    with clusterwire.Session(sys.argv[1], timeout=30) as session:
        value = np.random.default_rng(5).integers(0, 255, 16 << 20, dtype=np.uint8)
        session.put("x", value, task="/job:b/task:0")
        assert np.array_equal(session.get("x", task="/job:b/task:0"), value)
        status = session.status(task="/job:b/task:0")["transport"]
        print("ROUND TRIP OK", status["ucx_tls"], status["ucx_transports"])
""")


def run_python(code: str, *args: str, env: dict[str, str], timeout: float = 60):
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


@pytest.mark.parametrize("tls,carrier", [("tcp,self", "tcp/lo"), ("sm,self", "cma/memory")])
def test_bulk_bytes_travel_on_the_chosen_ucx_transport(tls, carrier):
    env = {**child_env(), "UCX_TLS": tls, "UCX_PROTO_INFO": "y"}
    with LocalCluster({"a": 1, "b": 1}, protocol="grpc+verbs", env=env) as cluster:
        # The client is a third process: UCX's in-process "self" path would hide the wire.
        result = run_python(CLIENT, cluster.target("a"), env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"ROUND TRIP OK {tls}" in output
    rendezvous = [line for line in output.splitlines() if "rendezvous" in line]
    assert rendezvous and all(carrier in line for line in rendezvous), rendezvous


SESSIONS_CLIENT = textwrap.dedent("""
    import os, sys, time, numpy as np, clusterwire

    def once():
        with clusterwire.Session(sys.argv[1], timeout=30) as session:
            session.put("x", np.arange(4))
            assert session.get("x").tolist() == [0, 1, 2, 3]

    def descriptors():
        return len(os.listdir("/proc/self/fd"))

    once()
    before = descriptors()
    for _ in range(40):
        once()
    # The last sessions' connections close in UCX's and gRPC's own threads: a few may
    # still be open at first (a leak leaves one per session).
    settled = time.monotonic() + 5
    while descriptors() >= before + 5 and time.monotonic() < settled:
        time.sleep(0.05)
    print("DESCRIPTORS", before, descriptors())
""")


def test_sessions_opened_and_closed_leave_no_descriptors_behind():
    # Each hello's address check used to leave a UCX TCP connection open in the client.
    from clusterwire import Server

    env = {**child_env(), "UCX_TLS": "tcp,self"}
    with Server({"w": ["127.0.0.1:0"]}, protocol="grpc+verbs") as server:
        result = run_python(SESSIONS_CLIENT, server.target, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    before, after = map(int, result.stdout.split("DESCRIPTORS")[1].split())
    assert after - before < 5, (before, after)


def test_missing_ucxx_names_the_extra():
    code = textwrap.dedent("""
        import sys
        sys.modules["ucxx"] = None  # as if the verbs extra were not installed
        import clusterwire
        try:
            clusterwire.Server({"w": ["127.0.0.1:0"]}, protocol="grpc+verbs")
        except clusterwire.errors.NotFoundError as err:
            print("ERROR", err)
    """)
    result = run_python(code, env={})
    assert "ERROR" in result.stdout and "pip install 'clusterwire[verbs]'" in result.stdout


def test_ucx_that_cannot_initialise_is_a_clear_error(tmp_path):
    config = tmp_path / "plugins.toml"
    config.write_text('[options."grpc+verbs"]\ntls = "no_such_transport"\n')
    code = textwrap.dedent("""
        import clusterwire
        try:
            clusterwire.Server({"w": ["127.0.0.1:0"]}, protocol="grpc+verbs")
        except clusterwire.errors.UnavailableError as err:
            print("ERROR", err)
    """)
    result = run_python(code, env={"CLUSTERWIRE_PLUGINS": str(config)})
    assert "ERROR UCX could not initialise (TLS=no_such_transport" in result.stdout, \
        result.stdout + result.stderr


def test_the_compiled_option_must_be_a_boolean():
    from clusterwire.errors import InvalidArgumentError
    from clusterwire.transports.verbs.transport import VerbsTransport

    with pytest.raises(InvalidArgumentError, match="compiled must be true or false, got 'no'"):
        VerbsTransport({"compiled": "no"})


def test_status_reports_the_ucx_transports(tmp_path):
    from clusterwire import Server, Session

    with Server({"w": ["127.0.0.1:0"]}, protocol="grpc+verbs") as server, \
            Session(server.target) as session:
        transport = session.status()["transport"]
    assert transport["data"] == "ucx"
    assert "tcp/lo" in transport["ucx_transports"]
    assert transport["rdma"].startswith("none")


def test_a_silent_client_loses_its_slot_and_reconnects_transparently(tmp_path):
    """Slots of clients killed without a bye are reaped; a live but idle client recovers."""
    from clusterwire import Session

    config = tmp_path / "plugins.toml"
    config.write_text('[options."grpc+verbs"]\nidle_slot_seconds = 0.2\n')
    with LocalCluster({"w": 1}, protocol="grpc+verbs",
                      env={**child_env(), "CLUSTERWIRE_PLUGINS": str(config)}) as cluster:
        idle = Session(cluster.target("w"), timeout=30)
        assert idle.list() == []
        deadline = time.monotonic() + 15
        while True:  # each new client's hello reaps slots idle for 0.2 s
            with Session(cluster.target("w"), timeout=30) as probe:
                if probe.status()["transport"]["clients"] == "1":  # only the probe is left
                    break
            assert time.monotonic() < deadline, "the idle client's slot was never reaped"
        idle.put("x", np.arange(3))  # dropped unrun, found out by a ping, retried
        assert idle.list() == ["x"]
        idle.close()


BLOCKING_SERVER = textwrap.dedent("""
    import sys, threading
    from clusterwire.plugins import get_plugin_manager
    from clusterwire.transport import Frame, ListenOptions

    release = threading.Event()
    entered = threading.Condition()
    blocked = [0]

    def handler(frame):
        if frame.header == b"block":
            with entered:
                blocked[0] += 1
                entered.notify_all()
            release.wait(60)
        elif frame.header.startswith(b"await-blocked:"):  # returns once that many block
            with entered:
                entered.wait_for(lambda: blocked[0] >= int(frame.header[14:]), 30)
        elif frame.header == b"release":
            release.set()
        return Frame(frame.header, list(frame.buffers))

    listener = get_plugin_manager().transport("grpc+verbs").listen(
        "127.0.0.1:0", handler, ListenOptions(max_workers=4))
    listener.start()
    print(listener.address, flush=True)
    sys.stdin.read()
    listener.stop(0)
""")


@pytest.fixture
def blocking_server():
    """A grpc+verbs listener in another process whose b"block" requests wait for b"release"."""
    proc = subprocess.Popen([sys.executable, "-c", BLOCKING_SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **child_env()})
    try:
        yield proc.stdout.readline().strip()
    finally:
        proc.stdin.close()
        proc.wait(30)


def _echo_frame(tag: str, size: int) -> tuple[Frame, np.ndarray]:
    payload = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    return Frame(tag.encode(), [payload]), payload


def test_blocked_handlers_do_not_stall_other_calls(blocking_server):
    """Handlers blocked on every job slot but one: calls (the releasing one too) still run."""
    from clusterwire.plugins import get_plugin_manager

    channel = get_plugin_manager().transport("grpc+verbs").connect(blocking_server)
    try:
        with ThreadPoolExecutor(4) as pool:
            blocked = [pool.submit(channel.call, Frame(b"block", []), 60) for _ in range(3)]
            channel.call(Frame(b"await-blocked:3", []), timeout=30)
            for size in (8, 200 << 10):  # inline and bulk buffers
                frame, payload = _echo_frame("echo", size)
                for _ in range(20):
                    reply = channel.call(frame, timeout=10)
                    assert np.array_equal(np.frombuffer(reply.buffers[0], np.uint8), payload)
            assert not any(f.done() for f in blocked)
            channel.call(Frame(b"release", []), timeout=10)
            assert [f.result(30).header for f in blocked] == [b"block"] * 3
    finally:
        channel.close()


def test_many_threads_share_one_channel(blocking_server):
    from clusterwire.plugins import get_plugin_manager

    channel = get_plugin_manager().transport("grpc+verbs").connect(blocking_server)

    def calls(thread: int) -> None:
        for i in range(30):
            # Inline, bulk, and bulk past UCX's rendezvous threshold: calls that take the C
            # round trip and calls that find other threads' messages to look after.
            frame, payload = _echo_frame(f"{thread}-{i}", (8, 100 << 10, 2 << 20)[i % 3])
            reply = channel.call(frame, timeout=30)
            assert reply.header == frame.header
            assert np.array_equal(np.frombuffer(reply.buffers[0], np.uint8), payload)

    try:
        with ThreadPoolExecutor(8) as pool:
            for future in [pool.submit(calls, t) for t in range(8)]:
                future.result(60)
    finally:
        channel.close()
