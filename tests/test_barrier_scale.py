"""Barriers of more tasks than any thread pool: they cannot deadlock (issue: Scale).

Each task's server runs with ``max_workers`` far below the number of tasks, so a design
that holds a server thread per waiting arrival on one task would hang here.
"""

from __future__ import annotations

import importlib.util
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import in_process_job

from clusterwire import ClusterSpec, Server, Session, barrier
from clusterwire.errors import CancelledError, DeadlineExceededError, UnavailableError
from clusterwire.local_cluster import LocalCluster

TASKS = 40
MAX_WORKERS = 2
WAIT = 30  # every barrier's timeout; a working one takes a small fraction of it


# (protocol, arrivals the coordinator may hold; 0: the combining tree, as for any job of
# more than barrier.FLAT_MAX_TASKS tasks): with 64, clients arrive at the coordinator itself
# and wait there; with 4 (the flat path's overflow) they arrive through their own task, which
# the coordinator answers at once and releases by a call.
SETUPS = [("grpc", 64), ("grpc", 4), ("grpc", 0), ("grpc+local", 0)] + (
    [("zmq", 4)] if importlib.util.find_spec("clusterwire_zmq") is not None else []) + (
    [("grpc+verbs", 64)] if importlib.util.find_spec("ucxx") is not None else [])


@pytest.fixture(params=SETUPS,
                ids=[f"{p}-hold{h}" if h else f"{p}-tree" for p, h in SETUPS])
def tasks(request, monkeypatch) -> Iterator[list[Server]]:
    """TASKS in-process servers of one job, each with MAX_WORKERS threads."""
    if request.param[1]:  # flat, as a job of at most FLAT_MAX_TASKS tasks
        monkeypatch.setattr(barrier, "MAX_HELD_ARRIVALS", request.param[1])
        monkeypatch.setattr(barrier, "FLAT_MAX_TASKS", TASKS)
    else:  # the tree, as a larger job
        monkeypatch.setattr(barrier, "FLAT_MAX_TASKS", TASKS - 1)
    with in_process_job("worker", TASKS, protocol=request.param[0], config={
            "max_workers": MAX_WORKERS, "small_call_reserve": 1}) as servers:
        yield servers


def arrive_all(arrive: Callable[[int], None], count: int) -> list[int]:
    """Run ``arrive(i)`` for every i at once; the indices that returned."""
    with ThreadPoolExecutor(count) as pool:
        return sorted(pool.map(lambda i: (arrive(i), i)[1], range(count)))


def test_every_task_arriving_at_its_own_server_is_released_round_after_round(tasks):
    sessions = [Session(server.target) for server in tasks]
    try:
        for _ in range(3):
            released = arrive_all(lambda i: sessions[i].barrier("round", timeout=WAIT), TASKS)
            assert released == list(range(TASKS))
    finally:
        for session in sessions:
            session.close()


def test_every_arrival_through_one_task_waits_there_without_starving_it(tasks):
    # All TASKS waits park on task 0, whose pool has MAX_WORKERS threads for work; the
    # arrivals for the other tasks and their releases still get through.
    with Session(tasks[0].target) as session:
        released = arrive_all(lambda i: session.barrier(
            "funnel", task=f"/job:worker/task:{i}", timeout=WAIT), TASKS)
        assert released == list(range(TASKS))


def test_a_timed_out_barrier_names_the_missing_tasks_and_is_usable_afterwards(tasks):
    late = {7, 31}
    failures: list[str] = []

    def arrive(i: int) -> None:
        if i in late:
            return
        with Session(tasks[i].target) as session:
            try:
                session.barrier("partial", timeout=1.0)
            except DeadlineExceededError as err:
                failures.append(err.message)

    arrive_all(arrive, TASKS)
    assert len(failures) == TASKS - len(late)
    assert all("waiting for task(s) [7, 31]" in message for message in failures)
    # The arrivals withdrew: the next round needs every task again, and then completes.
    sessions = [Session(server.target) for server in tasks]
    try:
        with pytest.raises(DeadlineExceededError, match=r"task\(s\) \[1, 2, 3, "):
            sessions[0].barrier("partial", timeout=0.5)
        assert arrive_all(lambda i: sessions[i].barrier("partial", timeout=WAIT),
                          TASKS) == list(range(TASKS))
    finally:
        for session in sessions:
            session.close()


def test_a_barrier_of_more_processes_than_server_threads_completes():
    """The measured failure: 17 or more task processes at one barrier never got released."""
    count = 20
    with LocalCluster({"worker": count}) as cluster:
        sessions = [Session(target) for target in cluster.targets["worker"]]
        try:
            for _ in range(2):
                assert arrive_all(lambda i: sessions[i].barrier("b", timeout=WAIT),
                                  count) == list(range(count))
        finally:
            for session in sessions:
                session.close()


def missing_tasks(session: Session, name: str) -> list[int]:
    """The tasks a short arrival as ``session``'s task finds missing from ``name``."""
    with pytest.raises(DeadlineExceededError) as info:
        session.barrier(name, timeout=0.2)
    return [int(i) for i in re.search(r"task\(s\) \[([\d, ]*)\]", info.value.message)
            .group(1).split(", ")]


def test_a_stopping_server_cancels_its_parked_waits(tasks):
    # A flat barrier's clients wait on the coordinator (task 0), a tree's on their own task.
    parked_at = 0 if TASKS <= barrier.FLAT_MAX_TASKS else 3
    outcome: list[BaseException] = []

    def wait() -> None:
        with Session(tasks[3].target) as session:
            try:
                session.barrier("never", timeout=WAIT)
            except (CancelledError, UnavailableError) as err:
                outcome.append(err)

    waiter = threading.Thread(target=wait)
    waiter.start()
    with Session(tasks[1].target) as probe:
        for _ in range(50):  # until task 3's arrival is counted (its caller parked)
            if 3 not in missing_tasks(probe, "never"):
                break
    tasks[parked_at].stop(grace=0.2)
    waiter.join(WAIT)
    assert not waiter.is_alive()
    assert [type(err) for err in outcome] == [CancelledError]


def test_cluster_status_asks_every_task_at_once_and_names_the_ones_down(tasks):
    down = [5, 6, 7, 8, 9, 10]
    for index in down:
        tasks[index].stop()
    with Session(tasks[0].target) as session:
        started = time.monotonic()
        statuses = session.cluster_status(timeout=1.0)
        elapsed = time.monotonic() - started
    assert list(statuses) == [f"/job:worker/task:{i}" for i in range(TASKS)]
    for index, status in enumerate(statuses.values()):
        if index in down:
            assert status["error"].startswith(("DeadlineExceededError", "UnavailableError"))
        else:
            assert (status["job"], status["task_index"]) == ("worker", index)
    # Asked one after another, the six tasks down would take 6 s (1 s each).
    assert elapsed < 4.0, elapsed


def test_a_client_that_cannot_reach_the_coordinator_arrives_through_its_target():
    with in_process_job("w", 2, protocol="grpc") as servers, \
            Session(servers[0].target) as first, Session(servers[1].target) as second:
        # What this client was told of the cluster names a coordinator it cannot reach
        # (here: a closed port); the tasks themselves reach it.
        second._view = (ClusterSpec({"w": ["127.0.0.1:1", servers[1].target.split("://")[1]]}),
                        ("w", 1))
        waiter = threading.Thread(target=first.barrier, args=("b",), kwargs={"timeout": WAIT})
        waiter.start()
        second.barrier("b", timeout=WAIT)
        waiter.join(WAIT)
        assert not waiter.is_alive()  # released by the arrival that went through task 1
