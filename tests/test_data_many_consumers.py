"""The data service serves many consumers at once, losing and repeating nothing.

One dispatcher and 4 workers (in this process, as test_data_service's ``service``); 24
consumer threads start reading together (released by one ``threading.Barrier``). That is more
concurrent element reads than a worker has handler threads (``ListenOptions.max_workers``,
16): a distributed_epoch consumer keeps ``reader.SLOTS_PER_WORKER`` (2) reads open on every
worker, so 48 a worker here, and 24 own jobs open 48 split streams a worker (of
``ServiceLimits.max_open_streams``, 64).

* One shared job (``job_name``): distributed_epoch hands every element to exactly one
  consumer; parallel_epochs has every worker produce the whole dataset once, the consumers
  sharing each worker's stream. The multiset of everything received is checked.
* Own jobs (no ``job_name``): every consumer reads its own full epoch.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import pytest

from clusterwire import data
from clusterwire.data import reader
from clusterwire.data.quotas import ServiceLimits
from clusterwire.transport import ListenOptions

pytestmark = pytest.mark.timeout(90)

WORKERS = 4
CONSUMERS = 24
JOIN_S = 60.0


@pytest.fixture(scope="module")
def service():
    """A dispatcher and WORKERS workers in this process; all stopped at the end."""
    with data.DispatchServer(port=0) as dispatcher:
        address = dispatcher.target.split("://")[1]
        workers = []
        try:
            for _ in range(WORKERS):
                # start() returns once the worker has registered with the dispatcher.
                workers.append(data.WorkerServer(port=0, dispatcher_address=address))
            assert dispatcher.num_workers() == WORKERS
            yield dispatcher
        finally:
            for server in workers:
                server.stop()


def test_the_setup_oversubscribes_the_workers():
    """What the tests below exceed, per worker (so a change of the limits is noticed)."""
    reads_per_worker = CONSUMERS * reader.SLOTS_PER_WORKER
    assert reads_per_worker > ListenOptions().max_workers
    limits = ServiceLimits()
    assert limits.max_streams_per_consumer < CONSUMERS
    assert reads_per_worker <= limits.max_open_streams  # own jobs: every split stream fits


def read_concurrently(dataset_for, consumers=CONSUMERS):
    """Each consumer thread builds its dataset, waits for all, then reads it to the end.

    Returns (elements of each consumer, (first element, end) times of each consumer);
    fails on any consumer error or one not done within JOIN_S.
    """
    received: list[list[int] | None] = [None] * consumers
    spans: list[tuple[float, float] | None] = [None] * consumers
    failures: list[BaseException] = []
    gate = threading.Barrier(consumers, timeout=JOIN_S)

    def consume(index: int) -> None:
        try:
            dataset = dataset_for(index)  # registers with the dispatcher
            gate.wait()
            got, first = [], None
            for element in dataset:
                if first is None:
                    first = time.monotonic()
                got.append(int(element))
            received[index] = got
            spans[index] = (first if first is not None else time.monotonic(), time.monotonic())
        except BaseException as err:  # reported by the test, not as a thread exception
            failures.append(err)
            gate.abort()

    threads = [threading.Thread(target=consume, args=(i,), daemon=True,
                                name=f"test-consumer-{i}") for i in range(consumers)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"{len(hung)} consumers did not finish within {JOIN_S} s: {hung}"
    assert not failures, f"{len(failures)} consumers failed, e.g. {failures[0]!r}"
    return received, spans


def peak_overlap(spans):
    """The most consumers that were reading (first element received, not done) at once."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans],
                    key=lambda event: (event[0], event[1]))
    peak = active = 0
    for _, change in events:
        active += change
        peak = max(peak, active)
    return peak


@pytest.mark.parametrize("mode,copies", [("distributed_epoch", 1),
                                         ("parallel_epochs", WORKERS)])
def test_one_shared_job_delivers_each_element_once_across_consumers(service, mode, copies):
    count = 24_000 // copies
    job_name = f"many-{mode}-{uuid.uuid4().hex[:8]}"

    def dataset_for(_index):
        return data.Dataset.range(count).apply(data.distribute(
            mode, service.target, job_name=job_name))

    received, _ = read_concurrently(dataset_for)
    total = Counter(x for got in received for x in got)
    expected = Counter({x: copies for x in range(count)})
    assert total == expected, (
        f"lost {sum((expected - total).values())}, repeated "
        f"{sum((total - expected).values())}")
    # The job was shared: no consumer read it alone (each read only its part).
    assert max(len(got) for got in received) < count * copies


@pytest.mark.parametrize("mode,copies", [("distributed_epoch", 1),
                                         ("parallel_epochs", WORKERS)])
def test_every_consumer_of_its_own_job_gets_the_whole_epoch(service, mode, copies):
    count = 2_000 // copies

    def dataset_for(_index):
        return data.Dataset.range(count).apply(data.distribute(mode, service.target))

    received, spans = read_concurrently(dataset_for)
    expected = Counter({x: copies for x in range(count)})
    wrong = [index for index, got in enumerate(received) if Counter(got) != expected]
    assert not wrong, f"consumers {wrong} did not get every element {copies}x"
    # The consumers really read at the same time, not one after another.
    assert peak_overlap(spans) >= CONSUMERS // 2
