"""The surface kit (``clusterwire.testing.SurfaceSuite``) run against every server surface:
a task server over grpc (and its requests over grpc+local), its metrics endpoint, an elastic
task's membership requests, a data-service dispatcher and worker, each in its own process
with the cluster token set."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import urllib.request
from unittest import mock

import numpy as np
import pytest
from conftest import free_ports
from cw_data_procs import ServerProcess

import clusterwire
from clusterwire import cli, data, errors
from clusterwire.data.rpc import DispatcherClient
from clusterwire.plugins import get_plugin_manager
from clusterwire.protos import data_service_pb2 as pb
from clusterwire.protos.cluster_pb2 import ClusterDef, JobDef
from clusterwire.protos.service_pb2 import Request, Response, TaskRef, TaskStatus, Value
from clusterwire.security import Security
from clusterwire.testing import (
    HOSTILE_STRINGS,
    TCP_FLOODS,
    Surface,
    SurfaceSuite,
    assert_terminal_safe,
    malformed_variants,
)
from clusterwire.transport import Frame, ListenOptions

pytestmark = pytest.mark.timeout(120)

TOKEN = b"surface-kit-token-0123456789abcdef"
ENV = {"CLUSTERWIRE_AUTH_TOKEN": TOKEN.decode()}
_made = itertools.count()  # every operation makes something new


@pytest.fixture(scope="module")
def client_config(tmp_path_factory) -> dict[str, str]:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_bytes(TOKEN)
    return {"auth_token_file": str(path)}


@pytest.fixture(scope="module")
def metrics_port() -> int:
    [port] = free_ports(1)
    return port


@pytest.fixture(scope="module")
def task_process(metrics_port):
    """One task with a metrics endpoint at ``metrics_port`` (and
    ``clusterwire.testing.load.echo``), token set."""
    process = ServerProcess(
        "serve", "--cluster", json.dumps({"w": ["127.0.0.1:0"]}), "--job-name", "w",
        "--task-index", "0", "--import", "clusterwire.testing.load",
        "--config", json.dumps({"metrics_port": metrics_port}), env=ENV)
    yield process
    process.close()


def _small_get(target: str, config: dict[str, str]) -> None:
    key = f"k{next(_made)}"
    with clusterwire.Session(target, config=config, timeout=10) as session:
        session.put(key, np.array([next(_made)], np.int64))
        assert session.get(key).nbytes == 8
        session.delete(key)


def _printed(*commands: list[str]) -> str:
    """What ``clusterwire COMMAND...`` prints for each command (stdout and stderr; a pipe's
    rendering, without styles), with the cluster token in the environment."""
    out = io.StringIO()
    with mock.patch.dict(os.environ, ENV), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out):
        for command in commands:
            cli.main(command)
    return out.getvalue()


def _task_show(text: str) -> str:
    """``top --once`` and ``status --all`` pointed at a hostile server: it answers as task 0
    of a cluster whose task 1 is at ``text``:1, unreachable with the error ``text``."""
    listener = get_plugin_manager().transport("grpc").listen(
        "127.0.0.1:0", lambda frame: Frame(reply.SerializeToString(), []), ListenOptions())
    reply = Response(task_status=TaskStatus(task=TaskRef(job="w", index=0), protocol="grpc",
                                            version=text))
    job = reply.task_status.cluster.job.add(name="w")
    job.tasks[0], job.tasks[1] = listener.address, f"{text}:1"
    reply.task_status.unreachable_peers.add(task=TaskRef(job="w", index=1),
                                            address=f"{text}:1", error=text)
    listener.start()
    try:
        target = f"grpc://{listener.address}"
        return _printed(["top", target, "--once", "--interval", "0.05", "--timeout", "0.2"],
                        ["status", target, "--all", "--timeout", "0.2"])
    finally:
        listener.stop(0)


_STATUS = Request(method="status")
_PUT = Request(method="put", name="surface", value=Value(int_value=7))
_CALL = Request(method="call", name="clusterwire.testing.load.echo",
                value=Value(list_value={"items": [Value(int_value=1)]}))
_TASK_REQUESTS = (
    _STATUS, _PUT, Request(method="get", name="surface"), Request(method="list"),
    Request(method="delete", name="surface"), _CALL,
    Request(method="get", name="surface", task=TaskRef(job="w", index=0), has_task=True,
            hops=1),
)


class TestTaskServer(SurfaceSuite):

    @pytest.fixture(scope="class")
    def surface(self, task_process, client_config) -> Surface:
        return Surface(
            "task server", task_process.address, task_process.process.pid,
            {"8-byte put and get": lambda: _small_get(task_process.target, client_config)},
            TOKEN, requests=_TASK_REQUESTS, response_type=Response, show=_task_show,
            log=task_process.stderr)


@pytest.fixture(scope="module")
def local_task():
    """A grpc+local task (its requests over the Unix socket), token set."""
    process = ServerProcess(
        "serve", "--cluster", json.dumps({"w": ["127.0.0.1:0"]}), "--job-name", "w",
        "--task-index", "0", "--protocol", "grpc+local", "--import",
        "clusterwire.testing.load", env=ENV)
    yield process
    process.close()


class TestLocalTaskServer(SurfaceSuite):
    """The same requests over grpc+local's Unix socket; its gRPC port is the one
    TestTaskServer floods; a task prints nothing TestTaskServer's check does not."""

    floods = ()
    prints_strings = False

    @pytest.fixture(scope="class")
    def surface(self, local_task, client_config) -> Surface:
        return Surface(
            "grpc+local task", local_task.address, local_task.process.pid,
            {"8-byte put and get": lambda: _small_get(local_task.target, client_config)},
            TOKEN, protocol="grpc+local", requests=_TASK_REQUESTS, response_type=Response,
            log=local_task.stderr)


@pytest.fixture(scope="module")
def elastic_task():
    """A task that takes membership changes, with heartbeats, token set."""
    process = ServerProcess(
        "serve", "--cluster", json.dumps({"w": ["127.0.0.1:0"]}), "--job-name", "w",
        "--task-index", "0", "--allow-membership-changes", "--config", json.dumps(
            {"membership_heartbeat_seconds": 0.25, "membership_timeout_seconds": 1.0}),
        env=ENV)
    yield process
    process.close()


def _status(target: str, config: dict[str, str]) -> None:
    with clusterwire.Session(target, config=config, timeout=10) as session:
        status = session.status()
        assert (status["job"], status["task_index"]) == ("w", 0)


class TestMembership(SurfaceSuite):
    """Heartbeats and membership changes from a token holder; the task's port is flooded by
    TestTaskServer already; its strings print as TestTaskServer's do."""

    floods = ()
    prints_strings = False

    @pytest.fixture(scope="class")
    def surface(self, elastic_task, client_config) -> Surface:
        cluster = ClusterDef(job=[JobDef(name="w", tasks={0: elastic_task.address})])
        return Surface(
            "elastic task", elastic_task.address, elastic_task.process.pid,
            {"8-byte put and get": lambda: _small_get(elastic_task.target, client_config),
             "status": lambda: _status(elastic_task.target, client_config)},
            TOKEN, requests=(
                Request(method="heartbeat", membership_version=1,
                        from_task=TaskRef(job="w", index=0), cluster=cluster),
                Request(method="update_cluster", cluster=cluster)),
            response_type=Response, log=elastic_task.stderr)


def _scrape(url: str) -> None:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN.decode()}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert b"clusterwire_serving" in answer.read()


class TestMetricsEndpoint(SurfaceSuite):
    """An HTTP port: the floods of any TCP port; no clusterwire requests, nothing printed."""

    floods = TCP_FLOODS
    takes_requests = False
    prints_strings = False

    @pytest.fixture(scope="class")
    def surface(self, task_process, metrics_port) -> Surface:
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        return Surface(
            "metrics endpoint", f"127.0.0.1:{metrics_port}", task_process.process.pid,
            {"scrape": lambda: _scrape(url)}, TOKEN, log=task_process.stderr)


@pytest.fixture(scope="module")
def data_service(client_config):
    """A dispatcher and a worker process, token set, and a dataset registered."""
    dispatcher = ServerProcess("dispatcher", env=ENV)
    try:
        worker = ServerProcess("worker", "--dispatcher-address", dispatcher.address, env=ENV)
    except BaseException:
        dispatcher.close()
        raise
    try:
        dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(10),
                                           config=client_config)
        yield dispatcher, worker, dataset_id
    finally:
        worker.close()
        dispatcher.close()


def _data_operations(target: str, config: dict[str, str]) -> dict:
    def new_dataset() -> None:
        data.register_dataset(target, data.Dataset.range(100 + next(_made)), config=config)

    def new_job_and_read() -> None:
        read = data.Dataset.range(4).apply(data.distribute(
            "parallel_epochs", target, job_name=f"surface{next(_made)}", config=config))
        assert sorted(int(x) for x in read) == [0, 1, 2, 3]

    return {"new dataset": new_dataset, "new job and read": new_job_and_read}


def _dispatcher_requests(dataset_id: str) -> tuple:
    definition, _ = data.graph.to_def(data.Dataset.range(3).pipeline)
    return tuple(pb.DataRequest(**kind) for kind in (
        {"register_dataset": pb.RegisterDatasetRequest(dataset=definition)},
        {"get_dataset": pb.GetDatasetRequest(dataset_id=dataset_id)},
        {"get_or_create_job": pb.GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.DYNAMIC,
            job_key="hostile/0", named=True, consumer_id="c")},
        {"client_heartbeat": pb.ClientHeartbeatRequest(job_id=1, consumer_id="c")},
        {"get_split": pb.GetSplitRequest(job_id=1, consumer_id="c", held=[1], done=[2])},
    ))


def _dispatcher_show(text: str, config: dict[str, str]) -> str:
    """``top --dispatcher --once`` of a dispatcher with a job named ``text`` (or what a
    client prints if the dispatcher refuses the name)."""
    refused = ""
    with data.DispatchServer(data.DispatcherConfig(bind_address="127.0.0.1", **config)
                             ) as dispatcher:
        address = dispatcher.target.split("://")[1]
        dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(3),
                                           config=config)
        client = DispatcherClient("grpc", address, 10.0, Security(token=TOKEN))
        try:
            client.call(pb.DataRequest(get_or_create_job=pb.GetOrCreateJobRequest(
                dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.OFF,
                job_key=f"{text}/0", named=True)))
        except errors.OpError as err:
            refused = f"{type(err).__name__}: {err}\n"
        finally:
            client.close()
        return refused + _printed(["top", "--dispatcher", address, "--once", "--interval",
                                   "0.05", "--timeout", "2"])


class TestDispatcher(SurfaceSuite):

    @pytest.fixture(scope="class")
    def surface(self, data_service, client_config) -> Surface:
        dispatcher, _, dataset_id = data_service

        return Surface(
            "dispatcher", dispatcher.address, dispatcher.process.pid,
            _data_operations(dispatcher.target, client_config), TOKEN,
            requests=_dispatcher_requests(dataset_id), response_type=pb.DataResponse,
            show=lambda text: _dispatcher_show(text, client_config), log=dispatcher.stderr)


class TestWorker(SurfaceSuite):
    """A worker's names and errors are shown by the dispatcher's top (TestDispatcher)."""

    prints_strings = False

    @pytest.fixture(scope="class")
    def surface(self, data_service, client_config) -> Surface:
        dispatcher, worker, dataset_id = data_service
        client = DispatcherClient("grpc", dispatcher.address, 10.0, Security(token=TOKEN))
        try:
            job, _ = client.call(pb.DataRequest(get_or_create_job=pb.GetOrCreateJobRequest(
                dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.DYNAMIC,
                job_key="worker-surface/0", named=True)))
            split, _ = client.call(pb.DataRequest(get_split=pb.GetSplitRequest(
                job_id=job.job.job_id, consumer_id="alice")))
        finally:
            client.close()
        granted = split.get_split.split
        spec = pb.StreamSpec(job_id=job.job.job_id, dataset_id=dataset_id, is_split=True,
                             split_id=granted.split_id, unit_start=granted.unit_start,
                             unit_end=granted.unit_end, grant=granted.grant, attempt=1)
        read = pb.DataRequest(get_elements=pb.GetElementsRequest(
            stream=spec, consumer_id="alice", request_seq=1, max_elements=2,
            wait_seconds=0.1))
        return Surface(
            "worker", worker.address, worker.process.pid,
            _data_operations(dispatcher.target, client_config), TOKEN,
            requests=(read,), response_type=pb.DataResponse, log=worker.stderr)


# -- the kit's own checks ---------------------------------------------------------------

@pytest.mark.parametrize("text", [s for s in HOSTILE_STRINGS if not s.isprintable()])
def test_assert_terminal_safe_refuses_every_hostile_control(text):
    with pytest.raises(AssertionError, match="raw control character"):
        assert_terminal_safe(f"job {text} done\n")


def test_assert_terminal_safe_lets_text_through():
    assert_terminal_safe("job [/pwned] \\x1b]0; x\tε ✓\n")
    assert_terminal_safe("progress\r\n", allow_cr=True)
    with pytest.raises(AssertionError, match="'\\\\r'"):
        assert_terminal_safe("progress\r\n")


def test_malformed_variants_cover_every_field_kind():
    request = pb.DataRequest(get_split=pb.GetSplitRequest(job_id=5, consumer_id="c",
                                                          held=[1]))
    variants = dict(malformed_variants(request))
    for what in ("get_split.job_id=-9223372036854775808", "get_split.job_id=9223372036854775807",
                 "get_split.consumer_id=1 MiB", "get_split.held=65536 x 9223372036854775807",
                 "get_split as the wrong wire type"):
        assert what in variants, sorted(variants)
    assert len(pb.DataRequest.FromString(variants["get_split.consumer_id=1 MiB"])
               .get_split.consumer_id) == 1 << 20
    assert len(pb.DataRequest.FromString(variants["get_split.held=65536 x -1"]).get_split.held) \
        == 1 + (1 << 16)
    assert Request.FromString(dict(malformed_variants(Request(method="put")))[
        "hops=4294967295"]).hops == (1 << 32) - 1
    cluster = Request(method="heartbeat")
    cluster.cluster.job.add(name="w").tasks[0] = "127.0.0.1:1"
    tasks = Request.FromString(dict(malformed_variants(cluster))[
        "cluster.job.0.tasks[2147483647]"]).cluster.job[0].tasks
    assert dict(tasks) == {0: "127.0.0.1:1", (1 << 31) - 1: "127.0.0.1:1"}
