"""Vouched positions (issue 29): every offset a consumer hands back is one the service handed
it, for sources whose splits have no known size (from_files, TFRecordDataset, unbatch).

Real dispatcher and worker processes on 127.0.0.1. A raw co-consumer of a victim's named
distributed_epoch job replays each attack: plant 2**62, plant -5, lower an offset of another
consumer's split, replay another job's vouch, forge one; each is refused with the right error
(at the dispatcher's resume and release and at the worker's read), and the victim then reads
every element exactly once. Honest consumers resume in both modes, also from an older
checkpoint of their own.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from conftest import free_ports, read_together, wait_for
from test_data_positions import HUGE, raw_client, take

from clusterwire import data, errors
from clusterwire.data import elements
from clusterwire.data.rpc import WorkerChannels
from clusterwire.protos.data_service_pb2 import (
    ClientHeartbeatRequest,
    DataRequest,
    GetElementsRequest,
    GetOrCreateJobRequest,
    GetSplitRequest,
    SplitOffset,
    StreamSpec,
    Vouch,
)
from clusterwire.security import Security

pytestmark = pytest.mark.timeout(180)

FILES = 4
LINES = 150  # per file: a file is a split's unit
COUNT = FILES * LINES
DYNAMIC = data.ShardingPolicy.DYNAMIC


def write_sources(root) -> dict[str, data.Dataset]:
    """The three sources, each of the elements 0..COUNT-1 (as text, records or ints)."""
    texts, records = [], []
    for index in range(FILES):
        numbers = range(index * LINES, (index + 1) * LINES)
        texts.append(str(root / f"lines{index}.txt"))
        with open(texts[-1], "w") as out:
            out.write("".join(f"{n}\n" for n in numbers))
        records.append(str(root / f"records{index}.tfrecord"))
        with data.TFRecordWriter(records[-1]) as writer:
            for n in numbers:
                writer.write(str(n).encode())
    return {"from_files": data.Dataset.from_files(texts),
            "tfrecord": data.TFRecordDataset(records),
            "unbatch": data.Dataset.range(COUNT).batch(7).unbatch()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("vouched")
    return root, write_sources(root)


def start(processes, root, *dispatcher_args: str):
    dispatcher = processes("dispatcher", *dispatcher_args)
    workers = [processes("worker", "--dispatcher-address", dispatcher.address,
                         "--readable-dir", str(root)) for _ in range(2)]
    wait_for(lambda: len(data.service_status(dispatcher.target).workers) == 2, timeout=30,
             what="2 workers registered")
    return dispatcher, workers


class RawConsumer:
    """A consumer speaking the protocol itself, as an attacker's client does."""

    def __init__(self, dispatcher, dataset_id: str, job_name: str, consumer: str):
        self.client, self.channels = raw_client(dispatcher), WorkerChannels(Security())
        self.dataset_id, self.job_key, self.consumer, self.seq = (
            dataset_id, f"{job_name}/0", consumer, 0)
        joined, _ = self.client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy=DYNAMIC, job_key=f"{job_name}/0",
            named=True, consumer_id=consumer)))
        self.job = joined.job

    def split(self, resumable: bool = False):
        got, _ = self.client.call(DataRequest(get_split=GetSplitRequest(
            job_id=self.job.job_id, consumer_id=self.consumer, resumable=resumable)))
        assert got.get_split.has_split
        return got.get_split.split

    def spec(self, split, attempt: int) -> StreamSpec:
        return StreamSpec(job_id=self.job.job_id, dataset_id=self.dataset_id, is_split=True,
                          split_id=split.split_id, unit_start=split.unit_start,
                          unit_end=split.unit_end, grant=split.grant, attempt=attempt,
                          handed_at=split.offset)

    def read(self, worker, split, count: int, offset: int = 0, vouch: Vouch | None = None,
             attempt: int = 1) -> tuple[list[int], Vouch]:
        """``count`` elements of ``split`` from ``worker`` (a stream opened at ``offset``) and
        the worker's vouch for the last batch."""
        got: list[int] = []
        last = None
        while len(got) < count:
            self.seq += 1
            response, buffers = self.channels.call("grpc", worker.address, DataRequest(
                get_elements=GetElementsRequest(
                    stream=self.spec(split, attempt), consumer_id=self.consumer,
                    request_seq=self.seq, offset=offset, vouch=vouch,
                    max_elements=count - len(got), wait_seconds=5)), 30.0)
            got += [int(x) for x in elements.decode_all(response.get_elements.elements,
                                                        buffers)]
            last = response.get_elements.vouch
            assert len(got) == count or not response.get_elements.end_of_stream
        return got, last

    def resume(self, *partial: SplitOffset) -> None:
        self.client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
            dataset_id=self.dataset_id, sharding_policy=DYNAMIC, job_key=self.job_key,
            named=True, consumer_id=self.consumer, resume=True, handed=0, partial=partial,
            generation=time.time_ns())))

    def release(self, *unfinished: SplitOffset, resumable: bool = True) -> None:
        self.client.call(DataRequest(client_heartbeat=ClientHeartbeatRequest(
            job_id=self.job.job_id, consumer_id=self.consumer, release=True,
            resumable=resumable, unfinished=unfinished)))

    def close(self) -> None:
        self.channels.close()
        self.client.close()


def refused(error: type[errors.OpError], match: str, *calls) -> None:
    """Each of ``calls`` raises ``error`` matching ``match``."""
    for call in calls:
        with pytest.raises(error, match=match):
            call()


@pytest.mark.parametrize("kind", ["from_files", "tfrecord", "unbatch"])
def test_a_co_consumer_hands_back_only_offsets_the_service_handed_it(processes, sources, kind):
    root, datasets = sources
    dispatcher, workers = start(processes, root, "--job-gc-timeout-ms", "1000",
                                "--job-gc-check-interval-ms", "200")
    dataset_id = data.register_dataset(dispatcher.target, datasets[kind])
    alice = RawConsumer(dispatcher, dataset_id, "team", "alice")
    mallory = RawConsumer(dispatcher, dataset_id, "team", "mallory")
    elsewhere = RawConsumer(dispatcher, dataset_id, "other", "mallory")
    try:
        # Alice reads 10 elements of split 0 and gives it back there (honestly, vouched).
        split = alice.split()
        alice_got, alice_vouch = alice.read(workers[0], split, 10)
        alice.release(SplitOffset(split_id=split.split_id, offset=10, vouch=alice_vouch),
                      resumable=False)
        # Mallory is handed it at 10, keeps it (resumable) and reads 10 of it, then 15
        # elements of split 0 of another job (a split has 42 elements or more).
        handed = mallory.split(resumable=True)
        assert (handed.split_id, handed.offset) == (split.split_id, 10)
        _, mine = mallory.read(workers[1], handed, 10, offset=10)
        assert 10 <= mine.start < mine.end == 20  # the last batch's elements
        other_split = elsewhere.split()
        assert other_split.split_id == split.split_id
        _, other_vouch = elsewhere.read(workers[0], other_split, 15)
        sid = split.split_id

        def at(offset: int, vouch: Vouch | None = None) -> SplitOffset:
            return SplitOffset(split_id=sid, offset=offset, vouch=vouch)

        def worker_read(offset: int, vouch: Vouch | None):
            return lambda: mallory.read(workers[0], handed, 1, offset, vouch, attempt=7)

        forged = Vouch(job_id=mallory.job.job_id, consumer_id="mallory", start=0, end=HUGE,
                       mac=b"\x00" * 32)
        replayed = Vouch()
        replayed.CopyFrom(other_vouch)
        relabelled = Vouch()
        relabelled.CopyFrom(other_vouch)
        relabelled.job_id = mallory.job.job_id
        # Plant 2**62: unvouched, beyond the vouch, forged.
        refused(errors.PermissionDeniedError, f"offset {HUGE} of split {sid}",
                lambda: mallory.resume(at(HUGE)), lambda: mallory.resume(at(HUGE, mine)),
                lambda: mallory.resume(at(HUGE, forged)), lambda: mallory.release(at(HUGE)),
                lambda: mallory.release(at(HUGE, handed.vouch)),
                worker_read(HUGE, None), worker_read(HUGE, handed.vouch))
        # Plant -5.
        refused(errors.InvalidArgumentError, f"split {sid} at offset -5",
                lambda: mallory.resume(at(-5)), lambda: mallory.release(at(-5)),
                worker_read(-5, None))
        # Lower alice's offset: below where the split was handed to mallory, with mallory's
        # vouch or alice's, or read it from there on a worker.
        refused(errors.PermissionDeniedError, f"split {sid} at offset (0|3|5), but job .* "
                "handed it to consumer 'mallory' at offset 10",
                lambda: mallory.resume(at(0)), lambda: mallory.resume(at(3, mine)),
                lambda: mallory.resume(at(5, alice_vouch)), worker_read(0, None),
                worker_read(5, alice_vouch))
        # Replay another job's vouch (as it is, or relabelled with this job).
        refused(errors.PermissionDeniedError, f"offset 15 of split {sid} .* is of job "
                f"{elsewhere.job.job_id}, not job {mallory.job.job_id}",
                lambda: mallory.resume(at(15, replayed)),
                lambda: mallory.release(at(15, replayed)), worker_read(15, replayed))
        refused(errors.PermissionDeniedError, "offset 15 .* not the service's",
                lambda: mallory.resume(at(15, relabelled)), worker_read(15, relabelled))
        # Mallory leaves returning none of it past alice's 10: after job_gc_timeout its
        # split goes to the victim at 10, who reads everything else exactly once.
        mallory.release(at(10))
        victim = iter(data.from_dataset_id("distributed_epoch", dispatcher.target, dataset_id,
                                           job_name="team"))
        assert Counter(alice_got + read_together([victim])) == Counter(range(COUNT))
    finally:
        for consumer in (alice, mallory, elsewhere):
            consumer.close()


@pytest.mark.parametrize("kind", ["from_files", "tfrecord", "unbatch"])
def test_honest_consumers_resume_in_both_modes(processes, sources, kind):
    """distributed_epoch: from the latest checkpoint and from an older one of its own (TF's
    semantics: what was returned after the checkpoint is returned again); parallel_epochs
    (each of 2 workers a whole copy). Positions go through JSON, as saved files do."""
    root, datasets = sources
    dispatcher, _ = start(processes, root)
    dataset = datasets[kind]
    dataset_id = data.register_dataset(dispatcher.target, dataset)

    def distributed(state=None):
        return iter(data.from_dataset_id("distributed_epoch", dispatcher.target, dataset_id,
                                         job_name="resume", state=state))

    reader = distributed()
    first = take(reader, 25)
    older = json.loads(json.dumps(reader.state_dict()))
    later = first + take(reader, 250)
    latest = json.loads(json.dumps(reader.state_dict()))
    take(reader, 10)  # returned after the checkpoint: returned again by the resume
    reader.close()
    resumed = distributed(latest)
    assert Counter(later + [int(x) for x in resumed]) == Counter(range(COUNT))
    resumed.close()
    again = distributed(older)  # the older checkpoint: everything after it once more
    assert Counter(first + [int(x) for x in again]) == Counter(range(COUNT))
    again.close()

    parallel = iter(dataset.apply(data.distribute("parallel_epochs", dispatcher.target)))
    first = take(parallel, 100)
    state = json.loads(json.dumps(parallel.state_dict()))
    parallel.close()
    rest = [int(x) for x in dataset.apply(data.distribute("parallel_epochs", dispatcher.target,
                                                          state=state))]
    assert Counter(first + rest) == Counter(2 * list(range(COUNT)))


def test_parallel_epochs_positions_skip_only_what_was_vouched(processes, sources):
    """A parallel_epochs position's stream offset raised to 2**62, moved to the other
    worker, or saved by an older clusterwire (version 1, unvouched) is refused; the workers
    stay free for an honest read."""
    root, datasets = sources
    dispatcher, _ = start(processes, root)
    dataset = datasets["from_files"].repeat()
    honest = iter(dataset.apply(data.distribute("parallel_epochs", dispatcher.target)))
    take(honest, 50)
    state = honest.state_dict()
    honest.close()
    # `one`: the worker most of them came from.
    (one, [count, vouch]), (two, [count2, vouch2]) = sorted(
        state["streams"].items(), key=lambda item: -item[1][0])
    assert count + count2 == 50 and vouch["end"] >= count

    def resume(position):
        return next(iter(dataset.apply(data.distribute("parallel_epochs", dispatcher.target,
                                                       state=position))))

    raised = {**state, "streams": {one: [HUGE, vouch], two: [count2, vouch2]}}
    with pytest.raises(errors.PermissionDeniedError, match=f"offset {HUGE} of worker {one}"):
        resume(raised)
    if count2:  # the other worker's vouch for this worker's stream
        swapped = {**state, "streams": {one: [count2, vouch2], two: [count2, vouch2]}}
        with pytest.raises(errors.PermissionDeniedError, match="not the service's"):
            resume(swapped)
    unsigned = {**state, "streams": {one: [count], two: [count2]}}
    with pytest.raises(errors.PermissionDeniedError, match="no vouch"):
        resume(unsigned)
    old = {**state, "version": 1, "streams": {one: count, two: count2}}
    with pytest.raises(errors.InvalidArgumentError, match="version 1 .* no vouch"):
        resume(old)
    assert Counter(int(x) for x in datasets["from_files"].apply(
        data.distribute("parallel_epochs", dispatcher.target))) == Counter(
            2 * list(range(COUNT)))


def test_positions_resume_across_a_fault_tolerant_dispatcher_restart(processes, sources,
                                                                      tmp_path):
    """The vouches are under the dispatcher's grant key, which its journal keeps: after a
    SIGKILL and restart both modes' positions resume, exactly."""
    root, datasets = sources
    ft = ["--fault-tolerant-mode", "--work-dir", str(tmp_path / "work")]
    dispatcher, _ = start(processes, root, "--port", "0", *ft)
    dataset_id = data.register_dataset(dispatcher.target, datasets["tfrecord"],
                                       dataset_id="kept")
    distributed = iter(data.from_dataset_id("distributed_epoch", dispatcher.target,
                                            dataset_id, job_name="ft"))
    first = take(distributed, 40)
    saved = json.loads(json.dumps(distributed.state_dict()))
    distributed.close()
    parallel = iter(data.from_dataset_id("parallel_epochs", dispatcher.target, dataset_id))
    first_parallel = take(parallel, 40)
    saved_parallel = json.loads(json.dumps(parallel.state_dict()))
    parallel.close()
    dispatcher.kill()
    dispatcher = processes("dispatcher", "--port", str(dispatcher.port), *ft)
    wait_for(lambda: len(data.service_status(dispatcher.target).workers) == 2, timeout=30,
             what="the workers registered again")
    rest = [int(x) for x in data.from_dataset_id("distributed_epoch", dispatcher.target,
                                                 dataset_id, job_name="ft", state=saved)]
    assert Counter(first + rest) == Counter(range(COUNT))
    rest = [int(x) for x in data.from_dataset_id("parallel_epochs", dispatcher.target,
                                                 dataset_id, state=saved_parallel)]
    assert Counter(first_parallel + rest) == Counter(2 * list(range(COUNT)))


@pytest.mark.parametrize("policy", [data.ShardingPolicy.FILE, data.ShardingPolicy.DATA])
def test_a_static_shard_position_resumes_exactly_and_only_as_vouched(sources, policy):
    """Static sharding (each worker one shard, its stream an anonymous job's): an honest
    position resumes exactly; its offset raised past the elements its vouch covers is
    refused."""
    root, datasets = sources
    ports = free_ports(2)
    dispatcher = data.DispatchServer(data.DispatcherConfig(
        port=0, worker_addresses=[f"localhost:{port}" for port in ports]))
    address = dispatcher.target.split("://")[1]
    workers = [data.WorkerServer(data.WorkerConfig(dispatcher_address=address, port=port,
                                                   readable_dirs=[str(root)]))
               for port in ports]
    try:
        wait_for(lambda: dispatcher.num_workers() == 2, what="2 workers")
        dataset = datasets["from_files"]
        reader = iter(dataset.apply(data.distribute(policy, dispatcher.target)))
        first = take(reader, 70)
        state = json.loads(json.dumps(reader.state_dict()))
        reader.close()
        rest = [int(x) for x in dataset.apply(data.distribute(policy, dispatcher.target,
                                                              state=state))]
        assert Counter(first + rest) == Counter(range(COUNT))
        # Past the elements the worker handed (its vouch's range: the batch holding `count`).
        worker, [count, vouch] = max(state["streams"].items(), key=lambda item: item[1][0])
        past = vouch["end"] + 1
        raised = {**state, "streams": {**state["streams"], worker: [past, vouch]}}
        with pytest.raises(errors.PermissionDeniedError, match=f"offset {past} of worker"):
            list(dataset.apply(data.distribute(policy, dispatcher.target, state=raised)))
    finally:
        for worker_server in workers:
            worker_server.stop()
        dispatcher.stop()
