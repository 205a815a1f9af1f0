"""A Session on a server of its own process: no transport, the same semantics."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import clusterwire
from clusterwire import Server, Session
from clusterwire.errors import (
    CancelledError,
    DeadlineExceededError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from clusterwire.local_cluster import LocalCluster

PROTOCOLS = ["grpc", "grpc+local", "grpc+verbs", "zmq"]
_gate = threading.Event()
_entered = threading.Event()


@clusterwire.remote(name="tests.in_process.wait_for_gate")
def wait_for_gate() -> str:
    """Block until the test opens the gate (at most 10 s)."""
    _entered.set()
    _gate.wait(10)
    return "through"


@clusterwire.remote(name="tests.in_process.add")
def add(a: int, b: int) -> int:
    return a + b


@pytest.fixture
def gate():
    _gate.clear()
    _entered.clear()
    yield
    _gate.set()


def _server(protocol: str = "grpc", **options) -> Server:
    try:
        return Server({"w": ["127.0.0.1:0"]}, protocol=protocol, config=options or None)
    except clusterwire.errors.UnimplementedError as err:  # e.g. grpc+verbs without ucxx
        pytest.skip(str(err))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_reaches_its_own_server_without_the_transport(protocol):
    with _server(protocol) as server, Session(server.target) as session:
        session.put("x", np.arange(10))
        assert session.get("x").tolist() == list(range(10))
        assert session.list() == ["x"]
        assert session.status()["job"] == "w"
        assert session.call(add, 2, 3) == 5
        assert session._client._channels == {}  # no channel was ever opened


def test_a_stored_tensor_is_shared_read_only_and_never_copied():
    big = np.ones(64 << 20, np.uint8)
    with _server() as server, Session(server.target) as session:
        session.put("big", big)
        first, again = session.get("big"), session.get("big")
        assert np.shares_memory(first, again)  # the store's own memory, twice
        assert not first.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            first[0] = 7
        assert session.get("big")[0] == 1


def test_a_put_copies_writable_values_and_shares_read_only_ones():
    writable = np.zeros(1000)
    frozen = np.ones(1000)
    frozen.flags.writeable = False
    with _server() as server, Session(server.target) as session:
        session.put("writable", writable)
        session.put("frozen", frozen)
        writable[:] = 5  # the caller keeps changing its array ...
        assert session.get("writable").sum() == 0  # ... the stored value does not change
        assert np.shares_memory(session.get("frozen"), frozen)


def test_in_process_false_goes_through_the_transport():
    with _server() as server, Session(server.target, in_process=False) as session:
        session.put("x", np.arange(4))
        got = session.get("x")
        assert got.flags.writeable  # received over the wire: the caller's own copy
        assert session._client._channels


def test_the_token_is_checked_as_on_the_wire(tmp_path):
    token = tmp_path / "token"
    token.write_text("in-process-token-0123456789abcdef\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token-0123456789abcdefgh\n")
    with _server(auth_token_file=str(token)) as server:
        with Session(server.target, config={"auth_token_file": str(wrong)}) as rogue:
            with pytest.raises(UnauthenticatedError, match="cluster token"):
                rogue.put("planted", np.ones(3))
        with Session(server.target) as anonymous:
            with pytest.raises(UnauthenticatedError, match="cluster token"):
                anonymous.status()
        with Session(server.target, config={"auth_token_file": str(token)}) as session:
            assert session.list() == []  # nothing was planted
            assert session._client._channels == {}


def test_a_deadline_ends_the_wait_and_the_server_goes_on(gate):
    with _server() as server, Session(server.target) as session:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            session.call(wait_for_gate, timeout=0.3)
        assert time.monotonic() - started < 2
        _gate.set()
        assert session.list() == []


def test_closing_the_session_cancels_its_wait(gate):
    with _server() as server:
        session = Session(server.target)
        errors: list[BaseException] = []

        def call() -> None:
            try:
                session.call(wait_for_gate, timeout=10)
            except BaseException as err:  # noqa: BLE001 - the test inspects it
                errors.append(err)

        caller = threading.Thread(target=call)
        caller.start()
        assert _entered.wait(5)
        session.close()
        caller.join(5)
        assert not caller.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], CancelledError)


def test_stop_cancels_a_waiting_call_and_frees_the_address(gate):
    server = _server()
    session = Session(server.target, timeout=1)
    outcome: list[BaseException | str] = []
    caller = threading.Thread(target=lambda: outcome.append(_call(session)))
    caller.start()
    assert _entered.wait(5)
    server.stop(grace=0)
    caller.join(5)
    assert isinstance(outcome[0], CancelledError)
    started = time.monotonic()
    with pytest.raises(UnavailableError):  # nothing in this process serves it any more
        session.status()
    assert time.monotonic() - started < 5
    session.close()


def _call(session: Session) -> BaseException | str:
    try:
        return session.call(wait_for_gate, timeout=10)
    except BaseException as err:  # noqa: BLE001 - the test inspects it
        return err


def test_admission_and_message_limits_hold(gate):
    with Server({"w": ["127.0.0.1:0"]}, protocol="grpc",
                config={"max_concurrent_calls": 1, "max_message_bytes": 1 << 20}) as server:
        with Session(server.target) as session:
            with pytest.raises(ResourceExhaustedError, match="max_message_bytes"):
                session.put("big", np.ones(2 << 20, np.uint8))
            waiting = threading.Thread(target=_call, args=(session,))
            waiting.start()
            assert _entered.wait(5)
            with pytest.raises(ResourceExhaustedError, match="max_concurrent_calls"):
                session.list()
            _gate.set()
            waiting.join(5)
            assert session.list() == []


def test_a_worker_process_reads_the_ps_through_its_own_server():
    value = np.arange(1 << 20, dtype=np.float32)
    with LocalCluster({"ps": 1}) as cluster:
        ps = cluster.target("ps", 0).split("://")[1]
        with Session(cluster.target("ps", 0)) as direct:
            direct.put("weights", value)
        with Server({"ps": [ps], "worker": ["127.0.0.1:0"]}, job_name="worker",
                    task_index=0) as worker, Session(worker.target) as session:
            got = session.get("weights", task="/job:ps/task:0")
            assert np.array_equal(got, value)
            assert session._client._channels == {}  # only the worker talked to the ps


def test_a_forward_for_an_in_process_caller_keeps_its_deadline():
    unreachable = "127.0.0.1:9"  # the discard port: nothing listens there
    with Server({"ps": [unreachable], "worker": ["127.0.0.1:0"]}, job_name="worker",
                task_index=0) as worker, Session(worker.target) as session:
        started = time.monotonic()
        with pytest.raises(UnavailableError):
            session.get("weights", task="/job:ps/task:0", timeout=0.5)
        assert time.monotonic() - started < 3  # not the task's 30 s peer timeout


_FORK_SCRIPT = """
import os, select, clusterwire
from clusterwire import in_process
server = clusterwire.Server({"w": ["127.0.0.1:0"]})
with clusterwire.Session(server.target) as session:
    session.put("x", 1)
    go_read, go_write = os.pipe()
    answer_read, answer_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: read after the parent changed the value
        try:
            os.read(go_read, 1)
            with clusterwire.Session(server.target, timeout=10) as child:
                inherited = in_process.inherited_servers() == [server.target]
                os.write(answer_write, repr((int(child.get("x")), inherited)).encode())
        finally:
            os._exit(0)
    session.put("x", 2)
    os.write(go_write, b"go")
    ready, _, _ = select.select([answer_read], [], [], 30)
    print(os.read(answer_read, 100).decode() if ready else "no answer", flush=True)
    os.waitpid(pid, 0)
server.stop()
"""


def test_a_forked_child_reaches_the_server_not_its_stale_copy(tmp_path):
    """A child forked from a process serving a task (e.g. a DataLoader worker) has a copy
    of the task's store but none of its threads: it must go over the wire. (In a fresh
    interpreter: forking the test process, whose other tests started threads, could hang.)"""
    result = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(2, True)"  # the live value; it knows it is a fork
