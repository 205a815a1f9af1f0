"""Resumable consumers: a position saved with ``state_dict()`` and resumed by
``distribute``/``from_dataset_id(..., state=...)``. Over a whole run every element of a
deterministic pipeline arrives once, those returned after the saved position once more:
after a clean stop, after SIGKILL of the trainer, with the fault-tolerant dispatcher
restarted in between, with several consumers of one job."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from collections import Counter

import pytest
from conftest import child_env, read_together

from clusterwire import data, errors

pytestmark = pytest.mark.timeout(120)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
COUNT = 600


@pytest.fixture
def service():
    """A dispatcher and two workers in this process."""
    with data.DispatchServer(port=0) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(port=0, dispatcher_address=address), \
                data.WorkerServer(port=0, dispatcher_address=address):
            yield dispatcher


def take(iterator, count: int) -> list[int]:
    return [int(next(iterator)) for _ in range(count)]


def expected(mode: str, count: int = COUNT, workers: int = 2) -> Counter:
    return Counter(list(range(count)) * (workers if mode == "parallel_epochs" else 1))


# ---- in one process ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode,job_name", [("distributed_epoch", None),
                                           ("distributed_epoch", "train"),
                                           ("parallel_epochs", None)])
def test_a_stopped_iteration_resumes_from_its_saved_position(service, mode, job_name):
    dataset_id = data.register_dataset(service.target, data.Dataset.range(COUNT))
    iterator = iter(data.from_dataset_id(mode, service.target, dataset_id, job_name=job_name))
    before = take(iterator, 137)
    state = json.loads(json.dumps(iterator.state_dict()))  # what a checkpoint holds
    after = take(iterator, 41)
    iterator.close()
    resumed = [int(x) for x in data.from_dataset_id(mode, service.target, dataset_id,
                                                    job_name=job_name, state=state)]
    assert Counter(before + resumed) == expected(mode)
    assert not Counter(after) - Counter(resumed)  # returned after the position: again
    assert state["elements"] == 137


def test_a_position_with_completed_splits_keeps_them_through_a_second_resume(service):
    """A position may list splits handed after its ``handed`` count but read completely
    (``completed``). The iterator resumed from it lists them in every position it saves, so a
    second resume does not read them again."""
    dataset_id = data.register_dataset(service.target, data.Dataset.range(COUNT))
    iterator = iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id))
    before = take(iterator, 300)
    state = json.loads(json.dumps(iterator.state_dict()))
    iterator.close()
    # One consumer, splits handed in order: hand-out k is split k. Count the last two splits
    # read completely as handed after the position's count and completed (the splits between
    # are partial, and listed so), as a reader that received them out of order would save.
    unread = {entry[0] for entry in state["partial"]}
    read = [split for split in range(state["handed"]) if split not in unread]
    assert len(read) >= 2
    state.update(handed=read[-2], completed=read[-2:])
    resumed = iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                        state=state))
    middle = take(resumed, 50)
    second = json.loads(json.dumps(resumed.state_dict()))
    resumed.close()
    assert set(read[-2:]) <= set(second["completed"])
    rest = [int(x) for x in data.from_dataset_id("distributed_epoch", service.target,
                                                 dataset_id, state=second)]
    assert Counter(before + middle + rest) == expected("distributed_epoch")


def test_a_resumed_iteration_saves_positions_of_its_own(service):
    dataset = data.Dataset.range(COUNT).apply(
        data.distribute("distributed_epoch", service.target, job_name="chain"))
    seen, state = [], None
    for _ in range(3):  # stop and resume three times, 150 elements each time
        iterator = iter(dataset if state is None else data.Dataset.range(COUNT).apply(
            data.distribute("distributed_epoch", service.target, job_name="chain",
                            state=state)))
        seen += take(iterator, 150)
        state = iterator.state_dict()
        take(iterator, 7)  # read past the position, then stopped
        iterator.close()
    rest = data.Dataset.range(COUNT).apply(
        data.distribute("distributed_epoch", service.target, job_name="chain", state=state))
    iterator = iter(rest)
    seen += [int(x) for x in iterator]
    assert Counter(seen) == Counter(range(COUNT))
    final = iterator.state_dict()
    assert final["elements"] == COUNT and final["finished"]
    # Saved after the end (a checkpoint between epochs): resumed, the iteration is over and
    # the dataset's next iteration is a new one, whole.
    after_the_end = data.Dataset.range(COUNT).apply(
        data.distribute("distributed_epoch", service.target, job_name="chain", state=final))
    ended = iter(after_the_end)
    assert list(ended) == [] and ended.state_dict() == final
    assert sorted(int(x) for x in after_the_end) == list(range(COUNT))


def test_consumers_of_one_job_resume_each_from_its_own_position(service):
    """As DataLoader workers sharing a distributed_epoch job: both saved, both resumed."""
    dataset_id = data.register_dataset(service.target, data.Dataset.range(COUNT))

    def consumer(state=None):
        return iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                         job_name="team", state=state))

    first, second = consumer(), consumer()
    seen = take(first, 90) + take(second, 60)
    states = [first.state_dict(), second.state_dict()]
    take(first, 30), take(second, 30)
    first.close(), second.close()
    resumed = [consumer(states[0]), consumer(states[1])]
    assert Counter(seen + read_together(resumed)) == Counter(range(COUNT))


def test_an_iterator_still_running_stops_when_its_position_is_resumed(service):
    """Resuming in the same process while the old iterator lives: the old one gets no more
    splits (a CancelledError), the resumed one reads the rest, every element once."""
    dataset_id = data.register_dataset(service.target, data.Dataset.range(COUNT))
    old = iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id))
    before = take(old, 100)
    state = old.state_dict()
    resumed = [int(x) for x in data.from_dataset_id("distributed_epoch", service.target,
                                                    dataset_id, state=state)]
    assert Counter(before + resumed) == Counter(range(COUNT))
    with pytest.raises(errors.CancelledError, match="resumed by a later iterator"):
        for _ in old:  # what it had fetched, then the refusal of its next split
            pass


def round_robin(target: str, dataset_id: str, index: int, state=None):
    return iter(data.from_dataset_id("parallel_epochs", target, dataset_id, job_name="rr",
                                     consumer_index=index, num_consumers=2, state=state))


def test_round_robin_consumers_resume_together_each_round_as_before(service):
    """Round r of consumer c is element (r // 2) * 2 + c of worker r mod 2's stream (each
    worker's stream is range(1000) repeated): resumed from round 25, both consumers get
    rounds 25-34 again, the very same elements, and go on."""
    dataset_id = data.register_dataset(service.target, data.Dataset.range(1000).repeat())
    consumers = [round_robin(service.target, dataset_id, c) for c in range(2)]
    before = [take(consumer, 25) for consumer in consumers]
    states = [consumer.state_dict() for consumer in consumers]
    after = [take(consumer, 10) for consumer in consumers]
    for consumer in consumers:
        consumer.close()
    resumed = [round_robin(service.target, dataset_id, c, states[c]) for c in range(2)]
    again = [take(consumer, 30) for consumer in resumed]
    for c in range(2):
        assert before[c] + again[c] == [((r // 2) * 2 + c) % 1000 for r in range(55)]
        assert again[c][:10] == after[c]
        resumed[c].close()


def test_round_robin_consumers_resuming_from_different_rounds_are_refused(service):
    dataset_id = data.register_dataset(service.target, data.Dataset.range(1000).repeat())
    consumers = [round_robin(service.target, dataset_id, c) for c in range(2)]
    take(consumers[0], 5)
    take(consumers[1], 7)
    states = [consumer.state_dict() for consumer in consumers]
    for consumer in consumers:
        consumer.close()
    first = round_robin(service.target, dataset_id, 0, states[0])
    with pytest.raises(errors.FailedPreconditionError, match="from round 7, another .* 5"):
        round_robin(service.target, dataset_id, 1, states[1])
    with pytest.raises(errors.InvalidArgumentError, match="consumer 0 of 2"):
        round_robin(service.target, dataset_id, 1, states[0])
    first.close()


# ---- errors -----------------------------------------------------------------------------------

def test_a_malformed_position_is_refused_naming_what_is_wrong(service):
    dataset = data.Dataset.range(10)
    iterator = iter(dataset.apply(data.distribute("distributed_epoch", service.target)))
    state = iterator.state_dict()
    iterator.close()
    for bad, match in [("nope", "must be the dict"), ({**state, "version": 7}, "version 7"),
                       ({**state, "handed": -1}, "'handed'"),
                       ({**state, "partial": [[1]]}, "Malformed"),
                       ({**state, "processing_mode": 99}, "'processing_mode'")]:
        with pytest.raises(errors.InvalidArgumentError, match=match):
            data.distribute("distributed_epoch", service.target, state=bad)
    with pytest.raises(errors.InvalidArgumentError, match="read is parallel_epochs"):
        list(dataset.apply(data.distribute("parallel_epochs", service.target, state=state)))
    with pytest.raises(errors.InvalidArgumentError, match="of dataset"):
        list(data.Dataset.range(11).apply(
            data.distribute("distributed_epoch", service.target, state=state)))


def test_a_position_names_only_its_own_consumer_and_splits(service):
    dataset_id = data.register_dataset(service.target, data.Dataset.range(COUNT))
    iterator = iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                         job_name="mine"))
    take(iterator, 5)
    state = iterator.state_dict()
    iterator.close()
    forged = {**state, "consumer_id": "0" * 32}
    with pytest.raises(errors.FailedPreconditionError, match="never saved"):
        iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                  job_name="mine", state=forged))
    stolen = {**state, "partial": [[10 ** 6, 0]]}
    with pytest.raises(errors.InvalidArgumentError, match="did not hand"):
        iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                  job_name="mine", state=stolen))


def test_consumers_of_a_shared_parallel_epochs_job_have_no_position(service):
    dataset_id = data.register_dataset(service.target, data.Dataset.range(10))
    shared = iter(data.from_dataset_id("parallel_epochs", service.target, dataset_id,
                                       job_name="shared"))
    with pytest.raises(errors.FailedPreconditionError, match="share its worker streams"):
        shared.state_dict()
    shared.close()


def test_a_position_outliving_its_job_is_not_found(tmp_path):
    with data.DispatchServer(port=0) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(port=0, dispatcher_address=address):
            data.register_dataset(dispatcher.target, data.Dataset.range(50), dataset_id="d")
            iterator = iter(data.from_dataset_id("distributed_epoch", dispatcher.target, "d"))
            take(iterator, 3)
            state = iterator.state_dict()
            iterator.close()
    with data.DispatchServer(port=0) as dispatcher:  # not fault tolerant: jobs are gone
        data.register_dataset(dispatcher.target, data.Dataset.range(50), dataset_id="d")
        with pytest.raises(errors.NotFoundError, match="is gone"):
            iter(data.from_dataset_id("distributed_epoch", dispatcher.target, "d", state=state))


# ---- a SIGKILLed trainer -----------------------------------------------------------------------

def start_trainer(target: str, dataset_id: str, mode: str, checkpoint: str,
                  *extra: str) -> subprocess.Popen:
    env = {**os.environ, **child_env()}
    return subprocess.Popen(
        [sys.executable, os.path.join(TESTS_DIR, "cw_data_trainer.py"), target, dataset_id,
         mode, checkpoint, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env)


def await_line(process: subprocess.Popen, wanted: str, timeout: float) -> None:
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while selector.select(timeout):
            line = process.stdout.readline()
            if not line:
                break
            if line.strip() == wanted:
                return
    process.kill()
    raise AssertionError(f"no {wanted!r} from the trainer: {process.communicate()[1][-2000:]}")


def run_trainers(trainers: list[subprocess.Popen], until: str, timeout: float,
                 exits: bool = False) -> None:
    """Wait for each trainer's ``until`` line (and, with ``exits``, its exit status 0), then
    kill and reap them all, whatever happened."""
    try:
        for trainer in trainers:
            await_line(trainer, until, timeout)
            if exits:
                assert trainer.wait(30) == 0
    finally:
        for trainer in trainers:
            trainer.kill()
            trainer.communicate(timeout=30)


def kill_and_resume(target_of, dataset_id: str, mode: str, checkpoints: list[str],
                    between=lambda: None, extra=lambda i: ()) -> list[list[int]]:
    """Trainers (one per checkpoint file) read, checkpointing every 50 elements, and are
    SIGKILLed after 230 (their last checkpoints: 200); restarted, they read the rest."""
    trainers = [start_trainer(target_of(), dataset_id, mode, path, "--every", "50",
                              "--announce", "230", *extra(i))
                for i, path in enumerate(checkpoints)]
    run_trainers(trainers, "READ 230", 60)
    for path in checkpoints:
        with open(path) as file:
            saved = json.load(file)
        assert len(saved["seen"]) == 200 and "done" not in saved  # killed mid-read
    between()
    trainers = [start_trainer(target_of(), dataset_id, mode, path, *extra(i))
                for i, path in enumerate(checkpoints)]
    run_trainers(trainers, "DONE", 60, exits=True)
    seen = []
    for path in checkpoints:
        with open(path) as file:
            seen.append(json.load(file)["seen"])
    return seen


@pytest.mark.parametrize("mode", ["distributed_epoch", "parallel_epochs"])
def test_a_sigkilled_trainer_resumes_and_reads_every_element_once(service, tmp_path, mode):
    dataset_id = data.register_dataset(service.target, data.Dataset.range(COUNT))
    [seen] = kill_and_resume(lambda: service.target, dataset_id, mode,
                             [str(tmp_path / "checkpoint.json")])
    assert Counter(seen) == expected(mode)


def test_sigkilled_round_robin_trainers_resume_each_round_as_before(service, tmp_path):
    """Two trainer processes, consumers 0 and 1 of 2, both killed and restarted: each gets
    every round once, round r of consumer c being element (r // 2) * 2 + c of worker
    r mod 2's stream (range(1000) repeated)."""
    dataset_id = data.register_dataset(service.target, data.Dataset.range(1000).repeat())
    seen = kill_and_resume(
        lambda: service.target, dataset_id, "parallel_epochs",
        [str(tmp_path / f"consumer{c}.json") for c in range(2)],
        extra=lambda c: ("--job-name", "rr", "--consumer-index", str(c), "--num-consumers",
                         "2", "--limit", "400"))
    for c in range(2):
        assert seen[c] == [((r // 2) * 2 + c) % 1000 for r in range(400)]


def test_a_sigkilled_trainer_resumes_across_a_dispatcher_restart(processes, tmp_path):
    ft = ["--fault-tolerant-mode", "--work-dir", str(tmp_path / "work")]
    servers = {"dispatcher": processes("dispatcher", "--port", "0", *ft)}
    for _ in range(2):
        processes("worker", "--dispatcher-address", servers["dispatcher"].address,
                  "--heartbeat-interval-ms", "200")
    data.register_dataset(servers["dispatcher"].target, data.Dataset.range(COUNT),
                          dataset_id="kept")

    def restart_dispatcher():
        port = servers["dispatcher"].port
        servers["dispatcher"].kill()
        servers["dispatcher"] = processes("dispatcher", "--port", str(port), *ft)

    [seen] = kill_and_resume(lambda: servers["dispatcher"].target, "kept", "distributed_epoch",
                             [str(tmp_path / "checkpoint.json")], restart_dispatcher)
    assert Counter(seen) == Counter(range(COUNT))
