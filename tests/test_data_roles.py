"""Roles and fair shares in the data service (issue 29), replayed on real processes.

* Only workers register: a client's raw worker heartbeat (the attack registered a worker that
  added 666 to a victim's ``range(5)`` and answered the caller the grant key) is refused.
* One client cannot fill the dispatcher's job or dataset table for everyone: while it floods
  them, another client's new dataset, new job and read succeed within a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from cw_data_procs import TESTS_DIR, WORKER_TOKEN_ENV

from clusterwire import data, errors
from clusterwire.data import elements, worker_auth
from clusterwire.data.rpc import DispatcherClient, serve
from clusterwire.protos.data_service_pb2 import (
    DataRequest,
    DataResponse,
    GetOrCreateJobRequest,
    WorkerHeartbeatRequest,
    WorkerInfo,
)
from clusterwire.security import Security
from clusterwire.shell import listen_options

TOKEN = "data-service-roles-token-0123456789"
#: What the acceptance asks of a victim's operation during a flood.
VICTIM_S = 1.0


class RogueWorker:
    """What the attacker registers as a worker: every stream it is asked for is [666]."""

    def __init__(self) -> None:
        self.reads = 0
        self.shell = serve("grpc", "127.0.0.1", 0, self._handle, "rogue", listen_options())
        self.shell.start()
        self.address = f"127.0.0.1:{self.shell.port}"

    def _handle(self, request: DataRequest, _buffers, _peer: str):
        response = DataResponse()
        if request.WhichOneof("kind") != "get_elements":
            response.release_streams.SetInParent()
            return response, []
        self.reads += 1
        encoded = elements.encode(np.int64(666), "")
        response.get_elements.elements.append(encoded.header)
        response.get_elements.end_of_stream = True
        return response, encoded.buffers

    def stop(self) -> None:
        self.shell.stop(0)


@pytest.fixture
def rogue():
    worker = RogueWorker()
    yield worker
    worker.stop()


def heartbeat(address: str, worker_token: bytes = b"") -> DataRequest:
    return DataRequest(worker_heartbeat=WorkerHeartbeatRequest(
        worker=WorkerInfo(address=address, protocol="grpc"), worker_token=worker_token))


def read_range(target: str, count: int, **kwargs) -> list[int]:
    dataset = data.Dataset.range(count).apply(data.distribute("parallel_epochs", target,
                                                              **kwargs))
    return sorted(int(x) for x in dataset)


# ---- only workers register -----------------------------------------------------------------

@pytest.mark.timeout(90)
@pytest.mark.parametrize("cluster_token", [None, TOKEN], ids=["no-token", "token-holder"])
def test_a_client_cannot_register_a_worker_nor_learn_the_grant_key(processes, rogue,
                                                                   cluster_token, monkeypatch):
    if cluster_token:  # the servers, the victim and the attacker all hold it
        monkeypatch.setenv("CLUSTERWIRE_AUTH_TOKEN", cluster_token)
    dispatcher = processes("dispatcher")
    worker = processes("worker", "--dispatcher-address", dispatcher.address)
    security = Security(token=cluster_token.encode() if cluster_token else None)
    client = DispatcherClient("grpc", dispatcher.address, 10.0, security)
    try:
        for worker_token in (b"", b"x" * 64, (cluster_token or "").encode()):
            with pytest.raises(errors.PermissionDeniedError, match="worker token"):
                client.call(heartbeat(rogue.address, worker_token))
        status = data.service_status(dispatcher.address, security=security)
        assert [w.address for w in status.workers] == [worker.address]
        assert read_range(dispatcher.target, 5) == [0, 1, 2, 3, 4]
        assert rogue.reads == 0

        # The same heartbeat with the workers' token registers it: what the refusal spared.
        response, _ = client.call(heartbeat(
            rogue.address, WORKER_TOKEN_ENV[worker_auth.ENV].encode()))
        assert len(response.worker_heartbeat.grant_key) == 32
        assert read_range(dispatcher.target, 5) == [0, 1, 2, 3, 4, 666]
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_a_dispatcher_without_a_worker_token_registers_no_remote_worker(processes):
    """Default deny: the dispatcher made its own token, which a worker process lacks; the
    worker says why on stderr (it never says it is ready) and the dispatcher lists no
    worker."""
    dispatcher = processes("dispatcher", env={worker_auth.ENV: ""})
    worker = processes("worker", "--dispatcher-address", dispatcher.address,
                       "--heartbeat-interval-ms", "100", ready=False)
    said = "did not present this dispatcher's worker token"
    deadline = time.monotonic() + 30
    while said not in worker.stderr() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert said in worker.stderr() and "--worker-token-file" in worker.stderr()
    assert data.service_status(dispatcher.address).workers == []


@pytest.mark.timeout(60)
def test_workers_of_the_dispatchers_process_and_of_local_data_service_register(tmp_path):
    with data.DispatchServer(port=0) as dispatcher, data.WorkerServer(
            port=0, dispatcher_address=dispatcher.target.split("://")[1]):
        assert read_range(dispatcher.target, 5) == [0, 1, 2, 3, 4]
    with data.LocalDataService(workers=1) as service:
        assert read_range(service.target, 5) == [0, 1, 2, 3, 4]
    token_file = tmp_path / "workers"
    token_file.write_text("w" * 32)
    config = {"dispatcher_address": "localhost:1", "worker_token_file": str(token_file)}
    assert data.WorkerConfig(**config).worker_token_file == str(token_file)
    with pytest.raises(ValueError, match="worker_token_file"):
        data.DispatcherConfig(worker_token_file="")


def test_the_worker_token_must_be_long_and_not_the_cluster_token(tmp_path, monkeypatch):
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(errors.InvalidArgumentError, match="worker token is shorter"):
        data.DispatchServer(data.DispatcherConfig(worker_token_file=str(short)))
    monkeypatch.setenv("CLUSTERWIRE_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv(worker_auth.ENV, TOKEN)
    with pytest.raises(errors.InvalidArgumentError, match="is the cluster token"):
        data.DispatchServer(port=0)


# ---- fair shares: a flood of jobs or datasets does not lock others out ---------------------

class Flood:
    """cw_data_flood.py in a process of its own."""

    def __init__(self, kind: str, address: str, seconds: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(TESTS_DIR, "cw_data_flood.py"), kind, address,
             str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def wait_full(self) -> None:
        assert self.process.stdout.readline().strip() == "FULL"

    def stop(self) -> dict[str, int]:
        self.process.stdin.close()
        counts = json.loads(self.process.stdout.readline())
        self.process.wait(30)
        self.process.stdout.close()
        return counts

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def timed(operation):
    started = time.monotonic()
    result = operation()
    return result, time.monotonic() - started


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["jobs", "datasets"])
def test_a_flood_of_jobs_or_datasets_leaves_others_their_share(processes, kind):
    """The flooder fills the table (4,096 jobs or 1,024 datasets it never reads or uses) and
    keeps creating; meanwhile another client's new dataset, new job and read each succeed
    within a second, and the table stays at its limit."""
    dispatcher = processes("dispatcher")
    processes("worker", "--dispatcher-address", dispatcher.address)
    flood = Flood(kind, dispatcher.address, 60)
    victim = DispatcherClient("grpc", dispatcher.address, 10.0, Security())
    try:
        flood.wait_full()
        times = {}
        for attempt in range(3):
            dataset = data.Dataset.range(5 + attempt)
            dataset_id, times["dataset"] = timed(
                lambda d=dataset: data.register_dataset(dispatcher.target, d))
            job, times["job"] = timed(lambda d=dataset_id, a=attempt: victim.call(DataRequest(
                get_or_create_job=GetOrCreateJobRequest(
                    dataset_id=d, sharding_policy=data.ShardingPolicy.OFF,
                    job_key=f"victim/{a}", consumer_id=f"victim-{a}")))[0].job)
            assert job.job_id
            read, times["read"] = timed(lambda d=dataset_id: sorted(int(x) for x in (
                data.from_dataset_id("parallel_epochs", dispatcher.target, d))))
            assert read == list(range(5 + attempt))
            assert max(times.values()) < VICTIM_S, times
        status = data.service_status(dispatcher.address)
        counts = flood.stop()
    finally:
        victim.close()
        flood.kill()
    if kind == "jobs":
        assert len(status.jobs) <= 4096
    assert counts["created"] >= (4096 if kind == "jobs" else 1024), counts


def test_a_full_job_table_gives_up_the_oldest_job_nobody_read():
    """max_jobs = 3: a job a consumer reads (a heartbeat) stays; a new job takes the place
    of the oldest one never read; with every job read, a new one is refused."""
    from clusterwire.protos.data_service_pb2 import ClientHeartbeatRequest

    with data.DispatchServer(data.DispatcherConfig(limits={"max_jobs": 3})) as dispatcher:
        client = DispatcherClient("grpc", dispatcher.target.split("://")[1], 10.0, Security())
        dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(5))

        def job(name: str) -> int:
            return client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
                dataset_id=dataset_id, job_key=name, consumer_id=name)))[0].job.job_id

        def read(job_id: int, consumer: str) -> None:
            client.call(DataRequest(client_heartbeat=ClientHeartbeatRequest(
                job_id=job_id, consumer_id=consumer)))

        try:
            read_job, unread_old, unread_new = job("a"), job("b"), job("c")
            read(read_job, "a")
            newest = job("d")
            assert dispatcher.num_jobs() == 3
            with pytest.raises(errors.ResourceExhaustedError,
                               match=f"Job {unread_old} was displaced"):
                read(unread_old, "b")
            for job_id, consumer in ((read_job, "a"), (unread_new, "c"), (newest, "d")):
                read(job_id, consumer)
            with pytest.raises(errors.ResourceExhaustedError, match="shared fairly"):
                job("e")
        finally:
            client.close()


def test_a_dataset_past_the_byte_limit_takes_the_place_of_unused_ones():
    """max_dataset_bytes = 2,500: a third 1,000-byte dataset collects the oldest unused one;
    one larger than the limit is refused and collects nothing."""
    config = data.DispatcherConfig(limits={"max_dataset_bytes": 2500})
    with data.DispatchServer(config) as dispatcher:
        def register(value: int, size: int = 1000) -> str:
            payload = np.full((1, size), value, dtype=np.uint8)
            return data.register_dataset(dispatcher.target,
                                         data.Dataset.from_tensor_slices(payload),
                                         compression=None)

        first, second, third = register(1), register(2), register(3)
        with pytest.raises(errors.ResourceExhaustedError, match=f"Dataset {first} was displaced"):
            list(data.from_dataset_id("parallel_epochs", dispatcher.target, first))
        with pytest.raises(errors.ResourceExhaustedError, match="dataset of 3000 bytes"):
            register(4, 3000)
        for dataset_id in (second, third):  # both still there
            data.from_dataset_id("parallel_epochs", dispatcher.target, dataset_id)
