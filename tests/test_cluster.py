"""A real 3-process cluster on loopback: put/get/call across tasks, forwarding, barrier."""

from __future__ import annotations

import os
import threading
import time

import cw_test_functions as fns
import numpy as np
import pytest
from conftest import child_env

from clusterwire import ClusterSpec, Session
from clusterwire.errors import DeadlineExceededError, RemoteFunctionError, UnavailableError
from clusterwire.local_cluster import LocalCluster

TASKS = ["/job:ps/task:0", "/job:worker/task:0", "/job:worker/task:1"]


def test_every_task_knows_the_completed_cluster(cluster3):
    for job, targets in cluster3.targets.items():
        for index, target in enumerate(targets):
            with Session(target) as session:
                status = session.status()
            assert (status["job"], status["task_index"]) == (job, index)
            assert status["cluster"] == cluster3.cluster_spec
            assert status["target"] == target
    assert all(port != "0" for addrs in cluster3.cluster_spec.as_dict().values()
               for port in (a.rsplit(":", 1)[1] for a in addrs))


def test_tasks_run_in_separate_processes(cluster3):
    with Session(cluster3.target("ps")) as session:
        pids = {session.call(fns.where_am_i, task=task) for task in TASKS}
    assert len(pids) == 3 and os.getpid() not in pids


@pytest.mark.parametrize("entry", ["ps", "worker"])
def test_put_on_one_task_get_from_another_through_forwarding(cluster3, entry):
    value = np.random.default_rng(7).standard_normal((64, 33))
    with Session(cluster3.target(entry)) as session:
        for task in TASKS:
            session.put(f"v-{entry}", value * TASKS.index(task), task=task)
    with Session(cluster3.target("worker", 1)) as other:
        for task in TASKS:
            np.testing.assert_array_equal(other.get(f"v-{entry}", task=task),
                                          value * TASKS.index(task))
            assert f"v-{entry}" in other.list(task=task)
            assert other.delete(f"v-{entry}", task=task) is True


def test_values_stay_on_their_task(cluster3):
    with Session(cluster3.target("ps")) as session:
        session.put("only-on-w1", 1, task="/job:worker/task:1")
        assert "only-on-w1" not in session.list()
        assert "only-on-w1" not in session.list(task="/job:worker/task:0")
        session.delete("only-on-w1", task="/job:worker/task:1")


def test_large_value_forwarded_between_processes(cluster3):
    array = np.random.default_rng(3).integers(0, 255, 48 << 20, dtype=np.uint8)
    with Session(cluster3.target("worker", 0)) as session:
        session.put("big", array, task="/job:ps/task:0")
        assert np.array_equal(session.get("big", task="/job:ps/task:0"), array)
        session.delete("big", task="/job:ps/task:0")


def test_call_forwarded_to_each_task(cluster3):
    with Session(cluster3.target("worker", 0)) as session:
        for task in TASKS:
            result = session.call(fns.scaled, np.arange(4.0), 3.0, task=task)
            np.testing.assert_array_equal(result, [0, 3, 6, 9])


def test_remote_error_crosses_two_hops_with_its_traceback(cluster3):
    with Session(cluster3.target("worker", 0)) as session:
        with pytest.raises(RemoteFunctionError) as info:
            session.call(fns.fail_with_value_error, "hop", task="/job:ps/task:0")
    assert info.value.remote_type == "builtins.ValueError"
    assert "bad value: hop" in info.value.message
    assert "cw_test_functions.py" in info.value.remote_traceback


def test_barrier_releases_all_tasks_of_a_job_together(cluster3):
    released = []
    errors = []

    def arrive(index):
        try:
            with Session(cluster3.target("worker", index)) as session:
                session.barrier("round", timeout=20)
                released.append(index)
        except Exception as err:  # recorded and asserted below
            errors.append(err)

    first = threading.Thread(target=arrive, args=(0,))
    first.start()
    first.join(0.5)
    assert first.is_alive() and not released  # waits for worker 1
    second = threading.Thread(target=arrive, args=(1,))
    second.start()
    for thread in (first, second):
        thread.join(20)
    assert not errors and sorted(released) == [0, 1]


def test_barrier_is_reusable_and_can_arrive_on_behalf_of_another_task(cluster3):
    with Session(cluster3.target("ps")) as session:
        for _ in range(2):
            done: list[bool] = []

            def arrive_as_worker0(done=done):
                session.barrier("again", task="/job:worker/task:0", timeout=20)
                done.append(True)

            waiter = threading.Thread(target=arrive_as_worker0)
            waiter.start()
            session.barrier("again", task="/job:worker/task:1", timeout=20)
            waiter.join(20)
            assert done == [True]


def test_barrier_timeout_names_the_missing_task(cluster3):
    with Session(cluster3.target("worker", 0)) as session:
        with pytest.raises(DeadlineExceededError, match=r"waiting for task\(s\) \[1\]"):
            session.barrier("lonely", timeout=0.5)


def test_task_down_gives_unavailable_within_the_peer_deadline():
    with LocalCluster({"a": 1, "b": 1}, imports=["cw_test_functions"], env=child_env(),
                      config={"peer_timeout_seconds": 1.5}) as cluster:
        with Session(cluster.target("a")) as session:
            session.put("x", 1, task="/job:b/task:0")
            victim = cluster.process("b")
            victim.kill()
            victim.wait(10)
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="unavailable after 1.5 s"):
                session.get("x", task="/job:b/task:0")
            assert time.monotonic() - started < 6
            assert session.status()["job"] == "a"  # the surviving server keeps serving


def test_cluster_spec_of_local_cluster(cluster3):
    assert isinstance(cluster3.cluster_spec, ClusterSpec)
    assert cluster3.cluster_spec.jobs == ["ps", "worker"]
    assert cluster3.cluster_spec.num_tasks("worker") == 2


def test_chaos_demo_survives_a_killed_and_restarted_worker():
    """The parameter-server demo finishes with a worker SIGKILLed and restarted mid-run."""
    import io

    from clusterwire.demo import run_demo

    out = io.StringIO()
    assert run_demo(steps=30, chaos=True, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "chaos: worker 1 killed (SIGKILL) at step " in text
    assert "chaos: worker 1 is back; its shard was sent again and it trains its remaining" in text
    steps = [int(line.split()[1].split("/")[0]) for line in text.splitlines()
             if line.startswith("  step")]
    assert steps == sorted(set(steps)) and steps[-1] == 60  # monotone, within its total
    assert "verdict: OK" in text and "60/60 steps ran" in text
