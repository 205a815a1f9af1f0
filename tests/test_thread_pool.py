"""ElasticPool: at most max_workers threads work; waits in parked() do not count."""

from __future__ import annotations

import threading
import time

import pytest

from clusterwire.thread_pool import ElasticPool, parked

WAIT = 20  # bound on every wait; a correct pool needs far less


def test_more_parked_waiters_than_workers_all_finish():
    pool = ElasticPool(2)
    waiters = 12
    together = threading.Barrier(waiters, timeout=WAIT)

    def wait_for_all() -> int:
        with parked():
            return together.wait()

    try:
        results = [f.result(WAIT) for f in [pool.submit(wait_for_all) for _ in range(waiters)]]
    finally:
        pool.shutdown()
    assert sorted(results) == list(range(waiters))
    assert pool.threads == 0


def test_working_threads_never_exceed_max_workers():
    pool = ElasticPool(3)
    lock, running, peak = threading.Lock(), [0], [0]
    started, release = threading.Semaphore(0), threading.Event()

    def work() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        started.release()
        release.wait(WAIT)
        with lock:
            running[0] -= 1

    futures = [pool.submit(work) for _ in range(10)]
    for _ in range(3):
        assert started.acquire(timeout=WAIT)
    assert not started.acquire(timeout=0.2)  # the other seven wait for a working thread
    release.set()
    for future in futures:
        future.result(WAIT)
    pool.shutdown()
    assert peak[0] == 3


def test_threads_beyond_max_workers_end_after_a_burst_of_waits():
    pool = ElasticPool(2, keep_alive=0.05)
    go = threading.Event()
    waiting = threading.Semaphore(0)

    def park() -> None:
        with parked():
            waiting.release()
            go.wait(WAIT)

    futures = [pool.submit(park) for _ in range(8)]
    for _ in range(8):
        assert waiting.acquire(timeout=WAIT)
    assert pool.threads == 8
    go.set()
    for future in futures:
        future.result(WAIT)
    deadline = time.monotonic() + WAIT
    while pool.threads > 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a counter: surplus threads end once they find no work
    assert pool.threads == 2
    pool.shutdown()


def test_results_errors_and_shutdown_are_those_of_an_executor():
    pool = ElasticPool(1)
    assert pool.submit(pow, 2, 10).result(WAIT) == 1024
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(WAIT)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(pow, 2, 2)


def test_parked_outside_a_pool_changes_nothing():
    with parked():
        pass


def test_max_workers_must_be_positive():
    with pytest.raises(ValueError, match="max_workers must be at least 1, got 0"):
        ElasticPool(0)
