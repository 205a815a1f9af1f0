"""Membership that changes while the job runs: versions spread by heartbeats, tasks join,
leave, go down and move, barriers end clearly when the membership changes under them."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import wait_for

import clusterwire
from clusterwire import errors
from clusterwire.local_cluster import await_ready
from clusterwire.membership import View

pytestmark = pytest.mark.timeout(60)

HEARTBEAT = {"membership_heartbeat_seconds": 0.2, "membership_timeout_seconds": 0.6,
             "peer_timeout_seconds": 0.5, "allow_membership_changes": True}


def start_task(cluster: dict, index: int, config: dict | None = None) -> clusterwire.Server:
    return clusterwire.Server(cluster, job_name="w", task_index=index,
                              config={**HEARTBEAT, **(config or {})})


@contextlib.contextmanager
def tasks(count: int):
    """``count`` tasks of job "w", each started knowing only its own port, then joined by
    an update on task 0 that spreads to the others."""
    servers = [start_task({"w": ["127.0.0.1:0"] * count}, i) for i in range(count)]
    try:
        full = {"w": [s.target.split("://")[1] for s in servers]}
        servers[0].update_cluster(full)
        converged(servers, 1)
        yield servers, full
    finally:
        for server in servers:
            server.stop()


def converged(servers, version: int, timeout: float = 10.0) -> float:
    """Seconds until every server has ``version``, all the same view."""
    started = time.monotonic()
    wait_for(lambda: all(s.membership_version == version for s in servers), timeout,
             f"every task at membership version {version}")
    views = {s._service.membership.view.digest for s in servers}
    assert len(views) == 1, "tasks at one version with different clusters"
    return time.monotonic() - started


def test_a_task_that_joins_is_reached_without_restarting_anything():
    with tasks(3) as (servers, full):
        newcomer = start_task({"w": [*full["w"], "127.0.0.1:0"]}, 3)
        try:
            grown = {"w": [*full["w"], newcomer.target.split("://")[1]]}
            assert servers[1].update_cluster(grown) == 2  # any task can take the change
            converged([*servers, newcomer], 2)
            session = clusterwire.Session(servers[0].target)
            session.put("fresh", np.arange(5), task="/job:w/task:3")
            np.testing.assert_array_equal(
                clusterwire.Session(servers[2].target).get("fresh", task="/job:w/task:3"),
                np.arange(5))
        finally:
            newcomer.stop()


def test_a_request_for_a_task_that_left_fails_at_once_naming_it_and_the_version():
    with tasks(3) as (servers, full):
        servers[0].update_cluster({"w": {0: full["w"][0], 1: full["w"][1]}})
        converged(servers[:2], 2)
        started = time.monotonic()
        with pytest.raises(errors.NotFoundError,
                           match=r"No task /job:w/task:2 .*membership version 2"):
            clusterwire.Session(servers[1].target).get("x", task="/job:w/task:2")
        assert time.monotonic() - started < 0.5


def test_a_task_that_stops_answering_is_down_in_status():
    with tasks(3) as (servers, _full):
        session = clusterwire.Session(servers[0].target)
        wait_for(lambda: {p["task"]: p["down"] for p in session.status()["peers"]} == {
            "/job:w/task:1": False, "/job:w/task:2": False}, what="both peers heard from")
        servers[2].stop()
        stopped = time.monotonic()
        wait_for(lambda: {p["task"]: p["down"] for p in session.status()["peers"]} == {
            "/job:w/task:1": False, "/job:w/task:2": True}, what="task 2 down")
        assert time.monotonic() - stopped < 0.6 + 3 * 0.2 + 0.5  # timeout + heartbeats
        [peer] = [p for p in session.status()["peers"] if p["down"]]
        assert peer["last_seen"] > 0


def test_a_task_restarted_on_a_new_address_is_reached_there():
    with tasks(3) as (servers, full):
        servers[2].stop()
        # Restarted from the cluster it was told (its old address), on a new port.
        again = start_task({"w": [*full["w"][:2], "127.0.0.1:0"]}, 2)
        try:
            moved = again.target.split("://")[1]
            assert moved != full["w"][2]
            # Task 1 forwards the get below: it must have learnt the address too (on a loaded
            # machine it did a heartbeat after task 0).
            wait_for(lambda: all(s.cluster_spec.task_address("w", 2) == moved
                                 for s in servers[:2]),
                     what="tasks 0 and 1 learning task 2's new address")
            again_session = clusterwire.Session(again.target)
            again_session.put("here", np.ones(3))
            np.testing.assert_array_equal(
                clusterwire.Session(servers[1].target).get("here", task="/job:w/task:2"),
                np.ones(3))
        finally:
            again.stop()


def test_a_barrier_waiting_when_the_membership_changes_ends_with_aborted():
    with tasks(2) as (servers, full):
        outcome: list[BaseException] = []

        def arrive() -> None:
            try:
                clusterwire.Session(servers[1].target).barrier("step", timeout=20)
            except errors.OpError as err:
                outcome.append(err)

        waiter = threading.Thread(target=arrive)
        waiter.start()
        wait_for(lambda: _barrier_waiting(servers[0]), what="the arrival held")
        newcomer = start_task({"w": [*full["w"], "127.0.0.1:0"]}, 2)
        try:
            servers[0].update_cluster({"w": [*full["w"], newcomer.target.split("://")[1]]})
            waiter.join(10)
            [err] = outcome
            assert isinstance(err, errors.AbortedError)
            assert "membership changed (version 1 -> 2)" in err.message
            # A new round counts the members of version 2: all three.
            converged([*servers, newcomer], 2)
            arrivals = [threading.Thread(target=clusterwire.Session(s.target).barrier,
                                         args=("step",), kwargs={"timeout": 20})
                        for s in (servers[1], newcomer)]
            for arrival in arrivals:
                arrival.start()
            clusterwire.Session(servers[0].target).barrier("step", timeout=20)
            for arrival in arrivals:
                arrival.join(20)
                assert not arrival.is_alive()
        finally:
            newcomer.stop()


def _barrier_waiting(server: clusterwire.Server) -> bool:
    samples = server._service.status().metrics
    return any(s.name == "clusterwire_requests_in_flight" and s.value >= 1 for s in samples)


def test_changes_made_at_once_on_two_tasks_converge_on_one():
    with tasks(3) as (servers, full), contextlib.ExitStack() as stack:
        # Two launchers start a task each: /job:w/task:3 and /job:x/task:0.
        w3 = stack.enter_context(start_task({"w": [*full["w"], "127.0.0.1:0"]}, 3))
        x0 = stack.enter_context(clusterwire.Server(
            {**full, "x": ["127.0.0.1:0"]}, job_name="x", task_index=0, config=HEARTBEAT))
        a = {"w": [*full["w"], w3.cluster_spec.task_address("w", 3)]}
        b = {**full, "x": [x0.cluster_spec.task_address("x", 0)]}
        both = [threading.Thread(target=servers[0].update_cluster, args=(a,)),
                threading.Thread(target=servers[1].update_cluster, args=(b,))]
        for thread in both:
            thread.start()
        for thread in both:
            thread.join()
        # Version 2 from both (the greater digest wins), or 3 from one that saw the other's.
        wait_for(lambda: len({(s.membership_version, s._service.membership.view.digest)
                              for s in servers}) == 1,
                 what="one view on every task")
        assert servers[2].membership_version in (2, 3)
        assert servers[2].cluster_spec.as_dict() in (a, b)


class MovingResolver:
    """A resolver whose cluster changes when told (the contract: cluster_spec() is polled)."""

    task_type, task_id, rpc_layer = "w", 0, "grpc"

    def __init__(self, cluster: dict):
        self.cluster = cluster
        self.failure: Exception | None = None
        self.polls = 0

    def cluster_spec(self) -> clusterwire.ClusterSpec:
        self.polls += 1
        if self.failure is not None:
            raise self.failure
        return clusterwire.ClusterSpec(self.cluster)


def test_a_server_follows_its_resolver():
    other = start_task({"w": ["127.0.0.1:0", "127.0.0.1:0"]}, 1)
    resolver = MovingResolver({"w": ["127.0.0.1:0"]})
    server = clusterwire.Server.from_resolver(resolver, config=HEARTBEAT, watch=0.1)
    try:
        assert server.membership_version == 0
        resolver.failure = OSError("the resolver's API is down")  # kept going, not fatal
        polled = resolver.polls
        wait_for(lambda: resolver.polls >= polled + 2, what="the watch polling a failure")
        resolver.failure = None
        resolver.cluster = {"w": [server.target.split("://")[1],
                                  other.target.split("://")[1]]}
        converged([server, other], 1)
        clusterwire.Session(other.target).put("v", np.arange(2))
        np.testing.assert_array_equal(
            clusterwire.Session(server.target).get("v", task="/job:w/task:1"), np.arange(2))
    finally:
        server.stop()
        other.stop()


def test_update_cluster_corrects_this_tasks_own_address():
    with start_task({"w": ["127.0.0.1:0"]}, 0) as server, clusterwire.Server(
            {"w": ["127.0.0.1:1"], "x": ["127.0.0.1:0"]}, job_name="x", task_index=0) as x:
        # Another job joins; this task's address stays its own.
        assert server.update_cluster({"w": ["127.0.0.1:1"], "x": [x.cluster_spec.task_address(
            "x", 0)]}) == 1
        assert server.cluster_spec.task_address("w", 0) == server.target.split("://")[1]


@pytest.mark.parametrize("bad, error, match", [
    ({"x": ["127.0.0.1:2"]}, errors.InvalidArgumentError,
     "does not have this task /job:w/task:0"),
    # Nothing serves there: a task joins only where it answers as itself.
    ({"w": ["127.0.0.1:1"], "x": ["127.0.0.1:2"]}, errors.FailedPreconditionError,
     r"/job:x/task:0 does not answer at 127.0.0.1:2"),
])
def test_update_cluster_checks_its_argument(bad, error, match):
    with start_task({"w": ["127.0.0.1:0"]}, 0) as server:
        with pytest.raises(error, match=match):
            server.update_cluster(bad)
        assert server.membership_version == 0


@pytest.mark.parametrize("watch", [0, -1, "1", True])
def test_a_bad_watch_interval_is_an_invalid_argument(watch):
    with pytest.raises(errors.InvalidArgumentError, match="watch must be a number"):
        clusterwire.Server.from_resolver(MovingResolver({"w": ["127.0.0.1:0"]}), watch=watch)


def test_a_negative_heartbeat_is_an_invalid_argument():
    with pytest.raises(errors.InvalidArgumentError, match="membership_heartbeat_seconds"):
        clusterwire.Server.create_local_server(config={"membership_heartbeat_seconds": -1})


def test_sixteen_tasks_converge_on_a_change_well_within_two_seconds():
    with tasks(16) as (servers, full):
        newcomer = start_task({"w": [*full["w"], "127.0.0.1:0"]}, 16)
        try:
            servers[7].update_cluster({"w": [*full["w"], newcomer.target.split("://")[1]]})
            assert converged([*servers, newcomer], 2) < 2.0
        finally:
            newcomer.stop()


def test_views_order_by_version_then_digest():
    one = clusterwire.ClusterSpec({"w": ["a:1"]})
    two = clusterwire.ClusterSpec({"w": ["a:2"]})
    assert View.of(2, one).newer_than(View.of(1, two))
    assert View.of(1, one).newer_than(View.of(1, two)) != View.of(1, two).newer_than(
        View.of(1, one))
    assert not View.of(1, one).newer_than(View.of(1, one))


def test_a_session_updates_the_membership_of_a_running_task():
    with tasks(2) as (servers, full):
        newcomer = start_task({"w": [*full["w"], "127.0.0.1:0"]}, 2)
        try:
            grown = {"w": [*full["w"], newcomer.target.split("://")[1]]}
            assert clusterwire.Session(servers[1].target).update_cluster(grown) == 2
            converged([*servers, newcomer], 2)
            with pytest.raises(errors.InvalidArgumentError, match="cannot remove itself"):
                clusterwire.Session(servers[1].target).update_cluster({"w": full["w"][:1]})
        finally:
            newcomer.stop()


def test_a_local_cluster_grows_and_shrinks_while_it_runs():
    from clusterwire.local_cluster import LocalCluster

    with LocalCluster({"ps": 1, "worker": 1}, config=HEARTBEAT) as cluster:
        session = clusterwire.Session(cluster.target("ps"))
        assert cluster.add_tasks("worker", 2) == [1, 2]
        wait_for(lambda: all(clusterwire.Session(cluster.target(*t)).status()[
            "membership_version"] == 2 for t in (("ps", 0), ("worker", 0), ("worker", 2))),
            what="every task at version 2")
        session.put("w", np.arange(4), task="/job:worker/task:2")
        np.testing.assert_array_equal(
            clusterwire.Session(cluster.target("worker", 0)).get("w", task="/job:worker/task:2"),
            np.arange(4))
        cluster.remove_task("worker", 1)
        assert cluster.process("worker", 1).poll() is not None  # stopped
        with pytest.raises(errors.NotFoundError, match="was removed"):
            cluster.target("worker", 1)
        wait_for(lambda: session.status()["membership_version"] == 3, what="version 3")
        with pytest.raises(errors.NotFoundError, match="membership version 3"):
            session.get("w", task="/job:worker/task:1")


def test_the_elastic_demo_says_each_membership_change_and_passes():
    result = subprocess.run([sys.executable, "-m", "clusterwire", "demo", "--elastic",
                             "--steps", "40"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("  membership: starts at version 1 (version 0 is the cluster ")
    changes = [line.strip() for line in lines if line.startswith("  membership: version")]
    assert changes == [
        "membership: version 1 -> 2; joined /job:worker/task:2, /job:worker/task:3; 4 workers",
        "membership: version 2 -> 3; left /job:worker/task:2; 3 workers"]
    assert "  membership: /job:worker/task:2 is down (no heartbeat for 1 s)" in lines
    # the kill is said before the ps sees the task down, which is before it leaves
    said = [next(i for i, line in enumerate(lines) if text in line) for text in (
        "SIGKILLed /job:worker/task:2", "/job:worker/task:2 is down", "left /job:worker")]
    assert said == sorted(said)
    assert lines[-1].startswith("verdict: OK: the loss fell ")
    assert "the workers went 2 -> 4 -> 3; each of the 3 left ran its 40 steps" in lines[-1]


def test_the_elastic_demo_verdict_fails_on_the_wrong_shape():
    from clusterwire import demo_elastic

    out = io.StringIO()
    assert demo_elastic._verdict(1.0, 1e-6, [2, 3, 4, 3], [40, 40, 5, 40], [0, 1, 3], 40,
                                 np.zeros(2), {"/job:ps/task:0": 0}, out) == 1
    assert "the workers went 2 -> 3 -> 4 -> 3, not 2 -> 4 -> 3" in out.getvalue()


def test_a_task_joins_a_running_cluster_from_the_command_line():
    with tasks(2) as (servers, full):
        joined = subprocess.Popen(
            [sys.executable, "-m", "clusterwire", "serve", "--join", servers[1].target,
             "--job-name", "w", "--quiet", "--config", json.dumps(HEARTBEAT)],
            stdout=subprocess.PIPE, text=True)
        try:
            target = await_ready(joined, 30)
            assert target is not None
            converged(servers, 2)
            assert servers[0].cluster_spec.task_address("w", 2) == target.split("://")[1]
            clusterwire.Session(target).put("from-2", np.arange(3))
            np.testing.assert_array_equal(
                clusterwire.Session(servers[0].target).get("from-2", task="/job:w/task:2"),
                np.arange(3))
        finally:
            joined.terminate()
            joined.wait(20)
        bad = subprocess.run([sys.executable, "-m", "clusterwire", "serve", "--join",
                              servers[0].target], capture_output=True, text=True, timeout=30)
        assert bad.returncode != 0 and "--join needs --job-name" in bad.stderr


def test_a_heartbeating_task_whose_port_is_taken_says_so():
    # Its heartbeat thread is made before the bind and started after it: the failed start
    # must not try to join a thread that never ran (it raised RuntimeError instead).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(errors.UnavailableError, match=f"port {port} is in use"):
            clusterwire.Server({"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]},
                               job_name="worker", task_index=0,
                               config={"membership_heartbeat_seconds": 0.2})
