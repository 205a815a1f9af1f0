"""The dispatcher's per-request work at scale (issue 33): what it keeps so that a consumer's
heartbeat or split request does not look at every worker or every consumer still answers as
the dispatcher's state says.

* A heartbeat's list of live workers is made once per change: a worker that registers, one
  that changes its addresses and one back from the dead are listed at the next heartbeat; a
  silent one is dropped after worker_timeout_ms.
* A consumer's request looks at the consumers timed out first (least recently heard from
  first): a consumer heard from again is not expired with those that went silent, even if
  it joined before them, and a silent one's split goes to the next consumer asking.
* The worker list is versioned: a consumer's heartbeat that names the version it holds is
  answered without the list (a few bytes, whatever the number of workers); a worker that
  joins, changes or leaves gives a new version, which reaches every consumer of every job
  with the new list; a heartbeat that names no version (a consumer from before versions) or
  one this dispatcher never gave (one before a restart) gets the whole list. A real reader
  sends its version and keeps its list while the replies carry none.
* Past ``consumer_heartbeat_rate`` consumers a second, the dispatcher tells its consumers a
  longer heartbeat interval (their number over the rate, at most a tenth of its consumer
  timeout), and a real reader heartbeats no faster than that.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from conftest import in_process_data_service, wait_for

from clusterwire import data
from clusterwire.data import dispatcher as dispatcher_module
from clusterwire.data import heartbeat_replies, reader, worker_auth
from clusterwire.data.modes import ShardingPolicy
from clusterwire.data.rpc import DispatcherClient
from clusterwire.protos.data_service_pb2 import (
    ClientHeartbeatRequest,
    ClientHeartbeatResponse,
    DataRequest,
    DataResponse,
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


def _job(client: DispatcherClient, policy: ShardingPolicy, consumer: str,
         key: str = "scale/0") -> int:
    dataset_id = data.register_dataset(f"grpc://{client.address}", data.Dataset.range(1000))
    response, _ = client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
        dataset_id=dataset_id, sharding_policy=int(policy), job_key=key, named=True,
        consumer_id=consumer)))
    return response.job.job_id


def _heartbeat(client: DispatcherClient, job_id: int, consumer: str = "c",
               version: int = 0) -> ClientHeartbeatResponse:
    """The reply to a heartbeat holding the list of ``version`` (0: none, as a consumer from
    before versions sends)."""
    response, _ = client.call(DataRequest(client_heartbeat=ClientHeartbeatRequest(
        job_id=job_id, consumer_id=consumer, workers_version=version)))
    return response.client_heartbeat


def _listed(client: DispatcherClient, job_id: int, consumer: str = "c") -> list[WorkerInfo]:
    return list(_heartbeat(client, job_id, consumer).workers)


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


def test_a_steady_consumers_heartbeat_carries_no_worker_list(dispatcher):
    _, client = dispatcher
    for index in range(WORKERS):
        _beat(client, index)
    for policy in (ShardingPolicy.OFF, ShardingPolicy.DYNAMIC):
        job_id = _job(client, policy, "c", key=f"steady-{int(policy)}/0")
        first = _heartbeat(client, job_id)  # no version held: the list
        assert len(first.workers) == WORKERS and first.workers_version != 0
        for _ in range(3):
            steady = _heartbeat(client, job_id, version=first.workers_version)
            assert list(steady.workers) == [] and not steady.job_finished
            assert steady.workers_version == first.workers_version
            # O(1): the version and the flags, against the whole list's bytes.
            assert steady.ByteSize() <= 16 < first.ByteSize() // 64, (steady.ByteSize(),
                                                                     first.ByteSize())
        # A consumer from before versions sends none: it gets the whole list, every time.
        for _ in range(2):
            old = _heartbeat(client, job_id, "old")
            assert [w.address for w in old.workers] == [w.address for w in first.workers]
        # A version this dispatcher never gave (held from one before a restart): the list.
        other = _heartbeat(client, job_id, version=first.workers_version + 1)
        assert len(other.workers) == WORKERS
        assert other.workers_version == first.workers_version


def test_a_worker_joining_changing_or_leaving_reaches_every_consumer(dispatcher):
    _, client = dispatcher
    for index in range(WORKERS):
        _beat(client, index)
    jobs = {_job(client, policy, "c0", key=f"many-{int(policy)}/0")
            for policy in (ShardingPolicy.OFF, ShardingPolicy.DYNAMIC)}
    consumers = [(job_id, f"c{i}") for job_id in jobs for i in range(3)]
    held = {c: (0, []) for c in consumers}  # consumer -> (version, list), as a reader keeps

    def beat_all() -> set[int]:
        """Every consumer's heartbeat; the versions that brought a new list."""
        new = set()
        for job_id, consumer in consumers:
            version, workers = held[job_id, consumer]
            reply = _heartbeat(client, job_id, consumer, version)
            if reply.workers_version != version:
                new.add(reply.workers_version)
                held[job_id, consumer] = reply.workers_version, list(reply.workers)
            else:
                assert list(reply.workers) == []
        return new

    def addresses() -> set[tuple[str, ...]]:
        return {tuple(w.address for w in workers) for _, workers in held.values()}

    names = tuple(f"light-{i:04d}:1" for i in range(WORKERS))
    assert len(beat_all()) == len(jobs) and addresses() == {names}
    assert beat_all() == set()  # steady: nothing new
    before = {version for version, _ in held.values()}

    _beat(client, WORKERS)  # joins
    assert len(beat_all()) == len(jobs)
    assert {version for version, _ in held.values()}.isdisjoint(before)
    assert addresses() == {(*names, f"light-{WORKERS:04d}:1")}
    assert beat_all() == set()

    _beat(client, 7, transfer="light-0007:2")  # changes its WorkerInfo
    assert len(beat_all()) == len(jobs)
    assert {workers[7].transfer_address for _, workers in held.values()} == {"light-0007:2"}

    def silent_one_gone_everywhere() -> bool:
        for index in range(1, WORKERS + 1):  # all but worker 0 keep beating
            _beat(client, index, transfer="light-0007:2" if index == 7 else "")
        beat_all()
        return addresses() == {(*names[1:], f"light-{WORKERS:04d}:1")}
    wait_for(silent_one_gone_everywhere, timeout=30, what="the silent worker dropped")
    assert beat_all() == set()

    _beat(client, 0)  # back from the dead
    assert len(beat_all()) == len(jobs)
    assert addresses() == {(*names, f"light-{WORKERS:04d}:1")}


def test_a_restarted_dispatcher_sends_the_list_for_a_version_of_the_one_before(tmp_path):
    config = data.DispatcherConfig(bind_address="127.0.0.1", work_dir=str(tmp_path),
                                   fault_tolerant_mode=True)
    server = data.DispatchServer(config)
    client = DispatcherClient("grpc", server.target.split("://")[1], 10.0, load_security({}))
    try:
        _beat(client, 0)
        job_id = _job(client, ShardingPolicy.OFF, "c")
        version = _heartbeat(client, job_id).workers_version
        assert list(_heartbeat(client, job_id, version=version).workers) == []
    finally:
        client.close()
        server.stop()
    server = data.DispatchServer(config)  # replays the journal: the same job and worker
    client = DispatcherClient("grpc", server.target.split("://")[1], 10.0, load_security({}))
    try:
        reply = _heartbeat(client, job_id, version=version)
        assert [w.address for w in reply.workers] == ["light-0000:1"]
        assert reply.workers_version not in (0, version)
    finally:
        client.close()
        server.stop()


def test_a_reader_sends_its_version_and_keeps_its_list(monkeypatch):
    monkeypatch.setattr(reader, "TIMINGS", dataclasses.replace(reader.TIMINGS,
                                                               heartbeat_s=0.05))
    seen: list[tuple[int, int, int]] = []  # (version held, version now, workers sent)
    lock = threading.Lock()
    reply = heartbeat_replies.HeartbeatReplies.reply

    def recording(self, job, view, workers, known_version, interval_ms):
        made = reply(self, job, view, workers, known_version, interval_ms)
        answer = DataResponse.FromString(made).client_heartbeat
        with lock:
            seen.append((known_version, answer.workers_version, len(answer.workers)))
        return made
    monkeypatch.setattr(heartbeat_replies.HeartbeatReplies, "reply", recording)

    def heartbeats() -> list[tuple[int, int, int]]:
        with lock:
            return list(seen)

    with in_process_data_service(workers=1) as dispatcher:
        address = dispatcher.target.split("://")[1]
        dataset = data.Dataset.range(1 << 40).apply(data.distribute(
            "parallel_epochs", f"grpc://{address}", job_name="versions"))
        iterator = iter(dataset)
        try:
            next(iterator)
            wait_for(lambda: len(heartbeats()) >= 5, timeout=30, what="5 heartbeats")
            first, *steady = heartbeats()
            assert first[0] == 0 and first[2] == 1  # none held: the list of one worker
            assert steady and all(s == (first[1], first[1], 0) for s in steady), steady
            mark = len(heartbeats())
            second = data.WorkerServer(data.WorkerConfig(
                dispatcher_address=address, worker_address="127.0.0.1:%port%"))
            try:
                # parallel_epochs: the new worker's epoch starts at 0 again.
                values, deadline = set(), time.monotonic() + 60
                while 0 not in values:
                    assert time.monotonic() < deadline, "no element of the new worker"
                    values.add(int(next(iterator)))
                wait_for(lambda: len(heartbeats()) >= mark + 3, timeout=30,
                         what="3 heartbeats after the join")
                after = heartbeats()[mark:]
                changed = [s for s in after if s[2]]
                assert changed[0][0] == first[1] and changed[0][2] == 2, after
                assert changed[0][1] != first[1]
                later = after[after.index(changed[0]) + 1:]
                assert all(s == (changed[0][1], changed[0][1], 0) for s in later), after
            finally:
                second.stop()
        finally:
            iterator.close()


@pytest.mark.parametrize("rate, floor_ms", [(1000, 0), (10, 2500), (1, 12000)])
def test_many_consumers_are_told_a_longer_heartbeat_interval(rate, floor_ms):
    server = data.DispatchServer(data.DispatcherConfig(
        bind_address="127.0.0.1", limits={"consumer_heartbeat_rate": rate}))
    client = DispatcherClient("grpc", server.target.split("://")[1], 10.0, load_security({}))
    try:
        _beat(client, 0)
        job_id = _job(client, ShardingPolicy.OFF, "c0")

        def floors() -> set[int]:  # consumers are counted once a second
            return {_heartbeat(client, job_id, f"c{i}").heartbeat_interval_ms
                    for i in range(25)}
        # 25 consumers over the rate, in whole tenths of a second; at most 120 s / 10.
        wait_for(lambda: floors() == {floor_ms}, timeout=30, what=f"a floor of {floor_ms} ms")
    finally:
        client.close()
        server.stop()


def test_a_reader_heartbeats_no_faster_than_the_dispatcher_says(monkeypatch):
    monkeypatch.setattr(reader, "TIMINGS", dataclasses.replace(reader.TIMINGS,
                                                               heartbeat_s=0.05))
    beats: list[tuple[float, int]] = []  # (when, the floor told)
    reply = heartbeat_replies.HeartbeatReplies.reply

    def recording(self, job, view, workers, known_version, interval_ms):
        beats.append((time.monotonic(), interval_ms))
        return reply(self, job, view, workers, known_version, interval_ms)
    monkeypatch.setattr(heartbeat_replies.HeartbeatReplies, "reply", recording)
    dispatcher = data.DispatchServer(data.DispatcherConfig(
        bind_address="127.0.0.1", limits={"consumer_heartbeat_rate": 1}))
    address = dispatcher.target.split("://")[1]
    worker = data.WorkerServer(data.WorkerConfig(dispatcher_address=address,
                                                 worker_address="127.0.0.1:%port%"))
    try:
        wait_for(lambda: dispatcher.num_workers() == 1, what="the worker")
        iterator = iter(data.Dataset.range(1 << 40).apply(data.distribute(
            "parallel_epochs", f"grpc://{address}", job_name="floor")))
        try:
            next(iterator)
            wait_for(lambda: len(beats) >= 4, timeout=60, what="4 heartbeats")
            told = list(beats)
            assert {floor for _, floor in told} == {1000}  # one consumer, 1 a second
            gaps = [b - a for (a, _), (b, _) in zip(told, told[1:], strict=False)]
            assert min(gaps) >= 0.95, gaps  # its own 0.05 s would be 20 a second
        finally:
            iterator.close()
    finally:
        worker.stop()
        dispatcher.stop()


def test_a_static_jobs_list_is_its_configured_workers_in_order_versioned():
    order = ["light-0002:1", "light-0000:1", "light-0001:1"]
    server = data.DispatchServer(data.DispatcherConfig(
        bind_address="127.0.0.1", worker_addresses=order, worker_timeout_ms=WORKER_TIMEOUT_MS))
    client = DispatcherClient("grpc", server.target.split("://")[1], 10.0, load_security({}))
    try:
        for index in (0, 2):  # worker 1 not yet
            _beat(client, index)
        job_id = _job(client, ShardingPolicy.DATA, "c")
        first = _heartbeat(client, job_id)
        assert [w.address for w in first.workers] == ["light-0002:1", "light-0000:1"]
        steady = _heartbeat(client, job_id, version=first.workers_version)
        assert list(steady.workers) == [] and steady.workers_version == first.workers_version

        _beat(client, 1)  # joins: listed in its configured place, a new version
        joined = _heartbeat(client, job_id, version=first.workers_version)
        assert [w.address for w in joined.workers] == order
        assert joined.workers_version != first.workers_version
        _beat(client, 0, transfer="light-0000:2")  # changes
        changed = _heartbeat(client, job_id, version=joined.workers_version)
        assert changed.workers[1].transfer_address == "light-0000:2"
        assert list(_heartbeat(client, job_id, version=changed.workers_version).workers) == []
    finally:
        client.close()
        server.stop()
