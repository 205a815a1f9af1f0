"""A distributed_epoch consumer acknowledges the splits it read to their end with its next
split request. A trainer SIGKILLed between returning the last element of such a split (and
saving its position) and that request reaching the dispatcher leaves the split assigned to
it at the dispatcher, though its position says it was read completely. Resumed from that
position (its own, or merged into a job position), the split must not be read again, and
the epoch must still end: every element once over the whole run.

The kill is driven in this process, deterministically: the first iterator's split requests
that carry finished splits never reach the dispatcher (they wait until the test ends, then
fail as a dead process's would), and the test returns elements until those splits are
returned completely, then saves the position and resumes from it."""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field

import pytest
from conftest import read_together
from test_data_resume import COUNT, service, take  # noqa: F401 (the service fixture)

from clusterwire import data, errors
from clusterwire.data.reader import JobReader
from clusterwire.data.rpc import DispatcherClient

pytestmark = pytest.mark.timeout(120)


@dataclass
class UnsentDones:
    """What the first iterator's held-back split requests acknowledged."""

    blocked: threading.Event = field(default_factory=threading.Event)
    dead: threading.Event = field(default_factory=threading.Event)
    splits: list[int] = field(default_factory=list)
    consumer: str = ""  # the first iterator's


@pytest.fixture
def unsent_dones(monkeypatch):
    """Split requests that acknowledge finished splits, of the first iterator to send one
    (not of a later one resuming its position: generation 0), wait until the test ends, then
    fail: the acknowledgements never arrive. The first such request holds the reader's split
    lock, so it is the only one sent while the test runs."""
    held = UnsentDones()
    real = DispatcherClient.call

    def call(self, request, *args, **kwargs):
        ask = request.get_split
        if request.WhichOneof("kind") == "get_split" and ask.done and not ask.generation \
                and held.consumer in ("", ask.consumer_id):
            if not held.blocked.is_set():
                held.consumer = ask.consumer_id
                held.splits.extend(ask.done)
                held.blocked.set()
            held.dead.wait(60)
            raise errors.CancelledError("The trainer process was killed.")
        return real(self, request, *args, **kwargs)

    monkeypatch.setattr(DispatcherClient, "call", call)
    yield held
    held.dead.set()


def killed_after_finishing_a_split(target: str, dataset_id: str, job_name: str | None,
                                   held: UnsentDones) -> tuple[list[int], dict, object]:
    """A first iterator returns elements until every split whose acknowledgement is held
    back was returned completely; the elements it returned, its position then (through
    JSON, as a checkpoint), and the iterator (left as a killed process leaves it)."""
    old = iter(data.from_dataset_id("distributed_epoch", target, dataset_id,
                                    job_name=job_name))
    seen = take(old, 1)
    old.state_dict()  # a checkpointing trainer's consumer: its splits are kept for it
    assert held.blocked.wait(60), "no split was read to its end"
    while any(split in old.position().partial for split in held.splits):
        seen += take(old, 1)  # the splits' elements were all received: never blocks
    state = json.loads(json.dumps(old.state_dict()))
    assert not set(held.splits) & {split for split, *_ in state["partial"]}
    return seen, state, old


@pytest.mark.parametrize("job_name", [None, "train"])
def test_a_resumed_consumer_does_not_read_again_a_split_it_finished_unacknowledged(
        service, unsent_dones, job_name):  # noqa: F811
    dataset_id = data.register_dataset(service.target, data.Dataset.range(COUNT))
    before, state, old = killed_after_finishing_a_split(service.target, dataset_id, job_name,
                                                        unsent_dones)
    resumed = read_together([data.from_dataset_id("distributed_epoch", service.target,
                                                  dataset_id, job_name=job_name,
                                                  state=state)], timeout=60)
    unsent_dones.dead.set()
    old.close()
    assert Counter(before + resumed) == Counter(range(COUNT))


def test_a_merged_position_with_a_split_finished_unacknowledged_ends_the_epoch_once(
        service, unsent_dones):  # noqa: F811
    """Merged, the dead consumer is done: a split it finished must neither be read again nor
    stay its own (which would keep the new consumers waiting for it forever)."""
    dataset_id = data.register_dataset(service.target, data.Dataset.range(COUNT))
    before, state, old = killed_after_finishing_a_split(service.target, dataset_id, "ranks",
                                                        unsent_dones)
    merged = json.loads(json.dumps(data.merge_states([state])))
    resumed = read_together([data.from_dataset_id("distributed_epoch", service.target,
                                                  dataset_id, job_name="ranks",
                                                  state=merged) for _ in range(2)],
                            timeout=60)
    unsent_dones.dead.set()
    old.close()
    assert Counter(before + resumed) == Counter(range(COUNT))


def test_a_consumer_stopping_before_acknowledging_a_split_gives_it_back_read(
        service, monkeypatch):  # noqa: F811
    """A consumer of a named job stops (close) after reading a split to its end but before
    its next split request acknowledged it: the release gives the split back at its end
    (its elements are the stopped consumer's), so another consumer does not read again the
    elements the first one returned."""
    dataset_id = data.register_dataset(service.target, data.Dataset.range(COUNT))
    ending, stopped, finished = threading.Event(), threading.Event(), []
    real = JobReader._next_split

    def next_split(self):
        if self._reading.done and self._options.job_name == "team" and not stopped.is_set():
            if not ending.is_set():
                finished.extend(s.split_id for s in self._reading.done)
                ending.set()
            stopped.wait(60)  # then ends as a slot seeing close() does, unacknowledged
            return None
        return real(self)

    monkeypatch.setattr(JobReader, "_next_split", next_split)
    first = iter(data.from_dataset_id("distributed_epoch", service.target, dataset_id,
                                      job_name="team"))
    seen = take(first, 1)
    assert ending.wait(60), "no split was read to its end"
    while any(split in first.position().partial for split in finished):
        seen += take(first, 1)
    first.close()
    stopped.set()
    seen += read_together([data.from_dataset_id("distributed_epoch", service.target,
                                                dataset_id, job_name="team")], timeout=60)
    counts = Counter(seen)
    assert max(counts.values()) == 1, [x for x, n in counts.items() if n > 1]
    split = range(finished[0] * 38, (finished[0] + 1) * 38)  # 600 / (2 workers x 8) units
    assert all(counts[x] == 1 for x in split)
