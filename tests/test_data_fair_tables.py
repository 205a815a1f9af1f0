"""The data service's last tables one client could fill, and reads after a job is gone
(issue 29), on real processes and servers.

* A worker's cross-trainer cache slots: a token holder on another host (127.0.0.2,
  ``cw_data_fair_flood.py caches``) holds every slot it can with jobs it keeps reading; a
  trainer on 127.0.0.1 still gets a slot (and a new dataset, a new job and a read) within a
  second: the slots are shared fairly (``clusterwire.fair_shares``).
* The dispatcher's round-robin resume waves (max_jobs of them): a peer starting waves of
  invented groups cannot push out a victim's wave between its consumers' resumes (they would
  read different jobs, each waiting for the other), nor keep the victim from starting one.
* Reads after the dispatcher removed a job (released, collected, displaced): the worker's
  stream goes on until its next heartbeat, then is closed, and is never started again (a
  reader retrying would get its elements a second time); a job created while a heartbeat
  is answered is not taken for removed.
"""

from __future__ import annotations

import threading
import time

import pytest
from cw_data_fair_flood import Relay
from test_data_fair_shares import FairFlood, timed

from clusterwire import data, errors
from clusterwire.data import elements, graph
from clusterwire.data.config import CROSS_TRAINER_CACHE_SIZE_BYTES
from clusterwire.data.cross_trainer_cache import cache_plan, machine_memory
from clusterwire.data.quotas import ServiceLimits
from clusterwire.data.rpc import DispatcherClient, WorkerChannels
from clusterwire.protos.data_service_pb2 import (
    ClientHeartbeatRequest,
    DataRequest,
    GetElementsRequest,
    GetOrCreateJobRequest,
    RegisterDatasetRequest,
    ReleaseStreamsRequest,
    StreamSpec,
)
from clusterwire.security import Security
from clusterwire.testing.surfaces import allowed_for

#: How long the flooder may take to fill the cache slots.
FILL_S = 120.0


def _victim_round(dispatcher, victim: DispatcherClient, attempt: int) -> dict[str, float]:
    """The victim's new dataset, new job, read and cached read, each timed."""
    dataset = data.Dataset.range(5 + attempt)
    dataset_id, took_dataset = timed(lambda: data.register_dataset(dispatcher.target, dataset))
    job, took_job = timed(lambda: victim.call(DataRequest(
        get_or_create_job=GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.OFF,
            job_key=f"victim/{attempt}", named=True, consumer_id=f"victim-{attempt}")))[0].job)
    assert job.job_id
    read, took_read = timed(lambda: sorted(int(x) for x in (
        data.from_dataset_id("parallel_epochs", dispatcher.target, dataset_id))))
    assert read == list(range(5 + attempt))

    def cached() -> list[int]:
        trainer = iter(data.Dataset.range(7).repeat().apply(data.distribute(
            "parallel_epochs", dispatcher.target, job_name=f"victim-cache-{attempt}",
            cross_trainer_cache=data.CrossTrainerCache(trainer_id="victim"))))
        try:
            return [int(next(trainer)) for _ in range(10)]
        finally:
            trainer.close()

    got, took_cached = timed(cached)
    assert got == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    return {"dataset": took_dataset, "job": took_job, "read": took_read,
            "cached read": took_cached}


@pytest.mark.timeout(400)
def test_a_peer_holding_the_cache_slots_with_jobs_it_reads_leaves_others_their_share(
        processes):
    """The worker has the slots its memory gives (4 on a 24 GiB machine). The victim's first
    round, before the flood, leaves one cached job (released). The flooder opens cached jobs
    until it is refused by the fair rule (``FULL``: it holds every other slot) and reads them
    again and again. Each victim round takes a slot within a second: the first from the
    flooder (which learns it was displaced), the later ones from the victim's own released
    jobs (the flooder holds no more than the victim). Nothing the flooder holds is lost
    silently: it still reads all it created but the one it was told was displaced."""
    dispatcher = processes("dispatcher")
    processes("worker", "--dispatcher-address", dispatcher.address)
    slots = cache_plan(0, machine_memory(), CROSS_TRAINER_CACHE_SIZE_BYTES)[1]
    victim = DispatcherClient("grpc", dispatcher.address, 10.0, Security())
    flood = None
    before: dict[str, float] = {}
    worst: dict[str, float] = {}
    try:
        before = _victim_round(dispatcher, victim, 0)
        flood = FairFlood("caches", dispatcher.address, FILL_S + 120)
        full_at = flood.wait_full()
        for attempt in range(1, 5):
            for name, took in _victim_round(dispatcher, victim, attempt).items():
                worst[name] = max(worst.get(name, 0.0), took)
        counts = flood.stop()
    finally:
        victim.close()
        if flood is not None:
            flood.close()
    print(f"\ncaches flood from 127.0.0.2 ({slots} slots, full at {full_at} of its cached "
          f"jobs): victim's slowest before {before}, during {worst}; flooder {counts}")
    # It held every slot but the victim's when refused (FULL counts what its threads had
    # noted by then), and never got another.
    assert counts["created"] == slots - 1 and full_at <= slots - 1, (full_at, counts)
    assert max(worst.values()) < allowed_for(max(before.values())), (before, worst)
    assert counts["refused"] > 0 and counts["other"] == [], counts
    # The victim took one of the flooder's slots (while it held more), then its own: the
    # flooder still reads the others and was told of that one (by every thread reading it).
    lost = 1 if slots > 2 else 0
    assert counts["held"] == counts["created"] - lost, counts
    assert (counts["displaced"] > 0) == bool(lost), counts


def _resume(client: DispatcherClient, dataset_id: str, group: str, consumer: str,
            round_: int = 5) -> int:
    """A round-robin consumer's resume request (what the reader sends for a saved position
    of a job of 2 consumers); the job it reads."""
    return client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
        dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.OFF,
        job_key=f"rr/0/round-{round_}", named=True, num_consumers=2, consumer_id=consumer,
        resume_group=group, resume_round=round_)))[0].job.job_id


@pytest.mark.timeout(300)
def test_a_peer_starting_resume_waves_cannot_push_out_or_lock_out_a_victims(processes):
    """The victim's consumer 0 resumes (its wave starts). A token holder on 127.0.0.2 starts
    max_jobs + 200 waves of invented groups (of a finite dataset: each wave is kept, then its
    job refused, the cheapest flood). It is refused by the fair rule once the table is full,
    holding every other wave; the victim's consumer 1 then resumes in the same job as
    consumer 0, and a new wave of the victim's (with a new dataset, a new job and a read) is
    admitted within a second, taking the flooder's oldest."""
    dispatcher = processes("dispatcher")
    processes("worker", "--dispatcher-address", dispatcher.address)
    victim = DispatcherClient("grpc", dispatcher.address, 10.0, Security())
    relay = Relay(dispatcher.address)
    flooder = DispatcherClient("grpc", relay.address, 10.0, Security())
    counts = {"kept": 0, "refused": 0, "other": []}
    lock = threading.Lock()
    try:
        endless = data.register_dataset(dispatcher.target, data.Dataset.range(9).repeat())
        before = _victim_round(dispatcher, victim, 0)
        first = _resume(victim, endless, "victim-group", "victim-0")
        finite = _register_as(flooder, data.Dataset.range(3))
        serial = iter(range(ServiceLimits().max_jobs + 200))

        def flood() -> None:
            for n in serial:
                try:
                    _resume(flooder, finite, f"flood-{n}", f"flood-{n}-0")
                except errors.FailedPreconditionError:  # the wave was kept, the job refused
                    key = "kept"
                except errors.ResourceExhaustedError as err:
                    key = "refused" if "shared fairly" in err.message else "other"
                except errors.OpError as err:
                    key = "other"
                    with lock:
                        counts["other"].append(f"{type(err).__name__}: {err.message[:200]}")
                    continue
                with lock:
                    if key == "other":
                        counts["other"].append("unfair refusal")
                    else:
                        counts[key] += 1

        started = time.monotonic()
        threads = [threading.Thread(target=flood) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(240)
        flood_s = time.monotonic() - started
        assert not any(thread.is_alive() for thread in threads)
        second, took_second = timed(lambda: _resume(victim, endless, "victim-group",
                                                    "victim-1"))
        new_wave, took_new = timed(lambda: _resume(victim, endless, "victim-group-2",
                                                   "victim-0", round_=7))
        during = _victim_round(dispatcher, victim, 1)
        during.update({"second consumer's resume": took_second, "new wave": took_new})
        # The flooder's oldest wave went for the victim's new one: its next consumer is told.
        told = []
        for n in range(8):
            try:
                _resume(flooder, finite, f"flood-{n}", f"flood-{n}-1")
            except errors.FailedPreconditionError:
                continue  # it joined its wave (whose job is refused)
            except errors.ResourceExhaustedError as err:
                told.append(err.message)
    finally:
        victim.close()
        flooder.close()
        relay.close()
    print(f"\nresume-wave flood from 127.0.0.2 ({flood_s:.1f} s): {counts}; victim's "
          f"slowest before {before}, during {during}")
    assert second == first  # the victim's consumers read one job
    assert new_wave not in (0, first)
    assert counts["other"] == [], counts
    assert counts["kept"] == ServiceLimits().max_jobs - 1, counts
    assert counts["refused"] == 201, counts
    assert len(told) == 1 and "was displaced" in told[0] and "peer 127.0.0.2 held 4095 of " \
        "it, the most, and peer " in told[0], told
    assert max(during.values()) < allowed_for(max(before.values())), (before, during)


def _register_as(client: DispatcherClient, dataset: data.Dataset) -> str:
    """Register ``dataset`` through ``client`` (so as its peer)."""
    definition, buffers = graph.to_def(dataset.pipeline)
    response, _ = client.call(DataRequest(register_dataset=RegisterDatasetRequest(
        dataset=definition)), buffers)
    return response.register_dataset.dataset_id


@pytest.mark.timeout(120)
def test_a_stream_of_a_removed_job_is_never_started_again():
    """A consumer reads its anonymous job's stream (range(10**6)), two elements a read; the
    dispatcher removes the job (its release, as a displacement would) while the worker's
    stream runs. The consumer reads on as a reader does, retrying a read the worker
    answers with CancelledError (its stream closed under it): every element it gets is the
    next one, none twice, until the worker refuses the stream with NotFoundError saying the
    dispatcher removed the job (at its next heartbeat, here every 0.1 s)."""
    with data.DispatchServer(port=0) as dispatcher, data.WorkerServer(data.WorkerConfig(
            dispatcher_address=dispatcher.target.split("://")[1],
            heartbeat_interval_ms=100)) as worker:
        address = dispatcher.target.split("://")[1]
        client = DispatcherClient("grpc", address, 10.0, Security())
        channels = WorkerChannels(Security())
        try:
            dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(10**6))
            job = client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
                dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.OFF,
                job_key="anonymous/reader", consumer_id="reader")))[0].job
            spec = StreamSpec(job_id=job.job_id, dataset_id=dataset_id, grant=job.grant,
                              owner=job.owner, sharding_policy=job.sharding_policy)
            got: list[int] = []

            def read(seq: int) -> list[int]:
                response, buffers = channels.call("grpc", worker.address, DataRequest(
                    get_elements=GetElementsRequest(
                        stream=spec, consumer_id="reader", request_seq=seq, max_elements=2,
                        wait_seconds=1.0)), 10.0)
                return [int(x) for x in elements.decode_all(
                    response.get_elements.elements, buffers)]

            for seq in range(1, 4):
                got += read(seq)
            client.call(DataRequest(client_heartbeat=ClientHeartbeatRequest(
                job_id=job.job_id, consumer_id="reader", release=True)))
            deadline, retried, seq = time.monotonic() + 30, 0, 4
            while time.monotonic() < deadline:
                try:
                    got += read(seq)
                    seq += 1
                except errors.CancelledError:
                    retried += 1  # the read in flight when the stream closed: asked again
                except errors.NotFoundError as err:
                    refused = err.message
                    break
            else:
                raise AssertionError(f"still read {len(got)} elements after 30 s")
        finally:
            client.close()
            channels.close()
    print(f"\nread {len(got)} elements of the removed job's stream until the worker's next "
          f"heartbeat ({retried} reads retried), then: {refused[:80]}...")
    assert got == list(range(len(got))) and len(got) >= 6
    assert f"Job {job.job_id} is no longer one of the dispatcher's jobs" in refused


@pytest.mark.timeout(120)
def test_a_job_created_while_a_heartbeat_is_answered_keeps_its_stream():
    """A worker heartbeating without pause (every 1 ms): its answers often list the jobs of
    a moment before a job was created and its stream opened. 100 anonymous jobs, each read
    5 times right after its creation, then released: every read gets the next elements (a
    job the answer could not list yet is not taken for removed: its stream is not closed
    under its reader, nor refused)."""
    with data.DispatchServer(port=0) as dispatcher, data.WorkerServer(data.WorkerConfig(
            dispatcher_address=dispatcher.target.split("://")[1],
            heartbeat_interval_ms=1)) as worker:
        client = DispatcherClient("grpc", dispatcher.target.split("://")[1], 10.0, Security())
        channels = WorkerChannels(Security())
        failures: list[str] = []
        try:
            dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(10**6))
            for n in range(100):
                consumer = f"reader-{n}"
                job = client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
                    dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.OFF,
                    job_key=f"anonymous/{consumer}", consumer_id=consumer)))[0].job
                spec = StreamSpec(job_id=job.job_id, dataset_id=dataset_id, grant=job.grant,
                                  owner=job.owner, sharding_policy=job.sharding_policy)
                got: list[int] = []
                for seq in range(1, 6):
                    try:
                        response, buffers = channels.call("grpc", worker.address, DataRequest(
                            get_elements=GetElementsRequest(
                                stream=spec, consumer_id=consumer, request_seq=seq,
                                max_elements=2, wait_seconds=1.0)), 10.0)
                    except errors.OpError as err:
                        failures.append(f"job {n} read {seq}: {type(err).__name__}")
                        break
                    got += [int(x) for x in elements.decode_all(
                        response.get_elements.elements, buffers)]
                if got != list(range(len(got))) or len(got) < 5:
                    failures.append(f"job {n}: {got}")
                channels.call("grpc", worker.address, DataRequest(
                    release_streams=ReleaseStreamsRequest(consumer_id=consumer,
                                                          streams=[spec])), 10.0)
        finally:
            client.close()
            channels.close()
    assert failures == [], failures[:10]
