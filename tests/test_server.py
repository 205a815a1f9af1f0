"""Server: TF's constructor semantics, port 0, binding, lifecycle."""

from __future__ import annotations

import socket
import threading

import pytest

import clusterwire
from clusterwire import ClusterSpec, ConfigProto, Server, ServerDef, ServerOptions, Session
from clusterwire.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)


def connect_ok(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) == 0


def test_port_zero_binds_a_free_port_reported_by_target_and_server_def():
    with Server({"worker": ["127.0.0.1:0"]}) as server:
        host, port = server.target.removeprefix("grpc://").rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert server.server_def.cluster.job[0].tasks[0] == f"127.0.0.1:{port}"
        assert server.cluster_spec.task_address("worker", 0) == f"127.0.0.1:{port}"
        assert connect_ok("127.0.0.1", int(port))


def test_binds_the_host_of_its_address_not_every_interface():
    with Server({"worker": ["127.0.0.1:0"]}) as server:
        port = int(server.target.rsplit(":", 1)[1])
        # 127.0.0.2 is loopback too, but the server bound 127.0.0.1 only
        assert not connect_ok("127.0.0.2", port)


def test_bind_address_option_overrides_the_host():
    with Server({"worker": ["localhost:0"]}, config={"bind_address": "127.0.0.1"}) as server:
        assert server.target.startswith("grpc://localhost:")
        assert Session(server.target).status()["job"] == "worker"


def test_create_local_server():
    server = Server.create_local_server()
    try:
        assert server.server_def.job_name == "local"
        assert server.server_def.task_index == 0
        assert server.target.startswith("grpc://localhost:")
        with Session(server.target) as session:
            assert session.status()["task_index"] == 0
    finally:
        server.stop()


def test_start_false_then_start_is_idempotent():
    server = Server({"local": ["127.0.0.1:0"]}, start=False)
    try:
        server.start()
        server.start()
        with Session(server.target) as session:
            assert session.status()["job"] == "local"
    finally:
        server.stop()


def test_stop_is_idempotent_frees_the_port_and_join_returns():
    server = Server({"local": ["127.0.0.1:0"]})
    port = int(server.target.rsplit(":", 1)[1])
    assert server.join(timeout=0.01) is False
    joined = threading.Event()
    waiter = threading.Thread(target=lambda: (server.join(), joined.set()))
    waiter.start()
    server.stop()
    server.stop()
    waiter.join(10)
    assert joined.is_set()
    assert server.join() is True
    with socket.socket() as sock:  # free right after stop, for a server (SO_REUSEADDR:
        # connections the stopped server closed may leave TIME_WAIT entries on the port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
    with pytest.raises(FailedPreconditionError, match="create a new Server"):
        server.start()


def test_concurrent_stops_all_return_after_shutdown():
    server = Server({"local": ["127.0.0.1:0"]})
    threads = [threading.Thread(target=server.stop) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert server.join(0) is True


def test_port_in_use_is_a_clear_error():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UnavailableError, match=f"Could not bind 127.0.0.1:{port}.*port 0"):
            Server({"w": [f"127.0.0.1:{port}"]})


def test_port_in_use_by_another_server():
    with Server({"w": ["127.0.0.1:0"]}) as first:
        port = first.target.rsplit(":", 1)[1]
        with pytest.raises(UnavailableError, match="Could not bind"):
            Server({"w": [f"127.0.0.1:{port}"]})


def test_server_def_port_overrides_the_address_port():
    server_def = ServerDef(job_name="w", task_index=0, protocol="grpc")
    server_def.cluster.job.add(name="w").tasks[0] = "127.0.0.1:1"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    server_def.port = free
    with Server(server_def) as server:
        assert server.target == f"grpc://127.0.0.1:{free}"


def test_accepts_server_def_cluster_def_cluster_spec_and_dict():
    cluster = {"w": ["127.0.0.1:0"]}
    spec = ClusterSpec(cluster)
    server_def = ServerDef(job_name="w", protocol="grpc")
    server_def.cluster.CopyFrom(spec.as_cluster_def())
    for definition in (cluster, spec, spec.as_cluster_def(), server_def):
        with Server(definition) as server:
            assert server.server_def.job_name == "w"


def test_overrides_and_config_merge():
    server_def = ServerDef(job_name="a", task_index=0, protocol="other")
    job = server_def.cluster.job.add(name="b")
    job.tasks[3] = "127.0.0.1:0"
    config = ConfigProto(intra_op_parallelism_threads=3)
    with Server(server_def, job_name="b", task_index=3, protocol="grpc", config=config) as s:
        assert (s.server_def.job_name, s.server_def.task_index) == ("b", 3)
        assert s.server_def.protocol == "grpc"
        assert s.server_def.default_session_config.intra_op_parallelism_threads == 3
    options = ServerOptions(peer_timeout_seconds=2.5)
    with Server({"w": ["127.0.0.1:0"]}, config=options) as server:
        assert server.server_def.clusterwire_options.peer_timeout_seconds == 2.5


def test_defaults_inferred_as_tf():
    with Server({"w": {3: "127.0.0.1:0"}}) as server:  # the job's only task, sparse
        assert server.server_def.task_index == 3
        assert server.server_def.protocol == "grpc"


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(server_or_cluster_def={"a": ["h:1"], "b": ["h:2"]}), ValueError, "explicit `job_name`"),
    (dict(server_or_cluster_def={"a": ["h:1", "h:2"]}), ValueError, "explicit `task_index`"),
    (dict(server_or_cluster_def={"a": ["h:1"]}, job_name="x"), ValueError, "task_index"),
    (dict(server_or_cluster_def=42), TypeError, "Could not convert"),
    (dict(server_or_cluster_def={"a": ["h:1"]}, job_name=3), TypeError, "job_name"),
    (dict(server_or_cluster_def={"a": ["h:1"]}, task_index="0"), TypeError, "task_index"),
    (dict(server_or_cluster_def={"a": ["h:1"]}, task_index=True), TypeError, "task_index"),
    (dict(server_or_cluster_def={"a": ["h:1"]}, protocol=1), TypeError, "protocol"),
    (dict(server_or_cluster_def={"a": ["h:1"]}, config=3), TypeError, "config must be"),
    (dict(server_or_cluster_def={"a": ["h:1"]}, config={"nope": 1}), InvalidArgumentError,
     "Known options"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Server(**kwargs)


def test_job_or_task_not_in_cluster():
    server_def = ServerDef(job_name="x", task_index=0)
    server_def.cluster.job.add(name="w").tasks[0] = "127.0.0.1:0"
    with pytest.raises(InvalidArgumentError, match='Job "x" was not defined in cluster'):
        Server(server_def)
    with pytest.raises(InvalidArgumentError, match='Task 5 was not defined in job "w"'):
        Server(server_def, job_name="w", task_index=5)


def test_unknown_protocol_is_not_found_never_a_fallback():
    with pytest.raises(NotFoundError, match="No transport registered for 'grpc\\+pigeon'"):
        Server({"w": ["127.0.0.1:0"]}, protocol="grpc+pigeon")


def test_unresolvable_host_is_a_clear_error():
    with pytest.raises(UnavailableError, match="Could not bind no-such-host.invalid"):
        Server({"w": ["no-such-host.invalid:0"]})


def test_repr_and_exports():
    with Server({"w": ["127.0.0.1:0"]}) as server:
        assert "/job:w/task:0" in repr(server) and "serving" in repr(server)
    assert "stopped" in repr(server)
    assert clusterwire.ServerDef is ServerDef


def test_join_runs_signal_handlers_delivered_to_another_thread(local_server):
    """A signal the kernel hands to a non-main thread must not leave join() asleep for good."""
    import signal

    parked = threading.Event()
    other = threading.Thread(target=parked.wait, daemon=True)
    other.start()
    previous = signal.signal(
        signal.SIGUSR1, lambda *_: threading.Thread(target=local_server.stop).start())
    try:
        signal.pthread_kill(other.ident, signal.SIGUSR1)
        assert local_server.join(timeout=10)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        parked.set()
        other.join(5)
