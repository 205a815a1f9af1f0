"""The cross-trainer cache: trainers share a worker's elements through a sliding window.

The cache module alone (window, eviction by bytes, skip-ahead, retries, the cursor bound),
then real servers on 127.0.0.1: trainers at different speeds sharing one job (each read
driven step by step over raw requests, so which element each trainer gets is exact), the
worker's memory bound, the same through ``distribute``/``from_dataset_id``, and every
validation error (TF's messages).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import cw_data_functions as fns
import numpy as np
import pytest

from clusterwire import data, errors
from clusterwire.data import elements
from clusterwire.data.config import CROSS_TRAINER_CACHE_SIZE_BYTES
from clusterwire.data.cross_trainer_cache import (
    MAX_TRAINER_ID_CHARS,
    CrossTrainerCache,
    cache_plan,
    element_bytes,
)
from clusterwire.data.quotas import ServiceLimits
from clusterwire.data.rpc import DispatcherClient, WorkerChannels
from clusterwire.protos.data_service_pb2 import (
    DataRequest,
    GetElementsRequest,
    GetOrCreateJobRequest,
    StreamSpec,
)
from clusterwire.security import Security

pytestmark = pytest.mark.timeout(60)

#: The cached size of every element of Dataset.range(...) (an int64 scalar and its header).
SIZE = element_bytes(elements.encode(np.int64(0), ""))
#: Half an element more than 8: exactly 8 elements fit.
EIGHT = 8 * SIZE + SIZE // 2
INFINITE = data.Dataset.range(10 ** 12).repeat()  # element i is the stream's position i


# ---- the cache alone --------------------------------------------------------------------------

class Counting:
    """A stream of int64 elements 0, 1, 2, ... (``end``: it ends there); counts pulls."""

    def __init__(self, end: int | None = None, sizes: dict[int, int] | None = None):
        self.next = 0
        self.end = end
        self.sizes = sizes or {}  # position -> elements of an int64 array instead of a scalar

    def __call__(self, wait: float):
        if self.next == self.end:
            return None, True
        value = self.next
        self.next += 1
        if value in self.sizes:
            return elements.encode(np.full(self.sizes[value], value), ""), False
        return elements.encode(np.int64(value), ""), False


def values(batch) -> list[int]:
    return [int(np.asarray(elements.decode_all([e.header], e.buffers)[0]).flat[0])
            for e in batch]


class Reader:
    """One consumer of a trainer, reading the cache as the worker does (one seq a read)."""

    def __init__(self, cache: CrossTrainerCache, trainer: str):
        self.cache, self.trainer, self.seq = cache, trainer, 0
        self.consumer = uuid.uuid4().hex

    def get(self, max_elements: int = 1, max_bytes: int = 1 << 20, retry: bool = False):
        self.seq += 0 if retry else 1
        return values(self.cache.get(self.trainer, self.consumer, self.seq, max_elements,
                                     max_bytes, wait=0.0))


def test_an_element_one_trainer_read_is_served_to_the_others_from_the_window():
    source = Counting()
    cache = CrossTrainerCache(source, max_bytes=100 * SIZE)
    fast, slow = Reader(cache, "fast"), Reader(cache, "slow")
    assert [fast.get()[0] for _ in range(5)] == [0, 1, 2, 3, 4]
    assert source.next == 5  # each read at the head brought one element
    assert slow.get(max_elements=3) == [0, 1, 2]
    assert slow.get(max_elements=10) == [3, 4]  # the rest of the window, nothing pulled
    assert source.next == 5
    assert slow.get() == [5] and fast.get() == [5]  # slow extended it this time
    assert source.next == 6 and cache.window == (0, 6) and cache.nbytes == 6 * SIZE


def test_the_oldest_elements_are_evicted_to_keep_the_window_under_its_bytes():
    source = Counting(sizes={5: 2, 6: 4})  # a 16-byte and a 32-byte array among scalars
    big = {value: element_bytes(elements.encode(np.full(n, value), ""))
           for value, n in source.sizes.items()}
    cache = CrossTrainerCache(source, max_bytes=EIGHT)
    trainer = Reader(cache, "t")
    sizes = []
    for position in range(20):
        assert trainer.get() == [position]
        sizes.append(big.get(position, SIZE))
        start, end = cache.window
        assert end == position + 1
        # The newest elements that fit, no more and no fewer.
        assert cache.nbytes == sum(sizes[start:end]) <= EIGHT
        assert start == 0 or sum(sizes[start - 1:end]) > EIGHT
    assert cache.window == (12, 20)


def test_a_trainer_behind_the_window_skips_ahead_to_its_oldest_element():
    cache = CrossTrainerCache(Counting(), max_bytes=4 * SIZE)
    fast, slow = Reader(cache, "fast"), Reader(cache, "slow")
    assert fast.get() + fast.get() == [0, 1]
    assert slow.get() == [0]
    for position in range(2, 10):
        assert fast.get() == [position]
    assert cache.window == (6, 10)
    # 1..5 were evicted before the slow trainer read them: it goes on at 6, in order.
    assert slow.get(max_elements=10) == [6, 7, 8, 9]
    assert slow.get() == fast.get() == [10]


def test_a_batch_from_the_window_respects_the_reads_limits():
    cache = CrossTrainerCache(Counting(), max_bytes=100 * SIZE)
    leader, follower = Reader(cache, "leader"), Reader(cache, "follower")
    for _ in range(10):
        leader.get()
    assert follower.get(max_elements=4) == [0, 1, 2, 3]
    assert follower.get(max_elements=100, max_bytes=3 * 8) == [4, 5, 6]  # payload bytes
    assert follower.get(max_elements=100, max_bytes=1) == [7]  # at least one
    assert follower.get(max_elements=0) == [8]


def test_a_retried_read_gets_the_same_elements_while_they_are_cached():
    cache = CrossTrainerCache(Counting(), max_bytes=4 * SIZE)
    leader, follower = Reader(cache, "leader"), Reader(cache, "follower")
    for _ in range(4):
        leader.get()
    assert follower.get(max_elements=3) == [0, 1, 2]
    assert follower.get(max_elements=3, retry=True) == [0, 1, 2]  # its answer was lost
    leader.get()
    leader.get()  # evicts 0 and 1
    assert follower.get(max_elements=3, retry=True) == [2]  # what is left of it
    assert follower.get(max_elements=3) == [3, 4, 5]


def test_consumers_of_one_trainer_share_its_position():
    cache = CrossTrainerCache(Counting(), max_bytes=100 * SIZE)
    first, second = Reader(cache, "same"), Reader(cache, "same")
    assert first.get() + second.get() + first.get() == [0, 1, 2]


def test_trainer_cursors_are_bounded_and_a_cursor_behind_the_window_makes_room():
    cache = CrossTrainerCache(Counting(), max_bytes=4 * SIZE, max_trainers=3)
    a, b, c = (Reader(cache, name) for name in "abc")
    assert a.get() == b.get() == c.get() == [0]
    with pytest.raises(errors.ResourceExhaustedError, match="serves 3 trainers, its limit"):
        Reader(cache, "d").get()
    for position in range(1, 5):
        assert a.get() == b.get() == [position]
    # c's cursor (1) is behind the window (1..4): it reads as a new trainer would, so it
    # goes to make room, and comes back as one.
    assert cache.window == (1, 5)
    assert Reader(cache, "d").get() == [1]
    with pytest.raises(errors.ResourceExhaustedError):
        c.get()
    assert a.get() == [5]
    assert b.get() == [5]


def test_bad_trainer_ids_are_refused():
    cache = CrossTrainerCache(Counting(), max_bytes=SIZE)
    with pytest.raises(errors.InvalidArgumentError, match="requires a non-empty trainer ID"):
        Reader(cache, "").get()
    with pytest.raises(errors.InvalidArgumentError, match=f"at most {MAX_TRAINER_ID_CHARS}"):
        Reader(cache, "x" * (MAX_TRAINER_ID_CHARS + 1)).get()


def test_the_end_of_the_stream_or_an_oversized_element_fails_every_later_read():
    cache = CrossTrainerCache(Counting(end=2), max_bytes=100 * SIZE)
    trainer, other = Reader(cache, "t"), Reader(cache, "o")
    assert trainer.get() + trainer.get() == [0, 1]
    for reader in (trainer, other):  # other would have 0 and 1 to read: it fails all the same
        with pytest.raises(errors.InvalidArgumentError, match="reached the end of sequence"):
            reader.get()
    cache = CrossTrainerCache(Counting(sizes={1: 8}), max_bytes=2 * SIZE)
    trainer = Reader(cache, "t")
    assert trainer.get() == [0]
    with pytest.raises(errors.InvalidArgumentError,
                       match=f"element size is larger than cache size.*cache size: {2 * SIZE}"):
        trainer.get()
    with pytest.raises(errors.InvalidArgumentError, match="larger than cache size"):
        trainer.get()


def test_trainers_at_the_head_wait_for_one_extension_and_all_get_its_element():
    entered, release = threading.Event(), threading.Event()
    source = Counting()

    def pull(wait):
        entered.set()
        assert release.wait(10)
        return source(wait)

    cache = CrossTrainerCache(pull, max_bytes=100 * SIZE)
    got: dict[str, list[int]] = {}

    def read(name):
        got[name] = values(cache.get(name, name, 1, 10, 1 << 20, wait=10.0))

    first = threading.Thread(target=read, args=("first",))
    first.start()
    assert entered.wait(10)  # first is extending; second waits for it (or reads after it)
    second = threading.Thread(target=read, args=("second",))
    second.start()
    release.set()
    first.join(10)
    second.join(10)
    assert got == {"first": [0], "second": [0]} and source.next == 1


def test_no_element_within_the_wait_is_an_empty_read_and_close_fails_later_reads():
    cache = CrossTrainerCache(lambda wait: (None, False), max_bytes=SIZE)
    assert Reader(cache, "t").get() == []
    cache.close()
    with pytest.raises(errors.CancelledError, match="cross-trainer cache was closed"):
        Reader(cache, "t").get()


# ---- real servers ----------------------------------------------------------------------------

@contextlib.contextmanager
def cluster(cache_bytes: int | None, limits: dict | None = None):
    """A dispatcher and one worker whose jobs cache ``cache_bytes`` each (with these
    ServiceLimits); stopped at the end."""
    with data.DispatchServer(port=0) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(data.WorkerConfig(
                dispatcher_address=address, cross_trainer_cache_size_bytes=cache_bytes,
                limits=limits)) as worker:
            yield dispatcher, worker


@pytest.fixture
def service():
    """A worker caching 8 elements of Dataset.range a job."""
    with cluster(EIGHT) as servers:
        yield servers


class Trainer:
    """A raw consumer of a named job reading through the cache as ``trainer`` (one request
    at a time, so each read happens exactly when the test says)."""

    def __init__(self, dispatcher, worker, dataset_id: str, trainer: str, job: str):
        policy, self.consumer, self.seq = data.ShardingPolicy.OFF, uuid.uuid4().hex, 0
        self.worker = worker.address
        self.dispatcher = DispatcherClient("grpc", dispatcher.target.split("://")[1], 10.0,
                                           Security())
        self.channels = WorkerChannels(Security())
        response, _ = self.dispatcher.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy=policy, job_key=f"{job}/0", named=True,
            consumer_id=self.consumer)))
        job_info = response.job
        self.spec = StreamSpec(job_id=job_info.job_id, dataset_id=dataset_id,
                               sharding_policy=policy, grant=job_info.grant, trainer_id=trainer)

    def read(self, count: int) -> list[int]:
        """The next ``count`` elements (one request each time the window has fewer)."""
        got: list[int] = []
        while len(got) < count:
            self.seq += 1
            response, buffers = self.channels.call("grpc", self.worker, DataRequest(
                get_elements=GetElementsRequest(
                    stream=self.spec, consumer_id=self.consumer, request_seq=self.seq,
                    max_elements=count - len(got), wait_seconds=10.0)), 20.0)
            got += [int(v) for v in elements.decode_all(response.get_elements.elements,
                                                        buffers)]
        return got

    def close(self) -> None:
        self.channels.close()
        self.dispatcher.close()


@pytest.fixture
def trainers(service):
    """``make(name, dataset, job)``: a raw Trainer of ``dataset`` in job ``job``; closed at the
    end."""
    dispatcher, worker = service
    made: list[Trainer] = []

    def make(name: str, dataset=INFINITE, job: str = "job") -> Trainer:
        dataset_id = data.register_dataset(dispatcher.target, dataset, compression=None)
        made.append(Trainer(dispatcher, worker, dataset_id, name, job))
        return made[-1]

    yield make
    for trainer in made:
        trainer.close()


def test_three_trainers_at_different_speeds_share_one_stream(service, trainers):
    _, worker = service
    fast, medium, slow = trainers("fast"), trainers("medium"), trainers("slow")
    seen: dict[str, list[int]] = {"fast": [], "medium": [], "slow": []}
    for step in range(1, 41):
        seen["fast"] += fast.read(1)  # at the head: each read extends the window
        if step % 2 == 0:
            seen["medium"] += medium.read(2)  # in bursts, never out of the window
        if step % 10 == 0:
            window_start = step - 8  # the fast trainer read `step` elements; 8 fit
            got = slow.read(3)
            assert got == list(range(window_start, window_start + 3))
            seen["slow"] += got
        assert worker.cross_trainer_cache_bytes() == min(step, 8) * SIZE <= EIGHT
    # The fast and medium trainers read the whole stream, the same elements in order.
    assert seen["fast"] == seen["medium"] == list(range(40))
    # The slow one fell out of the window each time: it read a strictly increasing run and
    # skipped exactly what was evicted before it came back (0-1, 5-11, 15-21, 25-31).
    assert seen["slow"] == [2, 3, 4, 12, 13, 14, 22, 23, 24, 32, 33, 34]


def distributed(dispatcher, dataset=INFINITE, trainer: str | None = "trainer", **kwargs):
    kwargs.setdefault("job_name", "job")
    cache = None if trainer is None else data.CrossTrainerCache(trainer_id=trainer)
    return dataset.apply(data.distribute("parallel_epochs", dispatcher.target,
                                         compression=None, cross_trainer_cache=cache, **kwargs))


def take(dataset, count: int) -> list[int]:
    return [int(x) for x in dataset.take(count)]


def test_trainers_through_distribute_and_from_dataset_id_read_the_same_elements():
    with cluster(None) as (dispatcher, _):  # the default size: nothing is evicted here
        first = iter(distributed(dispatcher, trainer="Trainer 1"))
        assert [int(next(first)) for _ in range(10)] == list(range(10))
        dataset_id = data.register_dataset(dispatcher.target, INFINITE, compression=None)
        second = data.from_dataset_id(
            data.ShardingPolicy.OFF, dispatcher.target, dataset_id, job_name="job",
            cross_trainer_cache=data.CrossTrainerCache(trainer_id="Trainer 2"))
        assert take(second, 20) == list(range(20))  # the first 10 or more from the window
        assert [int(next(first)) for _ in range(10)] == list(range(10, 20))
        first.close()


def test_a_trainer_coming_late_skips_to_the_window_and_reads_on_in_order(service):
    dispatcher, _ = service
    assert take(distributed(dispatcher, trainer="Trainer 1"), 200) == list(range(200))
    late = take(distributed(dispatcher, trainer="Trainer 2"), 200)
    # The beginning was evicted long ago; it reads 200 elements all the same, in order.
    assert late[0] > 0 and late == list(range(late[0], late[0] + 200))


def test_the_same_trainer_id_does_not_read_an_element_twice(service):
    dispatcher, _ = service
    assert take(distributed(dispatcher, trainer="Trainer ID"), 10) == list(range(10))
    again = take(distributed(dispatcher, trainer="Trainer ID"), 10)
    assert again[0] >= 10 and again == sorted(set(again))


def test_trainers_through_distribute_stay_within_the_workers_memory_bound():
    """Three trainers at three speeds, their readers prefetching in the background: whenever
    the test looks, the worker caches at most cross_trainer_cache_size_bytes."""
    dataset = data.Dataset.range(10 ** 9).map(fns.fill_2k).repeat()  # 2 KiB elements
    size = element_bytes(elements.encode(np.full(256, 0, np.int64), ""))
    with cluster(5 * size) as (dispatcher, worker), contextlib.ExitStack() as stack:
        readers = {name: iter(distributed(dispatcher, dataset, trainer=name))
                   for name in ("fast", "medium", "slow")}
        for reader in readers.values():
            stack.callback(reader.close)
        seen: dict[str, list[int]] = {name: [] for name in readers}
        for step in range(120):
            for name, every in (("fast", 1), ("medium", 2), ("slow", 7)):
                if step % every == 0:
                    seen[name].append(int(next(readers[name])[0]))
                    assert worker.cross_trainer_cache_bytes() <= 5 * size
        for name, got in seen.items():
            assert got == sorted(set(got)), name  # in the stream's order, none twice
        assert worker.cross_trainer_cache_bytes() == 5 * size  # full: 5 elements, no more


# ---- validation -------------------------------------------------------------------------------

def test_the_trainer_id_and_the_argument_are_checked_on_the_spot():
    for empty in ("", None):
        with pytest.raises(ValueError, match="requires a non-empty trainer ID"):
            data.CrossTrainerCache(trainer_id=empty)
    with pytest.raises(TypeError, match="`trainer_id` must be a non-empty string, got 5"):
        data.CrossTrainerCache(trainer_id=5)
    with pytest.raises(TypeError, match="must be a clusterwire.data.CrossTrainerCache or None"):
        data.distribute("parallel_epochs", "grpc://localhost:1", job_name="job",
                        cross_trainer_cache="Trainer 1")
    with pytest.raises(TypeError, match="got 'Trainer 1'"):
        data.from_dataset_id("parallel_epochs", "grpc://localhost:1", "1", job_name="job",
                             cross_trainer_cache="Trainer 1")
    for bad in (0, -1, True, "1"):
        with pytest.raises(ValueError, match="`cross_trainer_cache_size_bytes` must be a "
                                             f"positive int.*got {bad!r}"):
            data.WorkerConfig(dispatcher_address="localhost:1",
                              cross_trainer_cache_size_bytes=bad)


@pytest.mark.parametrize("kwargs,dataset,message", [
    ({"job_name": None}, INFINITE,
     "Cross-trainer caching requires named jobs. Got empty `job_name`."),
    ({}, data.Dataset.range(10),
     "requires the input dataset to be infinite. Got input with cardinality 10"),
    ({}, data.Dataset.range(0),
     "requires the input dataset to be infinite. Got input with cardinality 0"),
    ({"num_consumers": 1, "consumer_index": 0}, INFINITE,
     "does not support coordinated reads. Got number of coordinated consumers: 1"),
    ({"processing_mode": "distributed_epoch"}, INFINITE,
     "requires processing_mode='parallel_epochs'.*got DYNAMIC"),
    # Of unknown cardinality, it is taken to be infinite until it ends (as in TF).
    ({}, data.Dataset.range(10).filter(fns.is_even), "However, it reached the end of sequence"),
])
def test_a_job_tf_cannot_cache_is_refused_with_tfs_error(service, kwargs, dataset, message):
    dispatcher, _ = service
    kwargs = {"job_name": "job", **kwargs}
    mode = kwargs.pop("processing_mode", "parallel_epochs")
    ds = dataset.apply(data.distribute(
        mode, dispatcher.target, compression=None,
        cross_trainer_cache=data.CrossTrainerCache(trainer_id="Trainer 1"), **kwargs))
    with pytest.raises(errors.InvalidArgumentError, match=message):
        list(ds.take(20))


def test_a_second_iteration_of_a_trainers_dataset_is_refused(service):
    dispatcher, _ = service
    ds = distributed(dispatcher)
    assert take(ds, 3) == [0, 1, 2]
    with pytest.raises(errors.InvalidArgumentError,
                       match="disallows multiple repetitions of the same dataset. Got "
                             "repetition 2"):
        take(ds, 3)


@pytest.mark.parametrize("first,second", [("Trainer 1", None), (None, "Trainer 1")])
def test_a_job_is_read_with_the_cache_by_every_consumer_or_by_none(service, first, second):
    dispatcher, _ = service
    take(distributed(dispatcher, trainer=first), 3)
    cached, asked = ("enabled", "disabled") if first else ("disabled", "enabled")
    with pytest.raises(errors.InvalidArgumentError,
                       match=f"Existing cross-trainer cache: <{cached}>; got <{asked}>"):
        take(distributed(dispatcher, trainer=second), 3)


def test_an_element_larger_than_the_cache_is_refused(trainers):
    trainer = trainers("Trainer 1", data.Dataset.range(10 ** 9).map(fns.fill_2k).repeat())
    with pytest.raises(errors.InvalidArgumentError,
                       match=f"element size is larger than cache size in bytes.*cache "
                             f"size: {EIGHT}.*cross_trainer_cache_size_bytes"):
        trainer.read(1)


def test_a_peer_cannot_name_trainers_without_bound(trainers):
    with pytest.raises(errors.InvalidArgumentError, match="trainer ID has at most"):
        trainers("x" * (MAX_TRAINER_ID_CHARS + 1)).read(1)


def test_a_worker_caches_a_bounded_number_of_jobs(service, trainers):
    slots = service[1].cross_trainer_cache_slots
    # caches of 8 elements: the memory holds the most jobs
    assert slots == ServiceLimits().max_cached_jobs
    for job in range(slots):
        assert trainers("Trainer 1", job=f"job {job}").read(1) == [0]
    with pytest.raises(errors.ResourceExhaustedError,
                       match=f"cross-trainer caches is full \\({slots} cached jobs"):
        trainers("Trainer 1", job="one job too many").read(1)
    assert trainers("Trainer 2", job="job 0").read(1) == [0]  # the cached jobs go on


# ---- bounds from the machine ------------------------------------------------------------------

def test_the_default_cache_and_its_slots_scale_with_the_worker_memory():
    """1/8 of the memory for every cache together, a job's cache a quarter of that by default
    (at most TF's 10 GiB), as many jobs as the share holds caches of the size (1 to 16)."""
    gib = 1 << 30
    tf_default = CROSS_TRAINER_CACHE_SIZE_BYTES
    assert cache_plan(0, 24 * gib, tf_default) == (768 << 20, 4)
    assert cache_plan(0, 512 * gib, tf_default) == (10 * gib, 6)
    assert cache_plan(10 * gib, 24 * gib, tf_default) == (10 * gib, 1)
    assert cache_plan(1 << 20, 24 * gib, tf_default) == (1 << 20, 16)
    assert cache_plan(1 << 20, 24 * gib, tf_default, most=5) == (1 << 20, 5)
    assert cache_plan(0, 1 << 20, tf_default) == (32 << 10, 4)


def test_a_cached_job_nobody_reads_gives_its_slot_up():
    """Every slot of a worker (default size) held by jobs read once and then left: another
    trainer gets its first element once they have not been read for idle_cache_s (they held
    the slots for 5 minutes before), and a trainer of a job whose cache went reads on from a
    new window. idle_cache_s is 3 s here (10 s by default)."""
    idle_s = 3.0
    idle = []
    with cluster(None, {"idle_cache_s": idle_s}) as (dispatcher, worker):
        try:
            for job in range(worker.cross_trainer_cache_slots):
                dataset_id = data.register_dataset(dispatcher.target, INFINITE,
                                                   compression=None)
                idle.append(Trainer(dispatcher, worker, dataset_id, "Trainer 1", f"job {job}"))
                if job == 0:
                    oldest_read = time.monotonic()  # the worker notes the read after this
                assert idle[-1].read(1) == [0]
            last_read = time.monotonic()
            newcomer = iter(distributed(dispatcher, trainer="Trainer 2", job_name="newcomer"))
            assert int(next(newcomer)) == 0
            admitted = time.monotonic()
            newcomer.close()
            # Refused while every cached job was read within idle_cache_s, admitted soon after.
            assert admitted - oldest_read > idle_s, admitted - oldest_read
            assert admitted - last_read < idle_s + 15, admitted - last_read
            assert idle[0].read(1) == [0]  # the oldest job's cache went: a new window
        finally:
            for trainer in idle:
                trainer.close()
