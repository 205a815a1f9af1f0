"""A standby dispatcher: the work_dir's lease, the takeover when the primary is SIGKILLed,
workers and clients given both addresses, and the refusals (a second primary, a standby
without a journal, malformed address lists)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter

import cw_data_functions as fns
import grpc
import pytest
from conftest import wait_for
from cw_data_procs import ServerProcess
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clusterwire import data, errors, top
from clusterwire.data import worker_auth
from clusterwire.data.cli import await_ready
from clusterwire.data.journal import JOURNAL_DIR, JOURNAL_FILE
from clusterwire.data.rpc import DispatcherClient
from clusterwire.security import Security
from clusterwire.testing.ports import free_ports

#: What the test allows between two elements across a takeover (a busy CI machine); the
#: target, measured by bench/bench_standby.py, is 5 s.
MAX_GAP_S = 30.0


def ft_args(work_dir: str) -> list[str]:
    return ["--fault-tolerant-mode", "--work-dir", work_dir, "--bind-address", "127.0.0.1"]


def start_standby(processes, work_dir: str) -> tuple[ServerProcess, str]:
    """A standby process on a free port of its own, once it says it stands by; its
    address. Another port if another process took the free one first."""
    for _ in range(3):
        [port] = free_ports(1)
        standby = processes("dispatcher", "--port", str(port), "--standby",
                            *ft_args(work_dir), ready=False)
        wait_for(lambda started=standby: "standing by" in started.stderr()
                 or started.process.poll() is not None, 30, "the standby to stand by")
        if standby.process.poll() is None:
            return standby, f"127.0.0.1:{port}"
        assert "in use" in standby.stderr(), standby.stderr()
    pytest.fail(f"no free port for the standby: {standby.stderr()}")


def takes_over(standby: ServerProcess) -> str:
    """The standby's target, from the ready line it prints once it serves."""
    target = await_ready(standby.process, 30)
    assert target is not None, standby.stderr()
    return target


def workers_of(addresses: str, processes, count: int, env: dict[str, str] | None = None):
    return [processes("worker", "--dispatcher-address", addresses, "--heartbeat-interval-ms",
                      "200", "--worker-address", "127.0.0.1:%port%", "--import",
                      "cw_data_functions", env=env) for _ in range(count)]


@pytest.mark.timeout(120)
def test_a_sigkilled_primary_is_taken_over_and_every_element_arrives_once(processes, tmp_path):
    """The headline: 2 workers and a distributed_epoch client given both addresses; the
    primary SIGKILLed a quarter way through; the standby replays the journal and serves:
    every element exactly once, and the client's longest wait between two elements is
    bounded."""
    work_dir = str(tmp_path / "work")
    primary = processes("dispatcher", "--port", "0", *ft_args(work_dir))
    standby, standby_address = start_standby(processes, work_dir)
    both = f"{primary.address},{standby_address}"
    workers = workers_of(both, processes, 2, env={"CW_DATA_SLOW_S": "0.01"})
    count = 400
    dataset_id = data.register_dataset(
        f"grpc://{both}", data.Dataset.range(count).map(fns.slow_identity), dataset_id="kept")
    seen, gaps, last, handed = Counter(), [], None, 0
    for index, element in enumerate(data.from_dataset_id(
            "distributed_epoch", f"grpc://{both}", dataset_id, job_name="headline")):
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now
        seen[int(element)] += 1
        if index + 1 == count // 4:
            [job] = data.service_status(primary.target).jobs
            handed = job.splits_handed
            primary.kill()
    assert primary.process.returncode == -9
    assert seen == Counter(range(count)), (seen - Counter(range(count)),
                                           Counter(range(count)) - seen)
    assert max(gaps) < MAX_GAP_S, max(gaps)
    assert takes_over(standby) == f"grpc://{standby_address}"
    status = data.service_status(f"grpc://{standby_address}")
    [job] = status.jobs  # the named job stays for job_gc_timeout_ms
    assert job.finished and job.splits_completed == job.splits_handed > handed > 0
    assert sorted(w.address for w in status.workers) == sorted(w.address for w in workers)
    assert all(w.heartbeat_age_seconds < 10 for w in status.workers)
    assert "Traceback" not in standby.stderr() + "".join(w.stderr() for w in workers)


@pytest.mark.timeout(90)
def test_a_new_client_given_only_the_standby_reads_after_the_takeover(processes, tmp_path):
    work_dir = str(tmp_path / "work")
    primary = processes("dispatcher", "--port", "0", *ft_args(work_dir))
    standby, standby_address = start_standby(processes, work_dir)
    [worker] = workers_of(f"{primary.address},{standby_address}", processes, 1)
    data.register_dataset(primary.target, data.Dataset.range(50), dataset_id="kept")
    with pytest.raises(errors.UnavailableError, match="standing by for work_dir"):
        data.service_status(standby_address, timeout=5)
    primary.kill()
    target = takes_over(standby)
    read = data.from_dataset_id("distributed_epoch", target, "kept")
    assert sorted(int(x) for x in read) == list(range(50))
    assert [w.address for w in data.service_status(target).workers] == [worker.address]
    assert standby.terminate() == 0


@pytest.mark.timeout(60)
def test_a_second_primary_on_a_held_work_dir_is_refused(processes, tmp_path):
    work_dir = str(tmp_path / "work")
    primary = processes("dispatcher", "--port", "0", *ft_args(work_dir))
    result = subprocess.run(
        [sys.executable, "-m", "clusterwire", "dispatcher", *ft_args(work_dir)],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "FailedPreconditionError" in result.stderr
    assert f"pid {primary.process.pid}" in result.stderr
    assert primary.target in result.stderr and "--standby" in result.stderr
    assert "another --work-dir" in result.stderr
    config = data.DispatcherConfig(work_dir=work_dir, fault_tolerant_mode=True)
    with pytest.raises(errors.FailedPreconditionError, match="is in use"):
        data.DispatchServer(config)
    primary.kill()  # the kernel drops a SIGKILLed holder's lease
    with data.DispatchServer(config) as successor:
        assert not successor.standing_by


def test_stopping_releases_the_lease_and_a_stopped_standby_never_serves(tmp_path):
    config = data.DispatcherConfig(work_dir=str(tmp_path), fault_tolerant_mode=True,
                                   bind_address="127.0.0.1")
    primary = data.DispatchServer(config)
    standby = data.DispatchServer(config._replace(standby=True))
    assert standby.standing_by and not standby.wait_serving(0.5)
    standby.stop()
    assert not standby.wait_serving(0)
    primary.stop()
    with data.DispatchServer(config) as again:
        assert not again.standing_by


@pytest.mark.parametrize("settings", [{}, {"work_dir": "x"}, {"fault_tolerant_mode": True}])
def test_a_standby_without_a_journal_to_replay_is_refused(settings):
    with pytest.raises(errors.InvalidArgumentError, match="--fault-tolerant-mode"):
        data.DispatcherConfig(standby=True, **settings)


def test_the_cli_refuses_a_standby_without_a_work_dir():
    result = subprocess.run(
        [sys.executable, "-m", "clusterwire", "dispatcher", "--standby"],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "InvalidArgumentError" in result.stderr and "--work-dir" in result.stderr


BAD_LISTS = {
    "localhost:5000,,localhost:5001": "empty entry",
    "localhost:5000,": "empty entry",
    "localhost:5000,localhost:5000": "more than once",
    "localhost:5000,nohostport": "no ':port' part",
    "localhost:5000,localhost:99999": "invalid port",
    "localhost:5000,localhost:0": "port 0",
}


@pytest.mark.parametrize("addresses", sorted(BAD_LISTS))
def test_a_bad_address_list_is_refused_everywhere(addresses):
    why = BAD_LISTS[addresses]
    for make in (lambda: data.WorkerConfig(dispatcher_address=addresses),
                 lambda: data.WorkerServer(dispatcher_address=f"grpc://{addresses}"),
                 lambda: data.Dataset.range(3).apply(
                     data.distribute("distributed_epoch", f"grpc://{addresses}")),
                 lambda: data.from_dataset_id("distributed_epoch", f"grpc://{addresses}", "d"),
                 lambda: data.register_dataset(f"grpc://{addresses}", data.Dataset.range(3)),
                 lambda: DispatcherClient("grpc", addresses, 1.0, Security())):
        with pytest.raises(errors.InvalidArgumentError, match=why) as raised:
            make()
        assert repr(addresses) in str(raised.value)


def test_the_cli_worker_refuses_a_bad_address_list():
    result = subprocess.run(
        [sys.executable, "-m", "clusterwire", "worker", "--dispatcher-address",
         "localhost:5000,,localhost:5001"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "empty entry" in result.stderr


@pytest.mark.timeout(60)
def test_a_client_follows_the_dispatcher_that_serves_in_either_order(tmp_path, monkeypatch):
    """The list's order does not matter: a standby listed first answers UNAVAILABLE and the
    client moves on to the primary, and stays with it."""
    monkeypatch.setenv(worker_auth.ENV, "a worker token both dispatchers know")
    config = data.DispatcherConfig(work_dir=str(tmp_path), fault_tolerant_mode=True,
                                   bind_address="127.0.0.1")
    with data.DispatchServer(config) as primary, \
            data.DispatchServer(config._replace(standby=True)) as standby:
        both = f"{standby.target.split('://')[1]},{primary.target.split('://')[1]}"
        with data.WorkerServer(data.WorkerConfig(dispatcher_address=both,
                                                 worker_address="127.0.0.1:%port%")):
            ds = data.Dataset.range(20).apply(
                data.distribute("distributed_epoch", f"grpc://{both}"))
            assert sorted(int(x) for x in ds) == list(range(20))
        client = DispatcherClient("grpc", both, 5.0, Security())
        try:
            assert data.service_status(f"grpc://{both}").kind == "dispatcher"
            assert client.address == both.split(",")[0]
            client.call(data_status_request())
            assert client.address == primary.target.split("://")[1]
        finally:
            client.close()


def test_top_given_the_standby_first_shows_the_dispatcher_that_serves(tmp_path, monkeypatch):
    monkeypatch.setenv(worker_auth.ENV, "a worker token both dispatchers know")
    config = data.DispatcherConfig(work_dir=str(tmp_path), fault_tolerant_mode=True,
                                   bind_address="127.0.0.1")
    with data.DispatchServer(config) as primary, \
            data.DispatchServer(config._replace(standby=True)) as standby:
        serving = primary.target.split("://")[1]
        poller = top.DataPoller(f"grpc://{standby.target.split('://')[1]},{serving}", "grpc",
                                10)
        try:
            snapshot = poller.poll()
        finally:
            poller.close()
        assert (snapshot.dispatcher.address, snapshot.dispatcher.status.kind) == (
            serving, "dispatcher")
        assert poller.address == serving


def data_status_request():
    from clusterwire.protos.data_service_pb2 import DataRequest, GetStatusRequest

    return DataRequest(get_status=GetStatusRequest())


def test_a_standby_that_cannot_replay_the_journal_says_why_and_lets_go(tmp_path):
    config = data.DispatcherConfig(work_dir=str(tmp_path), fault_tolerant_mode=True,
                                   bind_address="127.0.0.1")
    primary = data.DispatchServer(config)
    data.register_dataset(primary.target, data.Dataset.range(3), dataset_id="d")
    standby = data.DispatchServer(config._replace(standby=True))
    journal = tmp_path / JOURNAL_DIR / JOURNAL_FILE
    damaged = bytearray(journal.read_bytes())
    damaged[0] ^= 0xFF
    journal.write_bytes(bytes(damaged))
    primary.stop()
    with pytest.raises(errors.DataLossError, match="is corrupt at byte"):
        standby.wait_serving(30)
    assert standby.join(10)
    with pytest.raises(errors.DataLossError):  # the lease is free again: refused for the journal
        data.DispatchServer(config)


def test_of_two_standbys_on_a_fresh_work_dir_the_first_to_take_the_lease_serves(tmp_path):
    config = data.DispatcherConfig(work_dir=str(tmp_path), fault_tolerant_mode=True,
                                   bind_address="127.0.0.1", standby=True)
    with data.DispatchServer(config) as first, data.DispatchServer(config) as second:
        assert first.wait_serving(30)
        assert second.standing_by and not second.wait_serving(0.5)
        first.stop()
        assert second.wait_serving(30)


@pytest.mark.timeout(60)
def test_a_standby_stopped_by_sigterm_before_it_serves_exits_cleanly(processes, tmp_path):
    work_dir = str(tmp_path / "work")
    processes("dispatcher", "--port", "0", *ft_args(work_dir))
    standby, _ = start_standby(processes, work_dir)
    assert standby.terminate() == 0
    assert standby.process.stdout.read() == ""  # no ready line
    assert "Traceback" not in standby.stderr()


@pytest.mark.timeout(60)
def test_when_no_dispatcher_of_a_list_serves_the_error_names_each(tmp_path):
    config = data.DispatcherConfig(work_dir=str(tmp_path), fault_tolerant_mode=True,
                                   bind_address="127.0.0.1")
    [dead] = free_ports(1)
    with data.DispatchServer(config) as primary, \
            data.DispatchServer(config._replace(standby=True)) as standby:
        primary.stop()  # the standby takes over; stopped too, nothing serves
        assert standby.wait_serving(30)
    both = f"127.0.0.1:{dead},{standby.target.split('://')[1]}"
    client = DispatcherClient("grpc", both, 1.0, Security())
    try:
        started = time.monotonic()
        with pytest.raises(errors.UnavailableError) as raised:
            client.call(data_status_request(), retry=False)
        assert time.monotonic() - started < 5
        assert f"127.0.0.1:{dead}: " in str(raised.value) and "serves;" in str(raised.value)
        started = time.monotonic()
        with pytest.raises(errors.UnavailableError, match="serves within 1 s") as raised:
            client.call(data_status_request())
        assert 1 <= time.monotonic() - started < 10
        assert all(f"{a}: " in str(raised.value) for a in both.split(","))
    finally:
        client.close()


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10).status


def _readyz(dispatcher: data.DispatchServer) -> int:
    url = dispatcher.metrics_url.rsplit("/", 1)[0] + "/readyz"
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.timeout(120)
def test_a_standby_says_not_serving_to_health_checks_until_it_takes_over(tmp_path):
    config = data.DispatcherConfig(work_dir=str(tmp_path), fault_tolerant_mode=True,
                                   bind_address="127.0.0.1", metrics_port=0)
    primary = data.DispatchServer(config)
    with data.DispatchServer(config._replace(standby=True)) as standby:
        try:
            address = standby.target.split("://")[1]
            assert standby.standing_by
            # A load balancer or Kubernetes probe must not send work to it yet.
            assert _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert _readyz(standby) == 503
            assert _health(primary.target.split("://")[1]) == \
                health_pb2.HealthCheckResponse.SERVING
        finally:
            primary.stop()
        assert standby.wait_serving(60)
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING
        assert _readyz(standby) == 200
