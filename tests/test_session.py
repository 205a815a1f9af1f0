"""Session against an in-process server: store, calls, status, errors."""

from __future__ import annotations

import socket
import threading
import time

import cw_test_functions as fns
import numpy as np
import pytest

import clusterwire
from clusterwire import Session
from clusterwire.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    RemoteFunctionError,
    UnavailableError,
)
from clusterwire.rpc import RequestClient
from clusterwire.transport import ConnectionFailed, Frame


@pytest.fixture
def session(local_server):
    with Session(local_server.target) as session:
        yield session


VALUES = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array(3.5),
    np.zeros((0, 3), np.int16),
    np.arange(20)[::3],
    np.array(["a", "bcd"]),
    b"raw bytes",
    "text",
    42,
    -(1 << 90),
    2.25,
    True,
    None,
    [1, "two", (3.0, None)],
    {"w": np.ones(2), "meta": {"step": 7}},
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_put_get_round_trip(session, value):
    session.put("x", value)
    result = session.get("x")
    if isinstance(value, np.ndarray):
        np.testing.assert_array_equal(result, value)
        assert result.dtype == value.dtype and result.shape == value.shape
    elif isinstance(value, dict):
        np.testing.assert_array_equal(result["w"], value["w"])
        assert result["meta"] == value["meta"]
    else:
        assert result == value and type(result) is type(value)


def test_256_mib_round_trip(session):
    array = np.random.default_rng(1).integers(0, 255, 256 << 20, dtype=np.uint8)
    session.put("big", array)
    result = session.get("big")
    assert result.nbytes == 256 << 20
    assert np.array_equal(result, array)


def test_arrays_received_over_the_wire_are_writable(local_server):
    with Session(local_server.target, in_process=False) as session:
        session.put("x", np.arange(4))
        result = session.get("x")
        result[0] = 9
        assert session.get("x")[0] == 0


def test_arrays_from_a_server_of_this_process_are_read_only(session):
    session.put("x", np.arange(4))
    result = session.get("x")
    with pytest.raises(ValueError, match="read-only"):
        result[0] = 9
    changed = result.copy()
    changed[0] = 9
    assert session.get("x")[0] == 0


def test_delete_and_list(session):
    session.put("b", 1)
    session.put("a", 2)
    assert session.list() == ["a", "b"]
    assert session.delete("a") is True
    assert session.delete("a") is False
    assert session.list() == ["b"]
    with pytest.raises(NotFoundError, match="No tensor named 'a' on /job:local/task:0"):
        session.get("a")


def test_overwrite_replaces_atomically(session):
    session.put("x", np.zeros(1000))
    session.put("x", np.ones(1000))
    assert session.get("x").sum() == 1000


def test_call_registered_function_by_object_and_by_name(session):
    assert session.call(fns.add, 2, 3) == 5
    assert session.call("cw_test_functions.add", "a", b="b") == "ab"
    assert session.call(fns.echo, 1, x=np.arange(3))[1]["x"].tolist() == [0, 1, 2]
    np.testing.assert_array_equal(session.call(fns.scaled, np.arange(3.0), 2.0), [0, 2, 4])


def test_repeated_requests_of_one_shape_carry_their_own_data(session):
    # Headers of same-shaped requests and responses are built and parsed once (HeaderCache,
    # the server's prepared requests, the client's response plans): the data must not be.
    for step in range(5):
        array = np.full((2, 3), step, np.float32)
        np.testing.assert_array_equal(session.call(fns.scaled, array, 2.0), array * 2)
        assert session.call(fns.add, step, 1) == step + 1
        session.put("w", array)
        np.testing.assert_array_equal(session.get("w"), array)
    with pytest.raises(NotFoundError):
        session.get("later")
    session.put("later", np.arange(3))
    np.testing.assert_array_equal(session.get("later"), [0, 1, 2])
    session.put("later", "now a str")
    assert session.get("later") == "now a str"


def test_call_unknown_function_is_not_found(session):
    with pytest.raises(NotFoundError, match="No remote function registered as 'nope.f'"):
        session.call("nope.f")


def test_remote_exception_carries_type_and_message_but_no_server_paths(session):
    with pytest.raises(RemoteFunctionError) as info:
        session.call(fns.fail_with_value_error, "xyz")
    err = info.value
    assert err.remote_type == "builtins.ValueError"
    assert err.message == "bad value: xyz"
    assert err.remote_traceback == ""
    assert isinstance(err, clusterwire.errors.UnknownError)


def test_remote_traceback_when_the_operator_asks_for_it():
    server = clusterwire.Server({"local": ["127.0.0.1:0"]}, job_name="local", task_index=0,
                                config={"send_tracebacks": True})
    try:
        with Session(server.target) as session:
            with pytest.raises(RemoteFunctionError) as info:
                session.call(fns.fail_with_value_error, "xyz")
        assert "fail_with_value_error" in info.value.remote_traceback
        assert "Traceback" in info.value.remote_traceback
    finally:
        server.stop()


def test_remote_clusterwire_error_keeps_its_class(session):
    with pytest.raises(NotFoundError, match="nothing here"):
        session.call(fns.fail_with_not_found)


def test_call_deadline(session):
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="deadline 0.3 s"):
        session.call(fns.hang, 5.0, timeout=0.3)
    assert time.monotonic() - started < 3


def test_status(session, local_server):
    status = session.status()
    assert status["job"] == "local" and status["task_index"] == 0
    assert status["target"] == local_server.target
    assert status["protocol"] == "grpc"
    assert status["version"] == clusterwire.__version__
    assert status["cpu_count"] >= 1
    assert status["devices"][0] == {"name": "/job:local/replica:0/task:0/device:CPU:0",
                                    "device_type": "CPU"}
    assert status["cluster"] == local_server.cluster_spec
    assert "grpc" in status["transport"]["control"]


def test_own_task_by_device_string(session):
    session.put("x", 1, task="/job:local/task:0")
    assert session.get("x", task="/job:local/replica:0/task:0") == 1


def test_unknown_task_is_not_found(session):
    with pytest.raises(NotFoundError, match="No task /job:ps/task:0 in the cluster"):
        session.get("x", task="/job:ps/task:0")


@pytest.mark.parametrize("task", ["ps:0", "/job:/task:0", "/job:ps/task:x", "/jab:ps", 3,
                                  ["/job:ps/task:0"]])
def test_malformed_task_strings(session, task):
    with pytest.raises(InvalidArgumentError, match="device string"):
        session.get("x", task=task)


@pytest.mark.parametrize("name", ["", None, 3])
def test_bad_tensor_names(session, name):
    with pytest.raises(InvalidArgumentError, match="tensor name"):
        session.put(name, 1)


def test_unsendable_value_is_invalid_argument(session):
    with pytest.raises(InvalidArgumentError, match="Cannot send a value of type object"):
        session.put("x", object())


@pytest.mark.parametrize("target", ["", "grpc://", "grpc://host", "grpc://h:99999",
                                    "a://b://c:1", None])
def test_malformed_targets(target):
    with pytest.raises(InvalidArgumentError):
        Session(target)


@pytest.mark.parametrize("timeout", [0, -1, "1"])
def test_bad_timeouts(local_server, timeout):
    with pytest.raises(InvalidArgumentError, match="timeout"):
        Session(local_server.target, timeout=timeout)


def test_unknown_protocol_target():
    with pytest.raises(clusterwire.errors.NotFoundError, match="'carrier'"):
        Session("carrier://127.0.0.1:1")


def test_peer_down_is_unavailable_within_the_deadline():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with Session(f"grpc://127.0.0.1:{port}", timeout=1.0) as session:
        with pytest.raises(UnavailableError, match=f"127.0.0.1:{port}.*unavailable after 1 s"):
            session.get("x")
    assert time.monotonic() - started < 3


class _UnreachableThenCutShort:
    """A transport whose first connect finds no one listening and whose second gets only
    the end of the window: its call outlives the deadline (a loaded machine)."""

    def __init__(self):
        self.connects = 0

    def connect(self, address, security):
        self.connects += 1
        if self.connects == 1:
            raise ConnectionFailed("connection refused")
        return self

    def call(self, frame, timeout=None):
        time.sleep(timeout)
        raise DeadlineExceededError("the call outlived its deadline")

    def close(self):
        pass


def test_an_attempt_cut_short_by_the_deadline_after_unreachable_ones_is_unavailable():
    client = RequestClient("grpc", in_process=False)
    client._transport = _UnreachableThenCutShort()
    with pytest.raises(UnavailableError, match="at a:1 .*unavailable after 0.2 s: connection "
                                               "refused"):
        client.send_frame("a:1", Frame(b"x", []), "status", timeout=0.2)
    client.close()


def test_an_unreachable_task_is_reported_at_once_while_retries_go_on(caplog, monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    caplog.set_level("WARNING", logger="clusterwire")
    failed_at = []  # when each attempt found the task unreachable (LogRecord.created's clock)
    note_unreachable = RequestClient.note_unreachable

    def noted(self, *args):
        failed_at.append(time.time())
        note_unreachable(self, *args)

    monkeypatch.setattr(RequestClient, "note_unreachable", noted)
    # 3 s: more than the second left (_QUIET_RETRY_S) it takes to warn, after a first attempt
    # that may take a while on a loaded machine.
    with Session(f"grpc://127.0.0.1:{port}", timeout=3.0) as session:
        with pytest.raises(UnavailableError):
            session.get("x")
    said = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert f"127.0.0.1:{port} (grpc)" in said[0].getMessage()
    assert "retrying until the deadline" in said[0].getMessage()
    # Said when the first attempt failed, before the retries that went on until the deadline.
    assert len(failed_at) >= 2 and failed_at[0] <= said[0].created <= failed_at[1], failed_at


def test_retries_until_a_late_server_comes_up():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    servers = []
    session = Session(f"grpc://127.0.0.1:{port}", timeout=20)
    result = []
    caller = threading.Thread(target=lambda: result.append(session.status()["job"]))
    caller.start()
    servers.append(clusterwire.Server({"late": [f"127.0.0.1:{port}"]}))
    caller.join(20)
    session.close()
    servers[0].stop()
    assert result == ["late"]


def test_barrier_with_one_task_returns(session):
    session.barrier("solo")


def test_closed_session_refuses_requests(local_server):
    session = Session(local_server.target)
    session.close()
    with pytest.raises(clusterwire.errors.CancelledError, match="closed"):
        session.get("x")


_entered = threading.Semaphore(0)
_release = threading.Event()


@clusterwire.remote
def block_until_released(seconds: float) -> str:
    """Signal entry, then wait ``seconds`` or until the test releases it."""
    _entered.release()
    _release.wait(seconds)
    return "done"


def test_stop_with_grace_drains_then_cancels():
    server = clusterwire.Server({"w": ["127.0.0.1:0"]})
    outcomes: dict[float, str] = {}

    def slow_call(seconds):
        try:
            with Session(server.target) as session:
                outcomes[seconds] = session.call(block_until_released, seconds, timeout=30)
        except clusterwire.errors.OpError as err:
            outcomes[seconds] = type(err).__name__

    threads = [threading.Thread(target=slow_call, args=(s,)) for s in (0.3, 30.0)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert _entered.acquire(timeout=10)
    started = time.monotonic()
    server.stop(grace=1.5)
    stop_took = time.monotonic() - started
    for thread in threads:
        thread.join(15)
    _release.set()
    assert outcomes == {0.3: "done", 30.0: "CancelledError"}
    assert 1.0 < stop_took < 5
