"""A task server's metrics: counted by its listener shell and service, read back from its
status and from its /metrics endpoint over HTTP; the endpoint's protection and limits."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import fresh_python, wait_for

import clusterwire
from clusterwire import errors
from clusterwire.metrics import REGISTRY, catalog, endpoint, snapshot
from clusterwire.metrics.endpoint import serve_metrics
from clusterwire.metrics.registry import Registry, Sample
from clusterwire.protos.service_pb2 import Request
from clusterwire.rpc import RequestClient
from clusterwire.shell import Shell, listen_options
from clusterwire.testing.certs import Authority
from clusterwire.testing.peer import echo_handler
from clusterwire.transport import Frame

pytestmark = pytest.mark.timeout(60)

TOKEN = "metrics-test-token-0123456789"


def scrape(url: str, token: str | None = None, context: ssl.SSLContext | None = None,
           ) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(name, labels): value}."""
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10, context=context) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain")
        text = answer.read().decode()
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        pairs = frozenset(tuple(p.split("=", 1)) for p in labels.rstrip("}").split(",") if p)
        values[(name, frozenset((k, v.strip('"')) for k, v in pairs))] = float(value)
    return values


def value(values: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in values.items()
               if n == name and set(labels.items()) <= set(ls))


@pytest.fixture
def task_process(tmp_path):
    """A task server in its own process with a metrics endpoint; yields (target, metrics url)."""
    script = tmp_path / "task.py"
    script.write_text(
        "import sys, clusterwire\n"
        "s = clusterwire.Server({'w': ['127.0.0.1:0']}, job_name='w', task_index=0,\n"
        "                       config={'metrics_port': 0})\n"
        "print(s.target, s.metrics_url, flush=True)\n"
        "sys.stdin.read()\n"
        "s.stop()\n")
    child = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        target, url = child.stdout.readline().split()
        yield target, url
    finally:
        child.stdin.close()
        child.wait(20)


def test_the_counters_move_by_exactly_the_work_done(task_process):
    target, url = task_process
    session = clusterwire.Session(target)
    before = scrape(url)
    tensor = np.arange(1 << 17, dtype=np.float64)  # 1 MiB
    session.put("weights", tensor)
    for _ in range(10):
        np.testing.assert_array_equal(session.get("weights"), tensor)
    with pytest.raises(errors.NotFoundError):
        session.get("missing")
    after = scrape(url)
    assert value(after, "clusterwire_requests_total", method="put", code="OK") == 1
    assert value(after, "clusterwire_requests_total", method="get", code="OK") - value(
        before, "clusterwire_requests_total", method="get", code="OK") == 10
    assert value(after, "clusterwire_requests_total", method="get", code="NOT_FOUND") == 1
    assert value(after, "clusterwire_request_duration_seconds_count", method="get") == 11
    assert value(after, "clusterwire_request_duration_seconds_bucket", method="get",
                 le="+Inf") == 11
    # Bytes as sent: the tensors exactly, plus headers (a few dozen bytes a request).
    received = value(after, "clusterwire_received_bytes_total", transport="grpc") - value(
        before, "clusterwire_received_bytes_total", transport="grpc")
    sent = value(after, "clusterwire_sent_bytes_total", transport="grpc") - value(
        before, "clusterwire_sent_bytes_total", transport="grpc")
    assert tensor.nbytes <= received < tensor.nbytes + 12 * 200
    assert 10 * tensor.nbytes <= sent < 10 * tensor.nbytes + 12 * 200
    assert value(after, "clusterwire_store_bytes") == tensor.nbytes
    assert value(after, "clusterwire_store_tensors") == 1
    assert value(after, "clusterwire_serving") == 1
    assert value(after, "clusterwire_requests_in_flight") == 0
    assert value(after, "process_resident_memory_bytes") > 0  # the process collector's


def test_status_reports_the_servers_own_samples(local_server):
    session = clusterwire.Session(local_server.target)
    for _ in range(3):
        session.put("x", np.zeros(4))
    status = local_server._service.status()
    assert snapshot.total(status.metrics, "clusterwire_requests_total", method="put") == 3
    assert snapshot.total(status.metrics, "clusterwire_store_tensors") == 1
    assert {s.labels["server"] for s in status.metrics} == {"/job:local/task:0"}


def test_a_method_label_is_one_the_server_knows_never_what_a_client_sent(local_server):
    client = RequestClient("grpc", in_process=False)
    address = local_server.target.split("://")[1]
    try:
        for name in ("no-such-method", "another-invented-one"):
            with pytest.raises(errors.UnimplementedError):
                client.send(address, Request(method=name))
    finally:
        client.close()
    status = local_server._service.status()
    methods = {s.labels["method"] for s in status.metrics if "method" in s.labels}
    assert "no-such-method" not in methods
    assert snapshot.total(status.metrics, "clusterwire_requests_total", method="unknown",
                          code="UNIMPLEMENTED") == 2


def test_forwarded_requests_and_barrier_waits_are_counted():
    with clusterwire.Server({"w": ["127.0.0.1:0", "127.0.0.1:0"]}, job_name="w",
                            task_index=0) as first:
        # The second task knows the first's bound port; the first learns the second's.
        second = clusterwire.Server(first.cluster_spec.as_dict(), job_name="w", task_index=1)
        try:
            first._service.complete_cluster(second.cluster_spec)
            session = clusterwire.Session(first.target)
            session.put("v", np.ones(2), task="/job:w/task:1")
            session.get("v", task="/job:w/task:1")
            done = threading.Thread(target=clusterwire.Session(second.target).barrier,
                                    args=("b",), kwargs={"timeout": 20})
            done.start()
            session.barrier("b", timeout=20)
            done.join(20)
            status = first._service.status()
            assert snapshot.total(status.metrics, "clusterwire_forwarded_requests_total",
                                  method="put") == 1
            assert snapshot.total(status.metrics, "clusterwire_forwarded_requests_total",
                                  method="get") == 1
            # Both arrivals wait at the job's coordinator, task 0 (a session routes there).
            assert snapshot.total(status.metrics,
                                  "clusterwire_barrier_wait_seconds_count") == 2
        finally:
            second.stop()


def test_status_names_a_peer_it_could_not_reach():
    with clusterwire.Server({"w": ["127.0.0.1:0", "127.0.0.1:1"]}, job_name="w",
                            task_index=0, config={"peer_timeout_seconds": 0.3}) as server:
        session = clusterwire.Session(server.target)
        with pytest.raises(errors.UnavailableError):
            session.get("x", task="/job:w/task:1")
        status = session.status()
        [peer] = status["unreachable_peers"]
        assert peer["task"] == "/job:w/task:1"
        assert peer["address"] == "127.0.0.1:1"
        assert "127.0.0.1:1" in peer["error"]
        assert snapshot.total(server._service.status().metrics,
                              "clusterwire_unreachable_peers") == 1


def test_a_token_protects_metrics_but_not_health(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with clusterwire.Server.create_local_server(
            config={"metrics_port": 0, "auth_token_file": str(token_file)}) as server:
        url = server.metrics_url
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=10)
        assert refused.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as wrong:
            scrape(url, token="not-the-token-at-all-0000")
        assert wrong.value.code == 401
        assert value(scrape(url, token=TOKEN), "clusterwire_serving") == 1
        for path in ("/healthz", "/readyz"):
            with urllib.request.urlopen(url.replace("/metrics", path), timeout=10) as answer:
                assert answer.status == 200


def test_under_tls_the_endpoint_speaks_https_with_the_servers_certificate(tmp_path):
    authority = Authority(tmp_path)
    pair = authority.issue("server")
    with clusterwire.Server.create_local_server(config={
            "metrics_port": 0, "tls_cert_file": str(pair.cert), "tls_key_file": str(pair.key),
            "tls_ca_file": str(authority.pair.cert)}) as server:
        assert server.metrics_url.startswith("https://127.0.0.1:")
        context = ssl.create_default_context(cafile=str(authority.pair.cert))
        assert value(scrape(server.metrics_url, context=context), "clusterwire_serving") == 1
        with pytest.raises(urllib.error.URLError):  # a client that does not trust it
            urllib.request.urlopen(server.metrics_url, timeout=10)


def test_readyz_says_not_ready_while_a_server_drains():
    entered, release = threading.Event(), threading.Event()

    def slow() -> int:
        entered.set()
        release.wait(30)
        return 1

    clusterwire.remote(slow, name="metrics_test.slow")
    server = clusterwire.Server.create_local_server(config={"metrics_port": 0})
    ready = server.metrics_url.replace("/metrics", "/readyz")
    caller = threading.Thread(target=lambda: clusterwire.Session(server.target).call(
        "metrics_test.slow", timeout=30))
    stopper = threading.Thread(target=server.stop, kwargs={"grace": 30})
    try:
        with urllib.request.urlopen(ready, timeout=10) as answer:
            assert answer.read() == b"ready\n"
        caller.start()
        assert entered.wait(10)
        stopper.start()  # drains while the call holds it open

        def not_ready() -> bool:
            try:
                urllib.request.urlopen(ready, timeout=10)
            except urllib.error.HTTPError as err:
                return err.code == 503 and b"/job:local/task:0" in err.read()
            return False

        wait_for(not_ready, what="/readyz 503 naming the draining server")
        assert stopper.is_alive()
    finally:
        release.set()
        caller.join(30)
        stopper.join(30)
        server.stop()


def test_silent_connections_cannot_lock_a_scraper_out():
    with clusterwire.Server.create_local_server(config={"metrics_port": 0}) as server:
        port = int(server.metrics_url.split(":")[2].split("/")[0])
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(
            3 * endpoint.MAX_CONNECTIONS)]
        try:
            assert value(scrape(server.metrics_url), "clusterwire_serving") == 1
        finally:
            for connection in silent:
                connection.close()


def _peer(connection: socket.socket):
    try:
        return connection.getpeername()
    except OSError:  # closed meanwhile
        return None


def test_a_scrape_being_answered_is_not_closed_for_newer_connections():
    """A flood of new connections closes the oldest of those still waiting for their request,
    never one being answered (the flood cut a token holder's scrape between its headers and
    its body)."""
    rendering, release = threading.Event(), threading.Event()

    def slow_source():
        rendering.set()
        assert release.wait(30)
        return [Sample(catalog.SERVING, ("slow",), 1)]

    registry = Registry()
    registry.add_source(slow_source)
    metrics = serve_metrics(0, registry=registry)
    answers: list = []
    scraper = threading.Thread(target=lambda: answers.append(scrape(metrics.url)))
    scraper.start()
    silent = []
    try:
        assert rendering.wait(30)  # the scrape's request came: it is being answered
        silent = [socket.create_connection(("127.0.0.1", metrics.port))
                  for _ in range(3 * endpoint.MAX_CONNECTIONS)]
        last = silent[-1].getsockname()
        wait_for(lambda: any(_peer(held) == last
                             for held in list(metrics._server._open.values())), 30,
                 "the endpoint to take the flood's last connection")
    finally:
        release.set()
        scraper.join(30)
        for connection in silent:
            connection.close()
        metrics.close()
    assert [value(answer, "clusterwire_serving", server="slow") for answer in answers] == [1]


@pytest.mark.parametrize("port", [-1, 70000, "9100", True])
def test_a_bad_metrics_port_is_an_invalid_argument(port):
    with pytest.raises(errors.InvalidArgumentError, match="metrics_port must be an int"):
        serve_metrics(port)


def test_a_metrics_port_in_use_is_a_clear_error_and_the_server_does_not_start():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(errors.UnavailableError, match=f"Cannot serve metrics at 127.0.0.1:"
                                                           f"{port}.*another metrics_port"):
            clusterwire.Server.create_local_server(config={"metrics_port": port})
    finally:
        taken.close()


def test_servers_of_one_process_share_one_endpoint():
    first = clusterwire.Server.create_local_server(config={"metrics_port": 0})
    port = int(first.metrics_url.split(":")[2].split("/")[0])
    second = clusterwire.Server({"other": ["127.0.0.1:0"]}, job_name="other", task_index=0,
                                config={"metrics_port": port})
    try:
        assert second.metrics_url == first.metrics_url
        servers = {dict(labels).get("server") for (name, labels) in scrape(first.metrics_url)
                   if name == "clusterwire_serving"}
        assert servers == {"/job:local/task:0", "/job:other/task:0"}
        first.stop()
        assert {dict(labels).get("server") for (name, labels) in scrape(second.metrics_url)
                if name == "clusterwire_serving"} == {"/job:other/task:0"}
    finally:
        first.stop()
        second.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(first.metrics_url, timeout=5)


def test_recording_can_be_turned_off_and_the_catalog_names_follow_prometheus():
    counted = fresh_python(
        "import os, json; os.environ['CLUSTERWIRE_METRICS'] = '0'\n"
        "import clusterwire, numpy as np\n"
        "from clusterwire.metrics import REGISTRY\n"
        "s = clusterwire.Server.create_local_server()\n"
        "clusterwire.Session(s.target).put('x', np.zeros(1))\n"
        "print(json.dumps(sorted({x.metric.name for x in REGISTRY.samples()})))\n"
        "s.stop()\n")
    names = json.loads(counted)
    assert "clusterwire_requests_total" not in names and "clusterwire_store_bytes" in names
    for metric in catalog.CATALOG:
        assert metric.name.startswith("clusterwire_")
        assert metric.name.endswith("_total") == (metric.kind == "counter"), metric.name
        assert not {"address", "client", "tensor", "name", "peer"} & set(metric.labels)


COUNTING = [p for p in ("grpc+local", "grpc+verbs", "zmq")
            if p in clusterwire.plugins.get_plugin_manager().protocols()]


@pytest.mark.parametrize("protocol", COUNTING)
def test_transports_that_count_connections_report_them(protocol):
    shell = Shell(protocol, "127.0.0.1:0", echo_handler, "connections test", listen_options())
    shell.start()
    channels = [shell.transport.connect(shell.address) for _ in range(3)]
    try:
        for channel in channels:
            assert channel.call(Frame(b"hello", []), 10).header == b"hello"
        samples = [s for s in REGISTRY.samples(server="connections test")
                   if s.metric is catalog.CONNECTIONS]
        assert [(s.labels, s.value) for s in samples] == [(("connections test", protocol), 3)]
    finally:
        for channel in channels:
            channel.close()
        shell.stop()


def test_no_extra_is_imported_until_an_endpoint_serves():
    imported = fresh_python(
        "import sys, clusterwire, clusterwire.data, clusterwire.metrics\n"
        "server = clusterwire.Server.create_local_server()\n"
        "clusterwire.Session(server.target).status()\n"
        "server.stop()\n"
        "print(sorted(m for m in ('prometheus_client', 'rich') if m in sys.modules))")
    assert imported.strip() == "[]"


@pytest.mark.parametrize("error", [BrokenPipeError(32, "Broken pipe"),
                                   ConnectionResetError(104, "reset"), TimeoutError("silent")])
def test_a_client_that_hangs_up_mid_answer_is_no_traceback(error, capsys, caplog):
    # Seen under a flood on a busy machine: a scrape that gave up before the answer was
    # written made the endpoint print a BrokenPipeError traceback to stderr.
    metrics = serve_metrics(0)
    try:
        try:
            raise error
        except OSError:
            metrics._server.handle_error(None, ("127.0.0.1", 1))
    finally:
        metrics.close()
    assert capsys.readouterr().err == "" and not caplog.records
