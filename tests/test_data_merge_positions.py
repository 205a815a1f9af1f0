"""Job positions (issue 31): the positions of all N consumers of a distributed_epoch job,
saved at one step, merged by ``data.merge_states`` and resumed by M new consumers, every
element of the epoch exactly once over the whole run (Counter equality), also with
``global_shuffle`` (each split's elements in the epoch's permuted order, its unread part read
on by one consumer from where the position left it), across a SIGKILLed fault-tolerant
dispatcher restarted between save and resume, and with a worker SIGKILLed during the resumed
epoch. A forged, foreign, partial or doubled merged position is refused with the right error,
and positions that do not merge say why."""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import in_process_data_service, wait_for
from test_data_resume import run_trainers, start_trainer

from clusterwire import data, errors
from clusterwire.data import position, splits
from clusterwire.data.rpc import DispatcherClient
from clusterwire.data.splits import PROVIDERS
from clusterwire.protos.data_service_pb2 import DataRequest, GetOrCreateJobRequest
from clusterwire.security import Security

pytestmark = pytest.mark.timeout(240)

# 40 splits of 4096 elements (MAX_SPLIT_UNITS) on 2 workers: 8 consumers holding 4 each
# (SLOTS_PER_WORKER) leave some never handed out before the save.
COUNT = 40 * 4096
# The in-process service (``service``) cuts the same 40 splits at 512 elements: an eighth of
# the elements to read, the same splits to hand out, save, merge and resume.
SERVICE_SPLIT_UNITS = 512
WORKERS = 2
SEED = 7
TAKE = 60  # elements each old consumer returns before its position is saved
AFTER = 10  # and after (returned again by the new consumers)


def source(shuffled: bool) -> data.Dataset:
    dataset = data.Dataset.range(COUNT)
    return dataset.global_shuffle(seed=SEED) if shuffled else dataset


def reader(target: str, dataset_id: str, job_name: str | None, state=None, **options):
    return iter(data.from_dataset_id("distributed_epoch", target, dataset_id,
                                     job_name=job_name, state=state, **options))


def old_readers(target: str, dataset_id: str, count: int) -> list:
    """``count`` consumers of one job (one consumer: its own, anonymous job), each reading
    one element a read: none prefetches past its splits, so each holds its own (a consumer
    finishing splits in the background would take more, and another could wait for splits
    while the first is stopped)."""
    job_name = None if count == 1 else "ranks"
    return [reader(target, dataset_id, job_name, max_outstanding_requests=1)
            for _ in range(count)]


def read_and_save(iterators) -> tuple[list[list[int]], list[dict]]:
    """Each iterator (on a thread of its own, as trainer ranks) returns up to TAKE elements,
    saves its position (through JSON, as a checkpoint), returns AFTER more and is closed.
    The elements returned before each position, and the positions."""

    def run(iterator):
        before = []
        for element in iterator:
            before.append(int(element))
            if len(before) == TAKE:
                break
        state = json.loads(json.dumps(iterator.state_dict()))
        for _, _ in zip(range(AFTER), iterator, strict=False):
            pass
        iterator.close()
        assert state["elements"] == len(before)
        return before, state

    with ThreadPoolExecutor(len(iterators)) as pool:
        results = [future.result(120) for future in [pool.submit(run, i) for i in iterators]]
    return [before for before, _ in results], [state for _, state in results]


def read_each(iterators, timeout: float = 120.0) -> list[list[int]]:
    """Every element of each iterator, read at once on threads of their own."""
    with ThreadPoolExecutor(len(iterators)) as pool:
        reads = [pool.submit(lambda it=it: [int(x) for x in it]) for it in iterators]
        return [read.result(timeout) for read in reads]


def assert_whole_epoch(before: list[list[int]], after: list[list[int]], shuffled: bool) -> None:
    """Every element once over the run, and each split of the epoch's (permuted) index
    space read in order: a prefix by one old consumer, the rest on from there by one new
    consumer."""
    assert Counter(x for read in before + after for x in read) == Counter(range(COUNT))
    order = [int(x) for x in source(shuffled)]  # the epoch's order, read here
    index = {element: i for i, element in enumerate(order)}
    units = PROVIDERS["elements"].units_per_split(COUNT, WORKERS, 1)
    prefixes: dict[int, list[int]] = {}
    for read in before:
        for split, indices in _by_split(read, index, units).items():
            assert split not in prefixes, f"split {split} read by two old consumers"
            prefixes[split] = indices
    rests: dict[int, list[int]] = {}
    for read in after:
        for split, indices in _by_split(read, index, units).items():
            assert split not in rests, f"split {split} read on by two new consumers"
            rests[split] = indices
    for split in set(prefixes) | set(rests):
        start, end = split * units, min((split + 1) * units, COUNT)
        assert prefixes.get(split, []) + rests.get(split, []) == list(range(start, end))


def _by_split(read: list[int], index: dict[int, int], units: int) -> dict[int, list[int]]:
    splits: dict[int, list[int]] = {}
    for element in read:
        splits.setdefault(index[element] // units, []).append(index[element])
    return splits


@pytest.fixture
def service(monkeypatch):
    monkeypatch.setattr(splits, "MAX_SPLIT_UNITS", SERVICE_SPLIT_UNITS)
    monkeypatch.setattr(sys.modules[__name__], "COUNT", 40 * SERVICE_SPLIT_UNITS)
    with in_process_data_service(workers=WORKERS) as dispatcher:
        yield dispatcher


# ---- N -> M ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shuffled", [False, True], ids=["range", "global_shuffle"])
@pytest.mark.parametrize("old,new", [(4, 3), (1, 5), (8, 1)])
def test_n_consumers_resume_as_m_and_read_the_epoch_once(service, old, new, shuffled):
    dataset_id = data.register_dataset(service.target, source(shuffled))
    before, states = read_and_save(old_readers(service.target, dataset_id, old))
    merged = json.loads(json.dumps(data.merge_states(states)))
    assert len(json.dumps(merged)) < 600 + 2000 * old  # see position.py: per consumer
    after = read_each([reader(service.target, dataset_id, "other", state=merged)
                       for _ in range(new)])
    assert_whole_epoch(before, after, shuffled)


def test_a_merged_position_resumes_across_a_sigkilled_dispatcher(processes, tmp_path):
    ft = ["--fault-tolerant-mode", "--work-dir", str(tmp_path / "work")]
    dispatcher = processes("dispatcher", "--port", "0", *ft)
    for _ in range(WORKERS):
        processes("worker", "--dispatcher-address", dispatcher.address,
                  "--heartbeat-interval-ms", "200")
    wait_for(lambda: len(data.service_status(dispatcher.target).workers) == WORKERS,
             timeout=30, what="workers registered")
    dataset_id = data.register_dataset(dispatcher.target, source(True))
    before, states = read_and_save(old_readers(dispatcher.target, dataset_id, 4))
    merged = data.merge_states(states)
    port = dispatcher.port
    dispatcher.kill()
    dispatcher = processes("dispatcher", "--port", str(port), *ft)
    after = read_each([reader(dispatcher.target, dataset_id, "ranks", state=merged)
                       for _ in range(3)])
    assert_whole_epoch(before, after, shuffled=True)


def test_a_worker_killed_during_the_resumed_epoch_loses_nothing(processes):
    dispatcher = processes("dispatcher", "--port", "0", "--worker-timeout-ms", "2000")
    workers = [processes("worker", "--dispatcher-address", dispatcher.address,
                         "--heartbeat-interval-ms", "200") for _ in range(WORKERS)]
    wait_for(lambda: len(data.service_status(dispatcher.target).workers) == WORKERS,
             timeout=30, what="workers registered")
    dataset_id = data.register_dataset(dispatcher.target, source(False))
    before, states = read_and_save(old_readers(dispatcher.target, dataset_id, 4))
    merged = data.merge_states(states)
    resumed = [reader(dispatcher.target, dataset_id, "ranks", state=merged)
               for _ in range(3)]
    reads: list[list[int]] = [[] for _ in resumed]
    halfway = threading.Event()

    def run(index: int) -> None:
        for element in resumed[index]:
            reads[index].append(int(element))
            if sum(map(len, reads)) >= COUNT // 8:
                halfway.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    assert halfway.wait(60), "the resumed consumers did not get an eighth of the epoch"
    workers[0].kill()
    assert sum(map(len, reads)) < COUNT  # killed during the resumed epoch
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive()
    assert Counter(x for read in before + reads for x in read) == Counter(range(COUNT))


# ---- what is refused --------------------------------------------------------------------------

def saved_positions(service, count: int = 2):
    dataset_id = data.register_dataset(service.target, source(False))
    before, states = read_and_save(old_readers(service.target, dataset_id, count))
    return dataset_id, before, states


def test_a_forged_merged_position_is_refused_and_the_epoch_stays_whole(service):
    dataset_id, before, states = saved_positions(service)
    merged = data.merge_states(states)
    partial = next(c for c in merged["consumers"] if c["partial"])["partial"][0]
    count = partial[1]
    partial[1] = count + 5  # skip 5 elements nobody read: past the vouch
    with pytest.raises(errors.PermissionDeniedError, match="covers elements"):
        reader(service.target, dataset_id, "ranks", state=merged)
    partial[1], partial[2]["mac"] = count, "00" * 32
    with pytest.raises(errors.PermissionDeniedError, match="not the service's"):
        reader(service.target, dataset_id, "ranks", state=merged)
    partial[2] = None
    with pytest.raises(errors.PermissionDeniedError, match="no vouch"):
        reader(service.target, dataset_id, "ranks", state=merged)
    foreign = {**data.merge_states(states), "group": "0" * 32}
    with pytest.raises(errors.PermissionDeniedError, match="group is not"):
        reader(service.target, dataset_id, "ranks", state=foreign)
    lacking = data.merge_states(states[:1])
    with pytest.raises(errors.FailedPreconditionError, match="lacks the position"):
        reader(service.target, dataset_id, "ranks", state=lacking)
    after = read_each([reader(service.target, dataset_id, "ranks",
                              state=data.merge_states(states)) for _ in range(2)])
    assert_whole_epoch(before, after, shuffled=False)


def test_a_merged_position_is_applied_once(service):
    """Later consumers passing the same merged position join the job (they read what is
    left, nothing twice); a position of a merged consumer cannot be resumed or merged
    again."""
    dataset_id, before, states = saved_positions(service, count=3)
    merged = data.merge_states(states)
    first = [reader(service.target, dataset_id, "ranks", state=merged) for _ in range(2)]
    after = read_each(first)
    late = reader(service.target, dataset_id, "ranks", state=merged)
    assert list(late) == []
    assert_whole_epoch(before, after, shuffled=False)
    with pytest.raises(errors.FailedPreconditionError, match="cannot resume"):
        reader(service.target, dataset_id, "ranks", state=states[0])
    again = {**merged, "consumers": merged["consumers"][:2]}  # another merge of them
    with pytest.raises(errors.FailedPreconditionError, match="cannot resume"):
        reader(service.target, dataset_id, "ranks", state=again)


def test_a_raw_merge_naming_a_consumer_twice_is_refused(service):
    """merge_states refuses it in the client; a client speaking the protocol itself is
    refused by the dispatcher."""
    dataset_id, before, states = saved_positions(service)
    merged = position.merge(states)
    twice = merged.requests()
    twice.append(twice[0])
    client = DispatcherClient("grpc", service.target.split("://")[1], 10.0, Security())
    try:
        with pytest.raises(errors.InvalidArgumentError, match="twice"):
            client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
                dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.DYNAMIC,
                job_key=merged.job_key, consumer_id="raw", merged=twice,
                merge_group=merged.group)))
    finally:
        client.close()
    after = read_each([reader(service.target, dataset_id, "ranks", state=merged.to_dict())])
    assert_whole_epoch(before, after, shuffled=False)


def test_positions_that_do_not_merge_say_why(service):
    ranks, _, states = saved_positions(service)
    with pytest.raises(errors.InvalidArgumentError, match="two positions of consumer"):
        data.merge_states([states[0], states[0]])
    with pytest.raises(errors.InvalidArgumentError, match="different jobs: job_key"):
        data.merge_states([states[0], {**states[1], "job_key": "other/0"}])
    with pytest.raises(errors.InvalidArgumentError, match="merged one"):
        data.merge_states([data.merge_states(states)])
    with pytest.raises(errors.InvalidArgumentError, match="got none"):
        data.merge_states([])
    merged = data.merge_states(states)
    for bad, match in [({**merged, "consumers": "x"}, "'consumers' must be a list"),
                       ({**merged, "consumers": []}, "lists no consumers"),
                       ({**merged, "consumers": [7]}, "consumer entry 7"),
                       ({**merged, "version": 1}, "version 1"),
                       ({**merged, "consumers": [{**merged["consumers"][0], "handed": -1}]},
                        "'handed'")]:
        with pytest.raises(errors.InvalidArgumentError, match=match):
            data.distribute("distributed_epoch", service.target, state=bad)
    dataset_id = data.register_dataset(service.target, data.Dataset.range(100))
    parallel = iter(data.from_dataset_id("parallel_epochs", service.target, dataset_id))
    next(parallel)
    with pytest.raises(errors.InvalidArgumentError, match="whole copy of the data"):
        data.merge_states([parallel.state_dict()])
    parallel.close()
    endless = data.register_dataset(service.target, data.Dataset.range(100).repeat())
    rounds = iter(data.from_dataset_id("parallel_epochs", service.target, endless,
                                       job_name="rr", consumer_index=0, num_consumers=1))
    next(rounds)
    with pytest.raises(errors.InvalidArgumentError, match="Round-robin positions do not merge"):
        data.merge_states([rounds.state_dict()])
    rounds.close()
    with pytest.raises(errors.InvalidArgumentError, match="read is parallel_epochs"):
        iter(data.from_dataset_id("parallel_epochs", service.target, ranks,
                                  state=data.merge_states(states)))


def test_sigkilled_trainers_resume_as_another_number_of_processes(processes, tmp_path):
    """3 trainer processes of one job checkpoint every 50 elements and are SIGKILLed past
    their checkpoint at 200, with the fault-tolerant dispatcher SIGKILLed and restarted
    after them; 2 new trainer processes resume from the merged checkpoints."""
    ft = ["--fault-tolerant-mode", "--work-dir", str(tmp_path / "work")]
    dispatcher = processes("dispatcher", "--port", "0", *ft)
    for _ in range(WORKERS):
        processes("worker", "--dispatcher-address", dispatcher.address,
                  "--heartbeat-interval-ms", "200")
    wait_for(lambda: len(data.service_status(dispatcher.target).workers) == WORKERS,
             timeout=30, what="workers registered")
    dataset_id = data.register_dataset(dispatcher.target, source(True))
    old = [str(tmp_path / f"old{i}.json") for i in range(3)]
    trainers = [start_trainer(dispatcher.target, dataset_id, "distributed_epoch", path,
                              "--job-name", "ranks", "--every", "50", "--announce", "230")
                for path in old]
    run_trainers(trainers, "READ 230", 60)
    checkpoints = []
    for path in old:
        with open(path) as file:
            checkpoints.append(json.load(file))
    assert [len(c["seen"]) for c in checkpoints] == [200] * 3
    port = dispatcher.port
    dispatcher.kill()
    dispatcher = processes("dispatcher", "--port", str(port), *ft)
    merged = data.merge_states([c["state"] for c in checkpoints])
    new = [str(tmp_path / f"new{i}.json") for i in range(2)]
    for path in new:
        with open(path, "w") as file:
            json.dump({"seen": [], "state": merged}, file)
    trainers = [start_trainer(dispatcher.target, dataset_id, "distributed_epoch", path,
                              "--job-name", "ranks", "--every", str(COUNT))
                for path in new]
    run_trainers(trainers, "DONE", 120, exits=True)
    seen = [x for c in checkpoints for x in c["seen"]]
    for path in new:
        with open(path) as file:
            seen += json.load(file)["seen"]
    assert Counter(seen) == Counter(range(COUNT))
