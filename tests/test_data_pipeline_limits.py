"""A worker's PipelineLimits against a token holder's hostile dataset definitions: huge
``num_parallel_calls``, ``cycle_length`` and buffer sizes sent to a real worker process.

Parallelism and prefetch buffers are clamped (the elements are the same), sizes that change
the elements are refused with an InvalidArgumentError naming the argument, the value, the
limit and its WorkerConfig field; the worker's threads and memory stay under the bounds
below and another client's read goes on meanwhile.
"""

from __future__ import annotations

import threading
import time

import cw_data_functions as fns
import cw_data_limits_functions as limit_fns
import pytest
from conftest import in_process_data_service, wait_for
from cw_data_procs import ServerProcess

from clusterwire import data, errors
from clusterwire.data import graph, pipeline
from clusterwire.data.limits import PipelineLimits, ThreadBudget
from clusterwire.data.permissions import WorkerPermissions

LIMITS = PipelineLimits()  # the worker's defaults (the worker runs on this machine)
#: Threads a worker may start besides its pipelines' while serving these reads (its
#: listener's pool, a stream's producer, the dispatcher client).
SERVER_THREADS = 24
#: RSS a worker may grow by while serving one hostile read.
RSS_GROWTH = 64 << 20
#: A victim's read of 100 elements while a hostile pipeline runs.
VICTIM_SECONDS = 5.0


def _status(pid: int) -> tuple[int, int]:
    """(threads, RSS bytes) of process ``pid``."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            fields[name] = value.split()
    return int(fields["Threads"][0]), int(fields["VmRSS"][0]) * 1024


class _Peak:
    """The most threads and RSS process ``pid`` had while the block ran (sampled)."""

    def __init__(self, pid: int):
        self.pid, self.threads, self.rss = pid, 0, 0
        self.base_threads, self.base_rss = _status(pid)
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            threads, rss = _status(self.pid)
            self.threads, self.rss = max(self.threads, threads), max(self.rss, rss)
            if self._done.wait(0.005):
                return

    def __enter__(self) -> _Peak:
        self._sampler.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._sampler.join(10)

    def assert_bounded(self, pipeline_threads: int) -> None:
        assert self.threads - self.base_threads <= pipeline_threads + SERVER_THREADS, (
            self.base_threads, self.threads)
        assert self.rss - self.base_rss <= RSS_GROWTH, (self.base_rss, self.rss)


@pytest.fixture(scope="module")
def service():
    """A dispatcher and one worker process (on the default PipelineLimits)."""
    servers = [ServerProcess("dispatcher", "--port", "0", "--bind-address", "127.0.0.1")]
    try:
        servers.append(ServerProcess(
            "worker", "--dispatcher-address", servers[0].address, "--port", "0",
            "--worker-address", "127.0.0.1:%port%", "--import", "cw_data_functions",
            "--import", "cw_data_limits_functions"))
        # A first read starts the worker's listener threads before any baseline is taken.
        assert _read(data.Dataset.range(3), servers[0]) == [0, 1, 2]
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.close()


def _read(dataset: data.Dataset, dispatcher: ServerProcess) -> list[int]:
    return [int(x) for x in dataset.apply(data.distribute("parallel_epochs",
                                                          dispatcher.target))]


def test_map_parallelism_is_clamped(service):
    dispatcher, worker = service
    dataset = data.Dataset.range(10**12).map(fns.square, num_parallel_calls=10**6).take(3000)
    with _Peak(worker.process.pid) as peak:
        assert _read(dataset, dispatcher) == [x * x for x in range(3000)]
    peak.assert_bounded(LIMITS.max_parallel_calls)


def test_interleave_parallelism_is_clamped(service):
    dispatcher, worker = service
    dataset = data.Dataset.range(40).interleave(limit_fns.three_of, cycle_length=16,
                                                num_parallel_calls=10**6)
    expected = [int(x) for x in data.Dataset.range(40).interleave(limit_fns.three_of,
                                                                  cycle_length=16)]
    with _Peak(worker.process.pid) as peak:
        assert _read(dataset, dispatcher) == expected
    peak.assert_bounded(LIMITS.max_parallel_calls)


def test_prefetch_is_clamped(service):
    """An infinite dataset behind prefetch(10**9): the worker runs at most max_prefetch
    elements ahead (plus its stream's buffer), however long the reader takes."""
    dispatcher, worker = service
    dataset = data.Dataset.range(10**12).map(limit_fns.kib).prefetch(10**9)
    elements = iter(dataset.apply(data.distribute("parallel_epochs", dispatcher.target)))
    try:
        with _Peak(worker.process.pid) as peak:
            assert [int(next(elements)[0]) for _ in range(100)] == list(range(100))
            time.sleep(2.0)  # an observation window: the reader pauses, the worker must not run on
        peak.assert_bounded(1)
    finally:
        elements.close()


def test_nested_threads_come_out_of_the_worker_budget(service):
    """200 open Datasets each asking for a prefetch thread: the worker-wide budget
    (max_pipeline_threads) bounds them, and the elements are all there."""
    dispatcher, worker = service
    dataset = data.Dataset.range(200).interleave(limit_fns.prefetched_range, cycle_length=200,
                                                 num_parallel_calls=4)
    with _Peak(worker.process.pid) as peak:
        got = _read(dataset, dispatcher)
    assert sorted(got) == sorted(x * 100 + i for x in range(200) for i in range(50))
    peak.assert_bounded(LIMITS.max_pipeline_threads)


@pytest.mark.parametrize(("make", "message"), [
    (lambda ds: ds.interleave(limit_fns.three_of, cycle_length=10**6),
     r"interleave cycle_length = 1000000 .* limit of 256 .*max_cycle_length"),
    (lambda ds: ds.interleave(limit_fns.three_of, cycle_length=2**31 - 1,
                              num_parallel_calls=10**6),
     r"interleave cycle_length = 2147483647 .* limit of 256 .*max_cycle_length"),
    (lambda ds: ds.shuffle(10**9),
     r"shuffle buffer_size = 1000000000 .* limit of 1048576 .*max_buffer_elements"),
    (lambda ds: ds.batch(2**31 - 1),
     r"batch batch_size = 2147483647 .* limit of 1048576 .*max_buffer_elements"),
    (lambda ds: ds.padded_batch(10**7),
     r"padded_batch batch_size = 10000000 .* limit of 1048576 .*max_buffer_elements"),
    (lambda ds: ds.map(limit_fns.kib).padded_batch(2, padded_shapes=[10**9]),
     r"padded_shapes \[1000000000\] make a batch of 2 2000000000 values, .* limit of "
     r"67108864 .*max_padded_values"),
    (lambda ds: ds.window(10**7),
     r"window \(size - 1\) \* stride \+ 1 = 10000000 .*max_buffer_elements"),
    (lambda ds: ds.window(1000, stride=10**4),
     r"window \(size - 1\) \* stride \+ 1 = 9990001 .*max_buffer_elements"),
])
def test_sizes_over_the_limits_are_refused(service, make, message):
    """Sizes that decide the elements are refused (not clamped); the worker serves the next
    read as before."""
    dispatcher, worker = service
    with _Peak(worker.process.pid) as peak:
        with pytest.raises(errors.InvalidArgumentError, match=message):
            _read(make(data.Dataset.range(10)), dispatcher)
    peak.assert_bounded(0)
    assert _read(data.Dataset.range(5), dispatcher) == list(range(5))


def test_padding_within_the_limit_is_served(service):
    dispatcher, _ = service
    dataset = data.Dataset.range(4).map(limit_fns.kib).padded_batch(2, padded_shapes=[200])
    got = list(dataset.apply(data.distribute("parallel_epochs", dispatcher.target)))
    assert [g.shape for g in got] == [(2, 200), (2, 200)]
    assert [[int(r[0]), int(r[127]), int(r[128])] for g in got for r in g] == [
        [x, x, 0] for x in range(4)]


def test_another_client_reads_during_a_hostile_pipeline(service):
    dispatcher, worker = service
    hostile = (data.Dataset.range(10**12).map(fns.square, num_parallel_calls=10**6)
               .prefetch(10**9).interleave(limit_fns.prefetched_range, cycle_length=256,
                                           num_parallel_calls=10**6))
    elements = iter(hostile.apply(data.distribute("parallel_epochs", dispatcher.target)))
    try:
        with _Peak(worker.process.pid) as peak:
            next(elements)
            start = time.monotonic()
            assert _read(data.Dataset.range(100), dispatcher) == list(range(100))
            assert time.monotonic() - start < VICTIM_SECONDS
            next(elements)
        peak.assert_bounded(LIMITS.max_pipeline_threads)
    finally:
        elements.close()


# ---- the limits as a worker's from_def applies them (in this process) -------------------

def _on_worker(dataset: data.Dataset, limits: PipelineLimits, budget: ThreadBudget):
    permissions = WorkerPermissions(("cw_data_functions", "cw_data_limits_functions"))
    return graph.from_def(*graph.to_def(dataset.pipeline), permissions, False,
                          (limits, budget)).run()


def test_threads_go_back_to_the_budget():
    budget = ThreadBudget(64)
    dataset = (data.Dataset.range(50).map(fns.square, num_parallel_calls=10**6)
               .prefetch(10**9).interleave(limit_fns.prefetched_range, cycle_length=8,
                                           num_parallel_calls=10**6))
    got = [int(x) for x in _on_worker(dataset, PipelineLimits(), budget)]
    assert sorted(got) == sorted(x * x * 100 + i for x in range(50) for i in range(50))
    wait_for(lambda: budget.used == 0, what="the prefetch producers to give their threads back")


def test_a_spent_budget_runs_without_threads():
    """No thread left: a parallel map and interleave run in the reader's thread and a
    prefetch passes elements through; the elements and their order are the same."""
    budget = ThreadBudget(1)
    assert budget.take(1) == 1
    dataset = (data.Dataset.range(30).map(fns.square, num_parallel_calls=8).prefetch(4)
               .interleave(limit_fns.three_of, cycle_length=4, num_parallel_calls=4))
    local = [int(x) for x in data.Dataset.range(30).map(fns.square).interleave(
        limit_fns.three_of, cycle_length=4)]
    before = set(threading.enumerate())
    assert [int(x) for x in _on_worker(dataset, PipelineLimits(), budget)] == local
    assert set(threading.enumerate()) - before == set()


@pytest.mark.parametrize(("op", "message"), [
    (pipeline.Map(fns.square, -5), "map num_parallel_calls must be >= 0 or AUTOTUNE"),
    (pipeline.Shuffle(-3), "shuffle buffer_size must be > 0"),
    (pipeline.Batch(0), "batch batch_size must be > 0"),
])
def test_forged_negative_values_are_refused_on_a_worker(op, message):
    """Values a client's Dataset calls refuse, in a definition built by hand."""
    forged = data.Dataset(pipeline.RangeSource(0, 3, 1), (op,))
    with pytest.raises(errors.InvalidArgumentError, match=message):
        _on_worker(forged, PipelineLimits(), ThreadBudget(8))


def test_limits_config():
    config = data.WorkerConfig(dispatcher_address="localhost:1",
                               pipeline_limits={"max_cycle_length": 1024})
    assert config.pipeline_limits.max_cycle_length == 1024
    assert config.pipeline_limits.max_parallel_calls == LIMITS.max_parallel_calls
    with pytest.raises(ValueError, match="max_prefetch"):
        data.PipelineLimits(max_prefetch=0)
    with pytest.raises(TypeError, match="max_threads"):
        data.WorkerConfig(dispatcher_address="localhost:1",
                          pipeline_limits={"max_threads": 4})
    assert config.pipeline_limits.max_buffer_elements == 1 << 20


def test_cache_of_a_longer_pass_than_the_limit_fails():
    """cache() of an infinite input on a worker (WorkerConfig pipeline_limits as a dict):
    the pass fails once it would keep more than max_buffer_elements, its elements so far
    delivered; a finite pass under the limit is cached as before."""
    with in_process_data_service(workers=1, pipeline_limits={"max_buffer_elements": 1000}
                                 ) as dispatcher:
        service = dispatcher.target
        got = []
        with pytest.raises(errors.ResourceExhaustedError,
                           match=r"cache\(\) .* at most 1000 elements .*max_buffer_elements"):
            for x in data.Dataset.range(10**12).cache().apply(
                    data.distribute("parallel_epochs", service)):
                got.append(int(x))
        assert got == list(range(1000))
        cached = data.Dataset.range(1000).cache().repeat(2)
        assert [int(x) for x in cached.apply(data.distribute("parallel_epochs", service))] \
            == list(range(1000)) * 2


def test_groups_hold_at_most_the_limit():
    """group_by_window with a key per element on an infinite input: the open groups fail
    at max_buffer_elements elements in all; under the limit the windows are TF's."""
    limits = PipelineLimits(max_buffer_elements=100)
    endless = data.Dataset.range(10**12).group_by_window(limit_fns.own_key, limit_fns.the_window,
                                                         window_size=2)
    with pytest.raises(errors.ResourceExhaustedError,
                       match=r"hold 100 elements in 100 keys.*max_buffer_elements"):
        next(iter(_on_worker(endless, limits, ThreadBudget(8))))
    pairs = data.Dataset.range(30).map(fns.square).shuffle(30, seed=1).group_by_window(
        limit_fns.own_key, limit_fns.the_window, window_size=2)
    assert [int(x) for x in _on_worker(pairs, limits, ThreadBudget(8))] == [
        int(x) for x in pairs]


def test_a_released_stream_gives_its_threads_back():
    """A hostile pipeline holds at most max_pipeline_threads of a worker; once its reader
    closes, they are all back (WorkerServer.pipeline_threads)."""
    dispatcher = data.DispatchServer(data.DispatcherConfig(bind_address="127.0.0.1"))
    worker = data.WorkerServer(data.WorkerConfig(
        dispatcher_address=dispatcher.target.split("://")[1],
        worker_address="127.0.0.1:%port%", pipeline_limits={"max_pipeline_threads": 6}))
    try:
        wait_for(lambda: dispatcher.num_workers() == 1, what="the worker")
        hostile = (data.Dataset.range(10**12).map(fns.square, num_parallel_calls=10**6)
                   .prefetch(10**9).interleave(limit_fns.prefetched_range, cycle_length=64,
                                               num_parallel_calls=10**6))
        elements = iter(hostile.apply(data.distribute("parallel_epochs", dispatcher.target)))
        first = [int(next(elements)) for _ in range(2000)]
        assert sorted(first[:64]) == sorted(x * x * 100 for x in range(64))
        assert 0 < worker.pipeline_threads <= 6
        elements.close()
        wait_for(lambda: worker.pipeline_threads == 0, what="the pipeline threads back")
    finally:
        worker.stop()
        dispatcher.stop()


def test_an_operator_raises_or_lowers_the_limits_from_the_command_line(processes):
    """``clusterwire worker --max-cycle-length 8 --max-parallel-calls 2``."""
    dispatcher = processes("dispatcher", "--port", "0", "--bind-address", "127.0.0.1")
    worker = processes("worker", "--dispatcher-address", dispatcher.address, "--port", "0",
                       "--worker-address", "127.0.0.1:%port%", "--import",
                       "cw_data_limits_functions", "--max-cycle-length", "8",
                       "--max-parallel-calls", "2")
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"cycle_length = 16 .* limit of 8 open Datasets"):
        _read(data.Dataset.range(20).interleave(limit_fns.three_of, cycle_length=16),
              dispatcher)
    dataset = data.Dataset.range(20).interleave(limit_fns.three_of, cycle_length=8,
                                                num_parallel_calls=10**6)
    expected = [int(x) for x in data.Dataset.range(20).interleave(limit_fns.three_of,
                                                                  cycle_length=8)]
    with _Peak(worker.process.pid) as peak:
        assert _read(dataset, dispatcher) == expected
    peak.assert_bounded(2)


def test_autotune_cycle_length_is_the_workers_choice_within_its_limit():
    """cycle_length=AUTOTUNE is clamped to max_cycle_length, not refused."""
    dataset = data.Dataset.range(6).interleave(limit_fns.three_of,
                                               cycle_length=data.AUTOTUNE)
    got = [int(x) for x in _on_worker(dataset, PipelineLimits(max_cycle_length=1),
                                      ThreadBudget(8))]
    assert got == [x for x in range(6) for _ in range(3)]


def test_unique_remembers_at_most_the_limit():
    limits = PipelineLimits(max_buffer_elements=100)
    endless = _on_worker(data.Dataset.range(10**12).unique(), limits, ThreadBudget(8))
    assert [int(next(endless)) for _ in range(100)] == list(range(100))
    with pytest.raises(errors.ResourceExhaustedError,
                       match=r"unique\(\) .* at most 100 distinct .*max_buffer_elements"):
        next(endless)
    repeated = data.Dataset.range(100).repeat(3).unique()
    assert [int(x) for x in _on_worker(repeated, limits, ThreadBudget(8))] == list(range(100))


@pytest.mark.parametrize("make", [
    lambda: data.Dataset.range(10**18).skip(2**62),
    lambda: data.Dataset.range(10**18).filter(limit_fns.never),
], ids=["skip", "filter"])
def test_a_pipeline_producing_nothing_stops_with_its_stream(make):
    """skip(2**62) of an infinite range, or a filter keeping nothing, never yields: once
    the reader closes, the stream's thread ends (it spun at one CPU after the close)."""
    dispatcher = data.DispatchServer(data.DispatcherConfig(bind_address="127.0.0.1"))
    worker = data.WorkerServer(data.WorkerConfig(
        dispatcher_address=dispatcher.target.split("://")[1],
        worker_address="127.0.0.1:%port%", function_modules=["cw_data_limits_functions"]))
    try:
        wait_for(lambda: dispatcher.num_workers() == 1, what="the worker")
        before = set(threading.enumerate())
        reader = iter(make().apply(data.distribute("parallel_epochs", dispatcher.target)))
        # A read that waits for the element that never comes (close() does not end it; it
        # ends with the servers).
        threading.Thread(target=next, args=(reader, None), daemon=True).start()

        def producers() -> set[threading.Thread]:
            return {t for t in set(threading.enumerate()) - before
                    if t.name == "clusterwire-data-stream"}
        wait_for(lambda: len(producers()) == 1, what="the stream's producer")
        reader.close()
        wait_for(lambda: not producers(), 30, what="the stream's producer to end")
    finally:
        worker.stop()
        dispatcher.stop()
