"""The combining-tree barrier of jobs larger than barrier.FLAT_MAX_TASKS (issue 33): its
shape, rounds of a real multi-process job, timeouts naming the missing tasks, a dead
internal task."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import child_env, in_process_job, wait_for
from emulated_hosts import requires_netns

from clusterwire import Server, Session, barrier, barrier_tree, errors
from clusterwire.local_cluster import LocalCluster
from clusterwire.protos.service_pb2 import Request, TaskRef
from clusterwire.rpc import RequestClient
from clusterwire.testing.hosts import EmulatedHosts

F = barrier_tree.FAN_IN
TASKS = 70  # > FLAT_MAX_TASKS, on one host: task 0 over 1-32, 1 over 33-64, 2 over 65-69
WAIT = 30.0  # a completing barrier's timeout; it takes a small fraction of it


def addresses(tasks: int, hosts: int) -> dict[int, str]:
    """Task i on host i % hosts (interleaved, so a host's leader is not the next index)."""
    return {i: f"10.0.{i % hosts // 256}.{i % hosts % 256}:{2000 + i}" for i in range(tasks)}


@pytest.mark.parametrize("tasks", [1, 33, 1024])
@pytest.mark.parametrize("hosts", [1, 32])
def test_the_tree_bounds_arrivals_and_depth_and_keeps_a_hosts_tasks_under_its_leader(
        tasks, hosts):
    layout = addresses(tasks, hosts)
    tree = barrier_tree.build(layout)
    host = {i: barrier_tree.host_of(a) for i, a in layout.items()}
    assert tree.root == 0 and tree.parent[0] is None
    assert sorted(tree.parent) == sorted(tree.children) == list(range(tasks))
    for index, children in tree.children.items():
        assert len(children) + 1 <= F + 1  # its own arrival and one report per child
        assert all(tree.parent[child] == index for child in children)
    assert max(tree.depth(i) for i in range(tasks)) <= 3
    leaders = {h: min(i for i in layout if host[i] == h) for h in set(host.values())}
    for index, parent in tree.parent.items():
        if parent is None:
            continue
        if index == leaders[host[index]]:
            assert parent == leaders[host[parent]]  # leaders report to leaders
        else:
            assert host[parent] == host[index]  # the others stay on their host


def test_the_tree_of_one_task_per_host_stays_three_deep():
    tree = barrier_tree.build(addresses(1024, 1024))
    assert max(len(c) for c in tree.children.values()) <= F
    assert max(tree.depth(i) for i in range(1024)) == 3


def test_a_missing_tasks_question_gets_a_peer_timeout_per_ask_below_it():
    tree = barrier_tree.build(addresses(68, 4))  # leaders 1-3 under 0, the others below them
    assert tree.height == 2
    # A leaf answers from what it knows; its parent asks it (1); the root asks a leader
    # (2: its own 1 and the ask) and, if that one is cut off, its children (1).
    assert [tree.question_timeouts(i) for i in (0, 1, 5)] == [3, 1, 0]


def test_a_fan_in_below_two_is_refused():
    with pytest.raises(errors.InvalidArgumentError, match="fan-in >= 2, got 1"):
        barrier_tree.build({0: "a:1"}, fan_in=1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    assert TASKS > barrier.FLAT_MAX_TASKS  # the tree's path
    with LocalCluster({"worker": TASKS}, start_timeout=120.0) as started:
        yield started


def arrive_all(arrive: Callable[[int], object], count: int) -> list[object]:
    """``arrive(i)`` for every i at once; their results in order."""
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(arrive, range(count)))


def outcome(session: Session, name: str, timeout: float) -> str | None:
    """None if the barrier returned, else the DeadlineExceededError's message."""
    try:
        session.barrier(name, timeout=timeout)
    except errors.DeadlineExceededError as err:
        return err.message
    return None


def missing_of(message: str) -> list[int]:
    found = re.search(r"waiting for task\(s\) \[([\d, ]*)\]", message)
    assert found, message
    return [int(i) for i in found.group(1).split(", ")]


def test_every_task_of_a_tree_job_is_released_round_after_round(cluster):
    sessions = [Session(target) for target in cluster.targets["worker"]]
    try:
        for _ in range(4):
            assert arrive_all(lambda i: outcome(sessions[i], "rounds", WAIT),
                              TASKS) == [None] * TASKS
    finally:
        for session in sessions:
            session.close()


def test_arrivals_through_one_task_are_counted_where_they_arrive(cluster):
    with Session(cluster.target("worker", 5)) as session:
        assert arrive_all(lambda i: session.barrier(
            "funnel", task=f"/job:worker/task:{i}", timeout=WAIT), TASKS) == [None] * TASKS


def test_a_tree_timeout_names_the_missing_tasks_and_the_barrier_is_usable_after(cluster):
    late = {9, 40}  # 9 a child of the root, 40 of task 1 (an inner task)
    sessions = [Session(target) for target in cluster.targets["worker"]]
    try:
        messages = arrive_all(lambda i: None if i in late else outcome(
            sessions[i], "partial", 2.0), TASKS)
        assert [m for i, m in enumerate(messages) if i in late] == [None, None]
        assert {tuple(missing_of(m)) for i, m in enumerate(messages)
                if i not in late} == {(9, 40)}
        # Every arrival withdrew: alone, task 0 misses every other task; all together pass.
        assert missing_of(outcome(sessions[0], "partial", 0.5)) == list(range(1, TASKS))
        assert arrive_all(lambda i: outcome(sessions[i], "partial", WAIT),
                          TASKS) == [None] * TASKS
    finally:
        for session in sessions:
            session.close()


def test_a_killed_inner_task_is_named_and_nobody_hangs():
    with LocalCluster({"worker": TASKS}, start_timeout=120.0) as killed:
        tree = barrier_tree.build({i: killed.cluster_spec.task_address("worker", i)
                                   for i in range(TASKS)})
        inner = 1
        assert tree.parent[inner] == 0 and tree.children[inner] == tuple(range(33, 65))
        os.kill(killed.process("worker", inner).pid, signal.SIGKILL)
        killed.process("worker", inner).wait(WAIT)
        alive = [i for i in range(TASKS) if i != inner]
        sessions = {i: Session(killed.target("worker", i), timeout=10.0) for i in alive}
        try:
            # 6 s: every live task's arrival (69 calls at once, beside a busy machine's other
            # work) comes before any barrier times out, so only the dead one is missing.
            messages = arrive_all(lambda k: outcome(sessions[alive[k]], "dead", 6.0),
                                  len(alive))
            # Its children arrived (their reports failed): only the dead task is missing.
            assert all(m is not None and missing_of(m) == [inner] for m in messages), messages
        finally:
            for session in sessions.values():
                session.close()


@pytest.fixture
def small_tree(monkeypatch) -> Iterator[list[Server]]:
    """Four in-process tasks of job "w" whose barrier takes a tree of fan-in 2 (task 0 over
    1 and 2, task 1 over 3), membership changes allowed."""
    monkeypatch.setattr(barrier, "FLAT_MAX_TASKS", 1)
    monkeypatch.setattr(barrier_tree, "FAN_IN", 2)
    config = {"allow_membership_changes": True, "membership_heartbeat_seconds": 0.2,
              "membership_timeout_seconds": 5.0}
    with in_process_job("w", 4, config=config) as servers:
        yield servers


def test_a_membership_change_aborts_every_wait_of_a_tree_round(small_tree):
    tree = barrier_tree.build({i: "127.0.0.1:1" for i in range(4)}, 2)
    assert tree.children[0] == (1, 2) and tree.children[1] == (3,)
    outcomes: dict[int, BaseException | None] = {}

    def arrive(index: int) -> None:
        try:
            with Session(small_tree[index].target) as session:
                session.barrier("step", timeout=WAIT)
            outcomes[index] = None
        except errors.OpError as err:
            outcomes[index] = err

    # Tasks 1, 2, 3 arrive (1's subtree reports to 0, which holds it); task 0 does not.
    waiters = [threading.Thread(target=arrive, args=(i,)) for i in (1, 2, 3)]
    for waiter in waiters:
        waiter.start()
    root = small_tree[0]._service
    wait_for(lambda: root._subtrees.unreported("step", frozenset({0, 1, 2}), 0.0) == [0],
             WAIT, "the reports of tasks 1 and 2 held on task 0")
    newcomer = Server({"w": [*root.cluster.job_tasks("w"), "127.0.0.1:0"]}, job_name="w",
                      task_index=4, config={"allow_membership_changes": True,
                                            "membership_heartbeat_seconds": 0.2,
                                            "membership_timeout_seconds": 5.0})
    try:
        small_tree[0].update_cluster(
            {"w": [*root.cluster.job_tasks("w"), newcomer.target.split("://")[1]]})
        for waiter in waiters:
            waiter.join(WAIT)
            assert not waiter.is_alive()
        assert sorted(outcomes) == [1, 2, 3]
        assert all(isinstance(err, errors.AbortedError) and "membership changed" in err.message
                   for err in outcomes.values()), outcomes
    finally:
        newcomer.stop()


@pytest.mark.parametrize("method, sender, timeout, error", [
    ("barrier_report", 3, 1.0, errors.FailedPreconditionError),  # 3 reports to 1, not 0
    ("barrier_missing", 2, 1.0, errors.FailedPreconditionError),  # asked of 2, sent to 0
    ("barrier_report", 1, float("nan"), errors.InvalidArgumentError),
    ("barrier_report", 1, 1e300, errors.InvalidArgumentError),
    ("barrier_missing", 0, -1.0, errors.InvalidArgumentError),
    ("barrier", 0, float("inf"), errors.InvalidArgumentError),
])
def test_tree_requests_that_do_not_fit_get_clear_errors(small_tree, method, sender, timeout,
                                                        error):
    client = RequestClient("grpc", timeout=WAIT)
    try:
        with pytest.raises(error, match=r"does not fit /job:w/task:0's barrier tree|"
                                        r"is not a wait; send 0"):
            client.send(small_tree[0].target.split("://")[1], Request(
                method=method, name="b", timeout_seconds=timeout,
                from_task=TaskRef(job="w", index=sender)), retry=False)
    finally:
        client.close()


HOSTS, PER_HOST = 4, 17  # 68 tasks: more than FLAT_MAX_TASKS
PORT = 2222


@requires_netns
@pytest.mark.timeout(240)
def test_a_tree_barrier_across_emulated_hosts_names_a_host_cut_off():
    tasks = HOSTS * PER_HOST
    with EmulatedHosts(HOSTS + 1) as hosts:  # the last host runs the client
        # Task i on host i % HOSTS: the leaders are tasks 0-3, the others stay on their host.
        layout = {i: f"{hosts[i % HOSTS].address}:{PORT + i // HOSTS}" for i in range(tasks)}
        tree = barrier_tree.build(layout)
        assert set(tree.children[0]) >= {1, 2, 3}
        assert all(tree.parent[i] % HOSTS == i % HOSTS for i in range(HOSTS, tasks))
        cluster = json.dumps({"w": [layout[i] for i in range(tasks)]})
        served = [hosts[i % HOSTS].serve(
            "serve", "--cluster", cluster, "--job-name", "w", "--task-index", str(i),
            "--config", json.dumps({"peer_timeout_seconds": 1.0}), env=child_env())
            for i in range(tasks)]
        for task in served:
            task.wait_ready(120)
        client = hosts[HOSTS].interpreter(child_env())
        client.exec(
            "import clusterwire\n"
            "from concurrent.futures import ThreadPoolExecutor\n"
            f"to = [clusterwire.Session(t, timeout=15) for t in "
            f"{[task.target for task in served]!r}]\n"
            "pool = ThreadPoolExecutor(len(to))\n"
            "def arrive(i, name, timeout):\n"
            "    try:\n"
            "        to[i].barrier(name, timeout=timeout)\n"
            "    except clusterwire.errors.DeadlineExceededError as err:\n"
            "        return err.message\n"
            "def arrive_all(name, timeout, which):\n"
            "    return list(pool.map(lambda i: arrive(i, name, timeout), which))\n")
        for _ in range(3):
            assert client.eval(f"arrive_all('b', {WAIT}, range({tasks}))",
                               timeout=WAIT + 30) == [None] * tasks
        hosts.cut(2)  # a leader and its host's tasks: packets dropped, no refusal
        alive = [i for i in range(tasks) if i % HOSTS != 2]
        messages = client.eval(f"arrive_all('cut', 3.0, {alive!r})", timeout=WAIT + 30)
        cut_off = [i for i in range(tasks) if i % HOSTS == 2]
        assert all(m is not None and missing_of(m) == cut_off for m in messages), messages
