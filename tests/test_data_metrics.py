"""The data service's metrics: what a dispatcher, a worker and a consumer count, read back
over HTTP from /metrics and from service_status(); series that go with their job and their
server; the endpoint's protection; the CLI's --metrics-port."""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import in_process_data_service, wait_for
from prometheus_client.parser import text_string_to_metric_families

from clusterwire import data, errors
from clusterwire.data import dispatcher as dispatcher_module
from clusterwire.data import rpc
from clusterwire.data.cli import await_ready
from clusterwire.data.journal import JOURNAL_DIR, JOURNAL_FILE
from clusterwire.metrics import REGISTRY
from clusterwire.metrics.endpoint import serve_metrics
from clusterwire.plugins import get_plugin_manager
from clusterwire.protos.data_service_pb2 import DataRequest, GetElementsRequest
from clusterwire.security import Security
from clusterwire.transport import Frame

pytestmark = pytest.mark.timeout(60)

N = 300
ROW = 256  # int64s: 2 KiB elements
TOKEN = "data-metrics-test-token-0123456789"


def scrape(url: str, token: str | None = None) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, labels): value}."""
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(values: dict, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in values.items()
               if n == name and set(labels.items()) <= set(ls))


def series(name: str, server: str) -> list:
    """The process's samples of metric ``name`` labelled ``server``."""
    return [s for s in REGISTRY.samples(server=server) if s.metric.name == name]


class Calls:
    """Counts the requests of each kind this process sends to workers and dispatchers (its
    consumers', and its workers' to their dispatcher) and the splits dispatchers hand out."""

    def __init__(self, monkeypatch):
        self.kinds: dict[str, int] = {}
        self.splits = 0
        worker_call, dispatcher_call = rpc.WorkerChannels.call, rpc.DispatcherClient.call

        def to_worker(channels, protocol, address, request, timeout):
            self._count(request)
            return worker_call(channels, protocol, address, request, timeout)

        def to_dispatcher(client, request, buffers=()):
            response, received = dispatcher_call(client, request, buffers)
            self._count(request)
            self.splits += response.get_split.has_split
            return response, received

        monkeypatch.setattr(rpc.WorkerChannels, "call", to_worker)
        monkeypatch.setattr(rpc.DispatcherClient, "call", to_dispatcher)

    def _count(self, request: DataRequest) -> None:
        kind = request.WhichOneof("kind")
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


@pytest.fixture
def service():
    """An in-process dispatcher and one worker, each with a metrics endpoint."""
    dispatcher = data.DispatchServer(data.DispatcherConfig(bind_address="127.0.0.1",
                                                           metrics_port=0))
    worker = None
    try:
        worker = data.WorkerServer(data.WorkerConfig(
            dispatcher_address=dispatcher.target.split("://")[1],
            worker_address="127.0.0.1:%port%", metrics_port=0))
        wait_for(lambda: dispatcher.num_workers() == 1, what="the worker")
        yield dispatcher, worker
    finally:
        if worker is not None:
            worker.stop()
        dispatcher.stop()


def rows(count: int = N) -> data.Dataset:
    return data.Dataset.from_tensor_slices(np.arange(count * ROW, dtype=np.int64).reshape(
        count, ROW))


def test_the_counters_move_by_exactly_the_work_done(service, monkeypatch):
    dispatcher, worker = service
    training = serve_metrics(0)  # what a training process exports
    try:
        before = scrape(training.url)
        calls = Calls(monkeypatch)
        dataset = rows().apply(data.distribute("distributed_epoch", dispatcher.target,
                                               job_name="metrics", compression=None))
        iterator = iter(dataset)
        read = [x for x in iterator]
        assert len(read) == N
        after = scrape(training.url)
    finally:
        training.close()
    waits = "clusterwire_data_consumer_wait_seconds"
    assert value(after, f"{waits}_count") - value(before, f"{waits}_count") == N
    assert value(after, f"{waits}_bucket", le="+Inf") - value(
        before, f"{waits}_bucket", le="+Inf") == N

    [job] = data.service_status(dispatcher.target).jobs
    job_id = str(job.job_id)
    at_worker = scrape(worker.metrics_url)
    mine = {"server": worker.metrics_name}
    assert value(at_worker, "clusterwire_data_elements_total", job_id=job_id, **mine) == N
    assert value(at_worker, "clusterwire_data_element_bytes_total", job_id=job_id,
                 **mine) == N * ROW * 8
    assert value(at_worker, "clusterwire_requests_total", method="get_elements",
                 **mine) == calls.kinds["get_elements"]
    assert value(at_worker, "clusterwire_requests_total", method="get_elements", code="OK",
                 **mine) == calls.kinds["get_elements"]
    # What the shell sent: the elements exactly, plus headers (a few dozen bytes an element).
    sent = value(at_worker, "clusterwire_sent_bytes_total", **mine)
    assert N * ROW * 8 < sent < N * ROW * 8 + 32 * N + 200 * calls.kinds["get_elements"]
    assert value(at_worker, "clusterwire_data_buffered_elements", **mine) == 0

    at_dispatcher = scrape(dispatcher.metrics_url)
    ours = {"server": dispatcher.metrics_name}
    assert value(at_dispatcher, "clusterwire_data_workers", **ours) == 1
    assert value(at_dispatcher, "clusterwire_data_worker_heartbeats_total", **ours) >= 1
    assert value(at_dispatcher, "clusterwire_data_jobs", **ours) == 1
    assert calls.splits > 1
    assert value(at_dispatcher, "clusterwire_data_splits_handed_total", job_id=job_id,
                 **ours) == calls.splits == job.splits_handed
    assert value(at_dispatcher, "clusterwire_data_splits_completed_total", job_id=job_id,
                 **ours) == calls.splits == job.splits_completed
    assert value(at_dispatcher, "clusterwire_data_journal_bytes", **ours) == 0
    for kind in ("get_split", "get_or_create_job", "register_dataset"):
        assert value(at_dispatcher, "clusterwire_requests_total", method=kind,
                     **ours) == calls.kinds[kind]
    iterator.close()


def test_service_status_of_a_dispatcher_and_a_worker(service):
    dispatcher, worker = service
    dataset = rows(10).apply(data.distribute("parallel_epochs", dispatcher.target,
                                             job_name="status"))
    iterator = iter(dataset)
    assert len([x for x in iterator]) == 10

    status = data.service_status(dispatcher.target.split("://")[1], "grpc")
    assert (status.kind, status.address, status.protocol) == (
        "dispatcher", dispatcher.target.split("://")[1], "grpc")
    assert status.version == __import__("clusterwire").__version__
    assert {s.labels["server"] for s in status.metrics} == {dispatcher.metrics_name}
    [summary] = status.workers
    assert summary.address == worker.address and 0 <= summary.heartbeat_age_seconds < 60
    [job] = status.jobs
    assert (job.job_name, job.processing_mode, job.finished) == ("status", "parallel_epochs",
                                                                 True)
    assert job.dataset_id and job.job_id > 0
    assert (job.splits_handed, job.splits_completed) == (0, 0)
    # The answers before this one, each counted once its response was ready.
    again = data.service_status(dispatcher.target)
    assert sum(s.value for s in again.metrics if s.name == "clusterwire_requests_total"
               and s.labels["method"] == "get_status") == 1

    at_worker = data.service_status(f"grpc://{worker.address}")
    assert (at_worker.kind, at_worker.address, at_worker.protocol) == (
        "worker", worker.address, "grpc")
    assert not at_worker.workers and not at_worker.jobs
    assert {s.labels["server"] for s in at_worker.metrics} == {worker.metrics_name}
    assert sum(s.value for s in at_worker.metrics
               if s.name == "clusterwire_data_elements_total") == 10
    iterator.close()


def test_a_method_label_never_comes_from_a_malformed_request(service):
    dispatcher, _ = service
    channel = get_plugin_manager().transport("grpc").connect(
        dispatcher.target.split("://")[1], Security())
    try:
        with pytest.raises(errors.InvalidArgumentError, match="Malformed request header"):
            rpc.parse(channel.call(Frame(b"\xff\xff\xff", []), timeout=10))
        # A worker's request sent to the dispatcher: named, and refused.
        with pytest.raises(errors.UnimplementedError):
            rpc.parse(channel.call(Frame(DataRequest(
                get_elements=GetElementsRequest()).SerializeToString(), []), timeout=10))
    finally:
        channel.close()
    requests = {s.labels: s.value
                for s in series("clusterwire_requests_total", dispatcher.metrics_name)}
    assert requests[(dispatcher.metrics_name, "unknown", "INVALID_ARGUMENT")] == 1
    assert requests[(dispatcher.metrics_name, "get_elements", "UNIMPLEMENTED")] == 1


def test_series_go_with_their_job_and_with_their_server():
    dispatcher = data.DispatchServer(data.DispatcherConfig(
        bind_address="127.0.0.1", job_gc_check_interval_ms=50, job_gc_timeout_ms=200))
    worker = data.WorkerServer(data.WorkerConfig(
        dispatcher_address=dispatcher.target.split("://")[1],
        worker_address="127.0.0.1:%port%", heartbeat_interval_ms=50))
    try:
        wait_for(lambda: dispatcher.num_workers() == 1, what="the worker")
        iterator = iter(rows(20).apply(data.distribute("distributed_epoch", dispatcher.target,
                                                       job_name="collected")))
        assert len(list(iterator)) == 20
        name, at_worker = dispatcher.metrics_name, worker.metrics_name
        assert len(series("clusterwire_data_splits_handed_total", name)) == 1
        assert len(series("clusterwire_data_elements_total", at_worker)) == 1
        iterator.close()
        wait_for(lambda: dispatcher.num_jobs() == 0, what="the job's collection")
        assert series("clusterwire_data_splits_handed_total", name) == []
        assert series("clusterwire_data_splits_completed_total", name) == []
        wait_for(lambda: not series("clusterwire_data_elements_total", at_worker)
                 and not series("clusterwire_data_element_bytes_total", at_worker),
                 what="the worker dropping the job's series")
        assert series("clusterwire_data_jobs", name)[0].value == 0
    finally:
        worker.stop()
        dispatcher.stop()
    assert REGISTRY.samples(server=name) == []
    assert REGISTRY.samples(server=at_worker) == []


def test_servers_of_one_process_have_names_of_their_own():
    with in_process_data_service(workers=2) as dispatcher:
        assert dispatcher.metrics_url is None
        status = data.service_status(dispatcher.target)
        names = {data.service_status(w.address).metrics[0].labels["server"]
                 for w in status.workers}
        assert len(names) == 2 and all(re.fullmatch(r"data-worker(-\d+)?", n) for n in names)
    address = dispatcher.target.split("://")[1]
    first = data.WorkerServer(data.WorkerConfig(dispatcher_address=address), start=False)
    first.stop()
    second = data.WorkerServer(data.WorkerConfig(dispatcher_address=address), start=False)
    second.stop()
    assert first.metrics_name == second.metrics_name  # the stopped server's name was freed


def test_a_data_transfer_listener_counts_its_own_requests():
    with in_process_data_service(workers=1, data_transfer_protocol="grpc+local") as dispatcher:
        assert len(list(rows(10).apply(data.distribute(
            "parallel_epochs", dispatcher.target, data_transfer_protocol="grpc+local")))) == 10
        [summary] = data.service_status(dispatcher.target).workers
        status = data.service_status(summary.address)
    served = {s.labels["server"]: s.value for s in status.metrics
              if s.name == "clusterwire_requests_total" and s.labels["method"] == "get_elements"}
    assert set(served) == {"data-worker/transfer"} and served["data-worker/transfer"] >= 1


def test_the_journal_gauge_is_the_journals_size(tmp_path):
    config = data.DispatcherConfig(bind_address="127.0.0.1", fault_tolerant_mode=True,
                                   work_dir=str(tmp_path))
    with data.DispatchServer(config) as dispatcher:
        data.register_dataset(dispatcher.target, rows(4))
        [gauge] = series("clusterwire_data_journal_bytes", dispatcher.metrics_name)
        assert gauge.value == os.path.getsize(tmp_path / JOURNAL_DIR / JOURNAL_FILE) > 0


def test_split_counts_survive_a_restart_of_a_fault_tolerant_dispatcher(tmp_path,
                                                                        monkeypatch):
    monkeypatch.setattr(dispatcher_module, "_COMPACT_SLACK", 5)  # compacted while read
    config = data.DispatcherConfig(bind_address="127.0.0.1", fault_tolerant_mode=True,
                                   work_dir=str(tmp_path))
    with data.DispatchServer(config) as dispatcher:
        with data.WorkerServer(data.WorkerConfig(
                dispatcher_address=dispatcher.target.split("://")[1],
                worker_address="127.0.0.1:%port%")):
            iterator = iter(rows().apply(data.distribute(
                "distributed_epoch", dispatcher.target, job_name="restarted")))
            assert len(list(iterator)) == N
            [job] = data.service_status(dispatcher.target).jobs
            assert job.splits_handed == job.splits_completed > 5
        port = dispatcher.config.port
    with data.DispatchServer(config._replace(port=port)) as restarted:
        [again] = data.service_status(restarted.target).jobs
        assert (again.job_id, again.splits_handed, again.splits_completed) == (
            job.job_id, job.splits_handed, job.splits_completed)
        handed = series("clusterwire_data_splits_handed_total", restarted.metrics_name)
        assert [(s.labels[1], s.value) for s in handed] == [(str(job.job_id),
                                                             job.splits_handed)]
    iterator.close()


def test_a_token_protected_dispatcher_asks_for_its_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with data.DispatchServer(data.DispatcherConfig(
            bind_address="127.0.0.1", metrics_port=0,
            auth_token_file=str(token_file))) as dispatcher:
        with pytest.raises(urllib.error.HTTPError) as refused:
            scrape(dispatcher.metrics_url)
        assert refused.value.code == 401
        refused.value.close()
        with pytest.raises(urllib.error.HTTPError) as wrong:
            scrape(dispatcher.metrics_url, token="not-the-token-000000000000000")
        assert wrong.value.code == 401
        wrong.value.close()
        scraped = scrape(dispatcher.metrics_url, token=TOKEN)
        assert value(scraped, "clusterwire_data_workers", server=dispatcher.metrics_name) == 0
        with pytest.raises(errors.UnauthenticatedError):
            data.service_status(dispatcher.target, timeout=5)
        status = data.service_status(dispatcher.target, security=Security(token=TOKEN))
        assert status.kind == "dispatcher"


def test_metrics_options_are_checked():
    with pytest.raises(ValueError, match="`metrics_port` must be an int in 0..65535"):
        data.DispatcherConfig(metrics_port=70000)
    with pytest.raises(ValueError, match="`metrics_port`"):
        data.WorkerConfig(dispatcher_address="localhost:1", metrics_port=True)
    with pytest.raises(ValueError, match="`metrics_host` must be a non-empty string"):
        data.WorkerConfig(dispatcher_address="localhost:1", metrics_host=7)
    config = data.WorkerConfig(dispatcher_address="localhost:1", metrics_port=0)
    assert (config.metrics_port, config.metrics_host) == (0, "127.0.0.1")
    assert data.DispatcherConfig().metrics_port is None


@pytest.mark.parametrize("kind", ["dispatcher", "worker"])
def test_a_taken_metrics_port_fails_the_server_and_frees_what_it_took(kind):
    def server(**config):
        if kind == "dispatcher":
            return data.DispatchServer(data.DispatcherConfig(**config), start=False)
        return data.WorkerServer(data.WorkerConfig(dispatcher_address="127.0.0.1:1", **config),
                                 start=False)

    first = server()
    name = first.metrics_name
    first.stop()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(errors.UnavailableError, match="Cannot serve metrics at"):
            server(metrics_port=taken.getsockname()[1])
    again = server()
    again.stop()
    assert again.metrics_name == name


def test_service_status_of_nothing_is_unavailable():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"
    with pytest.raises(errors.UnavailableError):
        data.service_status(address, timeout=1)


def _banner(process: subprocess.Popen, timeout: float) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(process.stderr, selectors.EVENT_READ)
        if selector.select(timeout):
            return process.stderr.readline()
    return ""


def test_the_cli_dispatcher_serves_metrics_at_the_port_in_its_banner():
    process = subprocess.Popen(
        [sys.executable, "-m", "clusterwire", "dispatcher", "--port", "0", "--bind-address",
         "127.0.0.1", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        target = await_ready(process, 30)
        assert target is not None, process.stderr.read() if process.poll() is not None else ""
        banner = _banner(process, 10)
        assert banner.startswith(f"clusterwire: tf.data service dispatcher serving at {target}, "
                                 "metrics at http://127.0.0.1:"), banner
        url = banner.rsplit(" ", 1)[1].strip()
        assert url.endswith("/metrics") and int(url.split(":")[2].split("/")[0]) > 0
        scraped = scrape(url)
        assert value(scraped, "clusterwire_data_workers", server="data-dispatcher") == 0
        assert value(scraped, "clusterwire_serving", server="data-dispatcher") == 1
        status = data.service_status(target)
        assert status.kind == "dispatcher" and f"grpc://{status.address}" == target
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
        process.stdout.close()
        process.stderr.close()


def test_the_cli_refuses_a_metrics_host_without_a_port():
    done = subprocess.run(
        [sys.executable, "-m", "clusterwire", "worker", "--dispatcher-address", "127.0.0.1:1",
         "--metrics-host", "127.0.0.1"], capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert "--metrics-host without --metrics-port" in done.stderr
