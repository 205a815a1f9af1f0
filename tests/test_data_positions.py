"""Positions the data service can trust, and a worker's bounds under streams a client keeps
(issue 29).

Real dispatcher and worker processes on 127.0.0.1. Each attack a red team ran is replayed:
refused with the right error, the victim's stream complete and exact, the worker's CPU idle
once the forged stream's reader is gone (measured from /proc/PID/stat over a window), its
memory within the stated bound.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import cw_data_functions as fns
import pytest
from conftest import read_together, wait_for

from clusterwire import data, errors
from clusterwire.data.pipeline import split_plan
from clusterwire.data.position import split_limit
from clusterwire.data.quotas import ServiceLimits
from clusterwire.data.rpc import DispatcherClient, WorkerChannels
from clusterwire.data.streams import READER_GONE_S, Stream
from clusterwire.protos.data_service_pb2 import (
    ClientHeartbeatRequest,
    DataRequest,
    GetElementsRequest,
    GetOrCreateJobRequest,
    GetSplitRequest,
    SplitOffset,
    StreamSpec,
)
from clusterwire.security import Security

pytestmark = pytest.mark.timeout(120)

COUNT = 600
HUGE = 2 ** 62
#: A worker process using less CPU than this over a window is idle (heartbeats, polls).
IDLE_CPU = 0.15


def start_service(processes, *dispatcher_args: str, workers: int = 2):
    """A dispatcher and ``workers`` worker processes, all registered."""
    dispatcher = processes("dispatcher", *dispatcher_args)
    started = [processes("worker", "--dispatcher-address", dispatcher.address,
                         "--import", "cw_data_functions") for _ in range(workers)]
    wait_for(lambda: len(data.service_status(dispatcher.target).workers) == workers,
             timeout=30, what=f"{workers} workers registered")
    return dispatcher, started


def raw_client(dispatcher) -> DispatcherClient:
    return DispatcherClient("grpc", dispatcher.address, 10.0, Security())


def take(iterator, count: int) -> list[int]:
    return [int(next(iterator)) for _ in range(count)]


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_use(pid: int, window: float = 2.0) -> float:
    """The CPUs process ``pid`` used on average over the next ``window`` seconds."""
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(window)  # the measuring window itself, not a synchronisation
    return (cpu_seconds(pid) - before) / (time.monotonic() - started)


def await_cpu(pid: int, wanted, what: str, timeout: float) -> None:
    """Wait for a window in which process ``pid``'s CPU use is ``wanted``; fail the test if
    none comes within ``timeout`` seconds."""
    deadline, use = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        use = cpu_use(pid)
        if wanted(use):
            return
    pytest.fail(f"worker {pid} not {what} after {timeout:g} s: {use:.2f} CPU")


def await_idle(pid: int, timeout: float) -> None:
    await_cpu(pid, lambda use: use < IDLE_CPU, "idle", timeout)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# ---- distributed_epoch: a co-consumer cannot plant split offsets --------------------------------

@pytest.mark.parametrize("dataset,limit", [
    (data.Dataset.range(1000), 100),
    (data.Dataset.range(1000).map(fns.square).filter(fns.is_even), 100),
    (data.Dataset.range(1000).batch(7), 15),
    (data.Dataset.range(1000).batch(7).take(3), 3),
    (data.Dataset.range(1000).batch(7).unbatch(), None),
    (data.Dataset.range(1000).batch(7).repeat(), None),
    (data.Dataset.range(1000).batch(7).repeat(2), 30),
    (data.Dataset.from_files(["a", "b"]), None),  # a file has any number of lines
])
def test_a_split_offset_is_bounded_by_what_the_split_yields(dataset, limit):
    pipe = dataset.pipeline
    assert split_limit(pipe.source, split_plan(pipe).ops, 100) == limit


def test_a_co_consumer_cannot_plant_split_offsets_and_the_victim_reads_every_element_once(
        processes):
    """Mallory, a raw co-consumer of the victim's named job, takes a split and tries to put it
    at offset -5 or 2**62 through a resume, a release and a worker read (measured before: -5
    failed the victim's iteration with an InternalError, 2**62 made it miss 251 elements).
    Every attempt is refused; the victim then reads every element once."""
    dispatcher, workers = start_service(processes, "--job-gc-timeout-ms", "1000",
                                        "--job-gc-check-interval-ms", "200")
    dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(COUNT))
    client = raw_client(dispatcher)
    try:
        joined, _ = client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.DYNAMIC,
            job_key="team/0", named=True, consumer_id="mallory")))
        job = joined.job
        got, _ = client.call(DataRequest(get_split=GetSplitRequest(
            job_id=job.job_id, consumer_id="mallory", resumable=True)))
        split = got.get_split.split
        units = split.unit_end - split.unit_start
        victim = iter(data.from_dataset_id("distributed_epoch", dispatcher.target, dataset_id,
                                           job_name="team"))
        for offset in (-5, units + 1, HUGE):
            planted = [SplitOffset(split_id=split.split_id, offset=offset)]
            with pytest.raises(errors.InvalidArgumentError,
                               match=f"split {split.split_id} at offset {offset}, outside"):
                client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
                    dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.DYNAMIC,
                    job_key="team/0", named=True, consumer_id="mallory", resume=True,
                    handed=0, partial=planted, generation=time.time_ns())))
            with pytest.raises(errors.InvalidArgumentError, match="outside the split"):
                client.call(DataRequest(client_heartbeat=ClientHeartbeatRequest(
                    job_id=job.job_id, consumer_id="mallory", release=True, resumable=True,
                    unfinished=planted)))
            spec = StreamSpec(job_id=job.job_id, dataset_id=dataset_id, is_split=True,
                              split_id=split.split_id, unit_start=split.unit_start,
                              unit_end=split.unit_end, grant=split.grant, attempt=1)
            with pytest.raises(errors.InvalidArgumentError, match="skip|outside the split"):
                WorkerChannels(Security()).call("grpc", workers[0].address, DataRequest(
                    get_elements=GetElementsRequest(stream=spec, consumer_id="mallory",
                                                    request_seq=1, offset=offset)), 10.0)
        # Mallory leaves honestly, having read nothing: its split is the victim's to read.
        client.call(DataRequest(client_heartbeat=ClientHeartbeatRequest(
            job_id=job.job_id, consumer_id="mallory", release=True, resumable=True,
            unfinished=[SplitOffset(split_id=split.split_id, offset=0)])))
        assert Counter(read_together([victim])) == Counter(range(COUNT))
    finally:
        client.close()


def test_a_consumer_reports_only_its_own_splits_done(processes):
    """A split given back to the pool is nobody's: another consumer naming it done does not
    drop it (the victim would silently miss its elements)."""
    dispatcher, _ = start_service(processes)
    dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(COUNT))
    client = raw_client(dispatcher)
    try:
        joined, _ = client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.DYNAMIC,
            job_key="pool/0", named=True, consumer_id="alice")))
        job = joined.job
        got, _ = client.call(DataRequest(get_split=GetSplitRequest(
            job_id=job.job_id, consumer_id="alice")))
        pooled = got.get_split.split.split_id
        client.call(DataRequest(client_heartbeat=ClientHeartbeatRequest(
            job_id=job.job_id, consumer_id="alice", release=True)))  # back to the pool
        client.call(DataRequest(get_split=GetSplitRequest(  # mallory names it done
            job_id=job.job_id, consumer_id="mallory", done=[pooled], held=[pooled])))
        client.call(DataRequest(client_heartbeat=ClientHeartbeatRequest(
            job_id=job.job_id, consumer_id="mallory", release=True)))
    finally:
        client.close()
    victim = data.from_dataset_id("distributed_epoch", dispatcher.target, dataset_id,
                                  job_name="pool")
    assert Counter(read_together([iter(victim)])) == Counter(range(COUNT))


# ---- a forged skip costs nothing -----------------------------------------------------------

def test_a_forged_skip_is_refused_and_costs_the_worker_nothing(processes):
    """A forged position skipping 2**60 rounds of an infinite dataset (a parallel_epochs one
    skipping 2**62 elements spun a worker thread at 1.18 CPU after its iterator closed,
    before positions were vouched for): the worker refuses an offset beyond the vouch of the
    last element the consumer returned from it (PermissionDeniedError), so nothing is
    skipped and the worker stays idle; so is a raw read's unvouched offset, and one past a
    finite dataset's end (InvalidArgumentError). parallel_epochs and distributed_epoch
    offsets: test_data_position_vouches."""
    dispatcher, [worker] = start_service(processes, workers=1)
    dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(1000).repeat())
    honest = round_robin(dispatcher.target, dataset_id, 0)
    take(honest, 5)
    state = honest.state_dict()
    honest.close()
    [(address, [rounds, vouch])] = state["streams"].items()
    assert rounds == 5 and (vouch["start"], vouch["end"]) == (8, 9)  # round 4: position 8
    # 2**60 rounds: round-robin stream positions are rounds x consumers (an int64).
    for forged, match in [({**state, "elements": 2 ** 60}, "covers elements 8 to 9 only"),
                          ({**state, "elements": 2 ** 60, "streams": {}}, "no vouch")]:
        resumed = round_robin(dispatcher.target, dataset_id, 0, forged)
        with pytest.raises(errors.PermissionDeniedError, match=match):
            next(resumed)
        resumed.close()
    await_idle(worker.process.pid, timeout=10)

    client, channels = raw_client(dispatcher), WorkerChannels(Security())
    try:
        finite = data.register_dataset(dispatcher.target, data.Dataset.range(10))
        for dataset, consumers, offsets, error, match in [
                (dataset_id, 2, (HUGE,), errors.PermissionDeniedError, "offset {} .* no vouch"),
                (dataset_id, 0, (HUGE,), errors.PermissionDeniedError, "offset {} .* no vouch"),
                (finite, 0, (-5, 11), errors.InvalidArgumentError, "skip {} elements")]:
            job, _ = client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
                dataset_id=dataset, sharding_policy=data.ShardingPolicy.OFF,
                job_key=f"raw-{dataset}-{consumers}/0", named=bool(consumers),
                num_consumers=consumers, consumer_id="raw")))
            spec = StreamSpec(job_id=job.job.job_id, dataset_id=dataset, sharding_policy=0,
                              num_consumers=consumers, grant=job.job.grant,
                              owner=job.job.owner)
            for offset in offsets:
                with pytest.raises(error, match=match.format(offset)):
                    channels.call("grpc", worker.address, DataRequest(
                        get_elements=GetElementsRequest(stream=spec, consumer_id="raw",
                                                        request_seq=1, offset=offset,
                                                        wait_seconds=0.1)), 10.0)
        await_idle(worker.process.pid, timeout=10)
    finally:
        channels.close()
        client.close()
    # Another consumer reads at full speed meanwhile.
    assert sorted(int(x) for x in data.Dataset.range(100).apply(
        data.distribute("parallel_epochs", dispatcher.target))) == list(range(100))


def test_a_skip_runs_only_while_a_reader_asks_and_ends_with_its_stream():
    """An honest resume's skip (vouched, so at most what was produced before) passes over the
    elements on the stream's thread only while a reader asked within READER_GONE_S, and ends
    when the stream is closed."""
    passed = [0]

    def endless():
        while True:
            passed[0] += 1
            yield passed[0]

    def settled() -> bool:  # no element passed over a window of the skip's thread
        before = passed[0]
        time.sleep(0.5)  # the measuring window itself, not a synchronisation
        return passed[0] == before

    stream = Stream(endless(), lambda element: element, skip=HUGE)
    try:
        wait_for(settled, timeout=READER_GONE_S + 30, what="the skip paused without a reader")
        paused_at = passed[0]
        assert stream.fetch("reader", 1, 1, 1 << 20, wait=0.1) == ([], False)
        wait_for(lambda: passed[0] > paused_at, timeout=30, what="the skip going on for a reader")
    finally:
        stream.close()
    wait_for(lambda: not stream._thread.is_alive(), timeout=30, what="the skip's thread ended")
    assert passed[0] < HUGE


# ---- round-robin: resumed as often as they checkpoint, not blocked by others -----------------

def round_robin(target: str, dataset_id: str, index: int, state=None):
    return iter(data.from_dataset_id("parallel_epochs", target, dataset_id, job_name="rr",
                                     consumer_index=index, num_consumers=2, state=state))


def test_round_robin_consumers_resume_at_every_checkpoint_whatever_another_client_asks(
        processes):
    """Resumed from round 5, then from round 10 (refused before: a plain bug), with another
    client asking first for the group's name at round 999 (it blocked the resume before):
    each consumer gets round r's element, (r // 2) * 2 + c of worker r mod 2's stream."""
    dispatcher, _ = start_service(processes)
    dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(1000).repeat())
    client = raw_client(dispatcher)
    seen: list[list[int]] = [[], []]
    states = [None, None]
    try:
        for rounds in (5, 5, 7):
            # Another client names the job's group at another round first.
            client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
                dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.OFF,
                job_key="rr/0/round-999", named=True, num_consumers=2, consumer_id="eve",
                resume_group="rr/0", resume_round=999)))
            consumers = [round_robin(dispatcher.target, dataset_id, c, states[c])
                         for c in range(2)]
            for c, consumer in enumerate(consumers):
                seen[c] += take(consumer, rounds)
            states = [consumer.state_dict() for consumer in consumers]
            for consumer in consumers:
                take(consumer, 3)  # read past the position, then stopped
                consumer.close()
    finally:
        client.close()
    assert [state["elements"] for state in states] == [17, 17]
    for c in range(2):
        assert seen[c] == [((r // 2) * 2 + c) % 1000 for r in range(17)]


def test_round_robin_consumers_resume_twice_from_one_checkpoint(processes):
    """Restarted from the same checkpoint twice (the trainer died again before its next
    one): each wave of resumes reads a job of its own, so the second gets rounds 5-12 as the
    first did (it joined the first's job, whose positions were read already, before)."""
    dispatcher, _ = start_service(processes)
    dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(1000).repeat())
    consumers = [round_robin(dispatcher.target, dataset_id, c) for c in range(2)]
    before = [take(consumer, 5) for consumer in consumers]
    states = [consumer.state_dict() for consumer in consumers]
    for consumer in consumers:
        consumer.close()
    waves = []
    for _ in range(2):
        resumed = [round_robin(dispatcher.target, dataset_id, c, states[c]) for c in range(2)]
        waves.append([take(consumer, 8) for consumer in resumed])
        for consumer in resumed:
            consumer.close()
    for c in range(2):
        expected = [((r // 2) * 2 + c) % 1000 for r in range(13)]
        assert before[c] + waves[0][c] == before[c] + waves[1][c] == expected


# ---- worker memory under streams a client keeps -----------------------------------------------

def test_streams_nobody_reads_hold_at_most_their_buffers(processes):
    """16 streams of 1 MiB elements whose readers stopped taking them (16 invented split
    streams grew a worker from 68 MiB to 3.1-4.2 GiB): each holds at most stream_buffer_bytes
    with the batch remembered for its reader's retry, and the element that filled it (the
    worker grew 453 MiB here when the remembered batch and the element waiting for room came
    on top)."""
    dispatcher, [worker] = start_service(processes, workers=1)
    dataset = data.Dataset.range(10 ** 9).map(fns.fill_1m)
    baseline = rss_bytes(worker.process.pid)
    readers = [iter(dataset.apply(data.distribute("parallel_epochs", dispatcher.target,
                                                  compression=None))) for _ in range(16)]
    try:
        for reader in readers:
            next(reader)

        def buffered() -> float:
            report = data.service_status(worker.target)
            return sum(s.value for s in report.metrics
                       if s.name == "clusterwire_data_buffered_elements")

        # Each reader holds a read's batch of 8 MiB (remembered for its retry); the buffer
        # fills the rest of the stream's room.
        per_stream = ServiceLimits().stream_buffer_bytes // (1 << 20) + 1
        wait_for(lambda: buffered() >= 16 * (per_stream // 2 - 1), timeout=60,
                 what="the 16 streams' buffers full")
        # A stream's room, and a read's batch of 8 MiB the transport copied on its way out
        # (the allocator keeps that memory); + threads and allocator slack.
        bound = 16 * (per_stream + 8) * (1 << 20) + (32 << 20)
        for _ in range(4):  # held, not only reached
            grown = rss_bytes(worker.process.pid) - baseline
            assert grown <= bound, (grown >> 20, bound >> 20)
            cpu_use(worker.process.pid, 0.5)
    finally:
        for reader in readers:
            reader.close()


def test_one_consumer_holds_at_most_its_share_of_a_worker_streams(processes):
    """A raw consumer opening anonymous jobs' streams under one consumer id, all kept busy:
    the 17th is refused (ResourceExhaustedError naming the share), and another consumer
    reads meanwhile."""
    dispatcher, [worker] = start_service(processes, workers=1)
    dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(10).repeat())
    client, channels = raw_client(dispatcher), WorkerChannels(Security())

    def open_stream(job: int) -> None:
        response, _ = client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.OFF,
            job_key=f"anonymous/hog-{job}", consumer_id="hog")))
        spec = StreamSpec(job_id=response.job.job_id, dataset_id=dataset_id,
                          grant=response.job.grant, owner="hog")
        channels.call("grpc", worker.address, DataRequest(get_elements=GetElementsRequest(
            stream=spec, consumer_id="hog", request_seq=1, max_elements=1)), 10.0)

    try:
        for job in range(16):
            open_stream(job)
        with pytest.raises(errors.ResourceExhaustedError, match="16 of them for this consumer"):
            open_stream(16)
        assert sorted(int(x) for x in data.Dataset.range(50).apply(
            data.distribute("parallel_epochs", dispatcher.target))) == list(range(50))
    finally:
        channels.close()
        client.close()
