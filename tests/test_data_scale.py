"""The dispatcher's per-request work at scale (issue 33): what it keeps so that a consumer's
heartbeat or split request does not look at every worker or every consumer still answers as
the dispatcher's state says.

* A heartbeat's list of live workers is made once per change: a worker that registers, one
  that changes its addresses and one back from the dead are listed at the next heartbeat; a
  silent one is dropped after worker_timeout_ms.
* A consumer's request looks at the consumers timed out first (least recently heard from
  first): a consumer heard from again is not expired with those that went silent, even if
  it joined before them, and a silent one's split goes to the next consumer asking.
"""

from __future__ import annotations

import pytest
from conftest import wait_for

from clusterwire import data
from clusterwire.data import dispatcher as dispatcher_module
from clusterwire.data import worker_auth
from clusterwire.data.modes import ShardingPolicy
from clusterwire.data.rpc import DispatcherClient
from clusterwire.protos.data_service_pb2 import (
    ClientHeartbeatRequest,
    DataRequest,
    GetOrCreateJobRequest,
    GetSplitRequest,
    WorkerHeartbeatRequest,
    WorkerInfo,
)
from clusterwire.security import load_security

WORKERS = 64
#: Long enough that WORKERS heartbeats sent one after another on a busy machine all come
#: well within it: only the worker left silent on purpose times out.
WORKER_TIMEOUT_MS = 5000


@pytest.fixture
def dispatcher():
    server = data.DispatchServer(data.DispatcherConfig(bind_address="127.0.0.1",
                                                       worker_timeout_ms=WORKER_TIMEOUT_MS))
    client = DispatcherClient("grpc", server.target.split("://")[1], 10.0, load_security({}))
    try:
        yield server, client
    finally:
        client.close()
        server.stop()


def _beat(client: DispatcherClient, index: int, transfer: str = "") -> None:
    client.call(DataRequest(worker_heartbeat=WorkerHeartbeatRequest(
        worker=WorkerInfo(address=f"light-{index:04d}:1", protocol="grpc",
                          transfer_address=transfer),
        worker_token=worker_auth.local_token(client.address))))


def _job(client: DispatcherClient, policy: ShardingPolicy, consumer: str) -> int:
    dataset_id = data.register_dataset(f"grpc://{client.address}", data.Dataset.range(1000))
    response, _ = client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
        dataset_id=dataset_id, sharding_policy=int(policy), job_key="scale/0", named=True,
        consumer_id=consumer)))
    return response.job.job_id


def _listed(client: DispatcherClient, job_id: int, consumer: str = "c") -> list[WorkerInfo]:
    response, _ = client.call(DataRequest(client_heartbeat=ClientHeartbeatRequest(
        job_id=job_id, consumer_id=consumer)))
    return list(response.client_heartbeat.workers)


def test_a_heartbeat_lists_the_live_workers_as_they_come_change_and_go(dispatcher):
    _, client = dispatcher
    for index in range(WORKERS):
        _beat(client, index)
    job_id = _job(client, ShardingPolicy.OFF, "c")
    names = [f"light-{i:04d}:1" for i in range(WORKERS)]
    assert [w.address for w in _listed(client, job_id)] == names
    assert [w.address for w in _listed(client, job_id)] == names  # the same, kept

    _beat(client, WORKERS)  # registers: listed at once
    assert [w.address for w in _listed(client, job_id)] == [*names, f"light-{WORKERS:04d}:1"]
    _beat(client, 7, transfer="light-0007:2")  # new addresses: listed at once
    assert _listed(client, job_id)[7].transfer_address == "light-0007:2"

    def only_the_silent_one_gone() -> bool:
        for index in range(1, WORKERS + 1):  # all but worker 0 keep beating
            _beat(client, index, transfer="light-0007:2" if index == 7 else "")
        listed = [w.address for w in _listed(client, job_id)]
        assert listed[-WORKERS:] == [*names[1:], f"light-{WORKERS:04d}:1"]
        return len(listed) == WORKERS
    wait_for(only_the_silent_one_gone, timeout=30, what="the silent worker dropped")

    _beat(client, 0)  # back: listed at once
    assert [w.address for w in _listed(client, job_id)][:2] == ["light-0000:1",
                                                                "light-0001:1"]


def test_a_consumer_heard_from_again_keeps_its_split_a_silent_one_loses_it(monkeypatch):
    # The consumer kept alive is heard from every round of the wait, far within this.
    monkeypatch.setattr(dispatcher_module, "CLIENT_TIMEOUT_MS", 3000)
    server = data.DispatchServer(data.DispatcherConfig(bind_address="127.0.0.1"))
    client = DispatcherClient("grpc", server.target.split("://")[1], 10.0, load_security({}))
    try:
        _beat(client, 0)
        job_id = _job(client, ShardingPolicy.DYNAMIC, "early")
        split_of = {}
        for consumer in ("early", "silent", "asking"):  # joined in this order
            response, _ = client.call(DataRequest(get_split=GetSplitRequest(
                job_id=job_id, consumer_id=consumer)))
            split_of[consumer] = response.get_split.split.split_id
        assert len(set(split_of.values())) == 3

        held = [split_of["asking"]]

        def silent_split_handed_on() -> bool:
            _listed(client, job_id, "early")  # heard from: stays, though it joined first
            response, _ = client.call(DataRequest(get_split=GetSplitRequest(
                job_id=job_id, consumer_id="asking", held=held)))
            result = response.get_split
            if not result.has_split:
                return False
            assert result.split.split_id != split_of["early"], "the live consumer's split"
            held.append(result.split.split_id)
            return result.split.split_id == split_of["silent"]
        wait_for(silent_split_handed_on, timeout=30, what="the silent consumer's split")
        # The early consumer still holds its split: asking again gets it back (the dispatcher
        # says it is still assigned to it), not another one.
        response, _ = client.call(DataRequest(get_split=GetSplitRequest(
            job_id=job_id, consumer_id="early")))
        assert response.get_split.split.split_id == split_of["early"]
    finally:
        client.close()
        server.stop()
