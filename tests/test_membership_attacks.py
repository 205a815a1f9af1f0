"""Membership attacked by a token holder (a client, a buggy launcher), with real servers on
127.0.0.1: a task's address moved to another listener, a version pinned at 2^64-1, 2,000
invented tasks, changes from clients where the operator did not enable them; and heartbeats
that must not be held up by peers that never answer (issue 29)."""

from __future__ import annotations

import contextlib
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
from clusterwire.local_cluster import LocalCluster, await_ready
from clusterwire.membership import (
    FAILS_BEFORE_BACKOFF,
    MAX_TASKS_CHANGED,
    MAX_VERSION_STEP,
    PROBE_SECONDS,
    Membership,
    PeerLink,
    View,
)
from clusterwire.protos.service_pb2 import Request, TaskRef
from clusterwire.rpc import RequestClient
from clusterwire.security import load_security

pytestmark = pytest.mark.timeout(120)

TOKEN = "membership-attack-test-token-0123456789"
HEARTBEAT = {"membership_heartbeat_seconds": 0.2, "membership_timeout_seconds": 0.8,
             "peer_timeout_seconds": 2.0}
PUTS = 10


@pytest.fixture
def token_config(tmp_path) -> dict:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    return {"auth_token_file": str(path)}


def address_of(server: clusterwire.Server) -> str:
    return server.target.split("://")[1]


def raw(address: str, request: Request, config: dict | None = None):
    """``request`` sent over the wire as any token holder could (no client API in between)."""
    client = RequestClient("grpc", timeout=20, security=load_security(config or {}),
                           in_process=False)
    try:
        return client.send(address, request)
    finally:
        client.close()


def heartbeat(version: int, cluster: dict, sender: tuple[str, int]) -> Request:
    return Request(method="heartbeat", membership_version=version,
                   from_task=TaskRef(job=sender[0], index=sender[1]),
                   cluster=clusterwire.ClusterSpec(cluster).as_cluster_def())


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def puts_reach(via: clusterwire.Session, task: str, owner: clusterwire.Session,
               other: clusterwire.Session, prefix: str) -> None:
    """``PUTS`` puts through ``via`` for ``task`` are all stored by ``owner``, none by
    ``other`` (the listener an attack pointed the task at)."""
    for i in range(PUTS):
        via.put(f"{prefix}{i}", np.arange(4), task=task)
    assert sorted(n for n in owner.list() if n.startswith(prefix)) == sorted(
        f"{prefix}{i}" for i in range(PUTS))
    assert not [n for n in other.list() if n.startswith(prefix)]


def test_update_cluster_cannot_move_a_task_to_another_listener(token_config):
    """The measured hijack (10/10 puts went to the other listener, no heartbeats): refused,
    the real task keeps its traffic, and the operator's own changes still work."""
    with LocalCluster({"ps": 1, "worker": 1}, config=token_config) as cluster, \
            clusterwire.Server({"evil": ["127.0.0.1:0"]}, config=token_config) as evil:
        config = cluster.client_config
        ps = clusterwire.Session(cluster.target("ps"), config=config, timeout=20)
        worker = clusterwire.Session(cluster.target("worker"), config=config, timeout=20)
        spy = clusterwire.Session(evil.target, config=config, timeout=20)
        before = ps.status()["membership_version"]
        hijacked = cluster.cluster_spec.as_dict()
        hijacked["worker"] = [address_of(evil)]
        started = time.monotonic()
        with pytest.raises(errors.FailedPreconditionError,
                           match=r"/job:worker/task:0 does not answer at .*it says "
                                 r"/job:evil/task:0"):
            ps.update_cluster(hijacked)
        assert time.monotonic() - started < 5
        assert ps.status()["membership_version"] == before
        puts_reach(ps, "/job:worker/task:0", worker, spy, "hijack")
        # The operator's repair path (a real change) and status work after the attack.
        assert cluster.add_tasks("worker", 1) == [1]
        assert ps.status()["membership_version"] == before + 1
        for task in (("ps", 0), ("worker", 0), ("worker", 1)):
            status = clusterwire.Session(cluster.target(*task), config=config).status()
            assert (status["job"], status["task_index"]) == task


@contextlib.contextmanager
def heartbeating(count: int, config: dict):
    """``count`` in-process tasks of job "w" with heartbeats, joined (version 1)."""
    servers = [clusterwire.Server({"w": ["127.0.0.1:0"] * count}, job_name="w", task_index=i,
                                  config={**HEARTBEAT, **config}) for i in range(count)]
    try:
        servers[0].update_cluster({"w": [address_of(s) for s in servers]})
        wait_for(lambda: all(s.membership_version == 1 for s in servers), 20, "version 1")
        yield servers
    finally:
        for server in servers:
            server.stop()


def test_a_heartbeat_cannot_move_a_task_and_a_version_cannot_be_pinned(token_config):
    """A raw heartbeat moving a task (the next version, then 2^64-1): the move is probed and
    not adopted, the pin refused naming the version; puts reach the real task; afterwards a
    real change, status() and a join all work."""
    with heartbeating(2, {**token_config, "allow_membership_changes": True}) as (w0, w1), \
            clusterwire.Server({"evil": ["127.0.0.1:0"]}, config=token_config) as evil:
        session = clusterwire.Session(w0.target, config=token_config, timeout=20)
        spy = clusterwire.Session(evil.target, config=token_config, timeout=20)
        real = clusterwire.Session(w1.target, config=token_config, timeout=20)
        hijacked = {"w": [address_of(w0), address_of(evil)]}
        raw(address_of(w0), heartbeat(2, hijacked, ("w", 1)), token_config)
        membership = w0._service.membership
        wait_for(lambda: (("w", 1), address_of(evil)) in membership._refused, 20,
                 "the move probed and refused")
        assert w0.cluster_spec.task_address("w", 1) == address_of(w1)
        puts_reach(session, "/job:w/task:1", real, spy, "moved")

        for version in (2**64 - 1, 2**63, 1 + MAX_VERSION_STEP + 1):
            with pytest.raises(errors.InvalidArgumentError, match=f"version {version} "):
                raw(address_of(w0), heartbeat(version, hijacked, ("w", 1)), token_config)
        assert w0.membership_version == 1
        puts_reach(session, "/job:w/task:1", real, spy, "pinned")

        # The operator's change, status() and `serve --join` still work.
        newcomer = clusterwire.Server({"w": [address_of(w0), address_of(w1), "127.0.0.1:0"]},
                                      job_name="w", task_index=2,
                                      config={**HEARTBEAT, **token_config,
                                              "allow_membership_changes": True})
        joined = None
        try:
            grown = {"w": [address_of(w0), address_of(w1), address_of(newcomer)]}
            assert session.update_cluster(grown) == 2
            assert session.status()["membership_version"] == 2
            wait_for(lambda: w1.membership_version == 2, 20, "version 2 on task 1")
            joined = subprocess.Popen(
                [sys.executable, "-m", "clusterwire", "serve", "--join", w1.target,
                 "--job-name", "w", "--quiet", "--config",
                 json.dumps({**HEARTBEAT, **token_config})], stdout=subprocess.PIPE, text=True)
            target = await_ready(joined, 30)
            assert target is not None
            wait_for(lambda: w0.membership_version == 3, 20, "the join spread to task 0")
            assert w0.cluster_spec.task_address("w", 3) == target.split("://")[1]
        finally:
            newcomer.stop()
            if joined is not None:
                joined.terminate()
                joined.wait(30)
                joined.stdout.close()


def test_two_thousand_invented_tasks_are_refused_and_real_workers_stay_up():
    """2,000 invented tasks (measured: real workers marked down, RSS 68 -> 91 MiB and
    growing): refused whole, by update_cluster and by raw heartbeats; a smaller change of
    invented tasks is refused because they do not answer; the real workers are never down
    and the task's RSS stays within 16 MiB."""
    with LocalCluster({"ps": 1, "worker": 2}, config=HEARTBEAT) as cluster:
        ps = clusterwire.Session(cluster.target("ps"), timeout=30)
        wait_for(lambda: [p["down"] for p in ps.status()["peers"]] == [False, False], 20,
                 "both workers heard")
        pid = cluster.process("ps").pid
        before = rss_mib(pid)
        version = ps.status()["membership_version"]
        real = cluster.cluster_spec.as_dict()
        invented = {**real, "ghost": [f"127.0.0.1:{port}" for port in range(2, 2002)]}
        with pytest.raises(errors.InvalidArgumentError,
                           match=f"joins or moves 2000 tasks is over the {MAX_TASKS_CHANGED}"):
            ps.update_cluster(invented)
        down_seen = []
        for _ in range(20):
            with pytest.raises(errors.InvalidArgumentError, match="joins or moves 2000 tasks"):
                raw(cluster.cluster_spec.task_address("ps", 0),
                    heartbeat(version + 1, invented, ("worker", 0)))
            down_seen += [p["task"] for p in ps.status()["peers"] if p["down"]]
        few = {**real, "ghost": [f"127.0.0.1:{port}" for port in range(2, 66)]}
        started = time.monotonic()
        with pytest.raises(errors.FailedPreconditionError, match=r"/job:ghost/task:\d+ does not"):
            ps.update_cluster(few)
        refused_in = time.monotonic() - started
        assert refused_in < 2  # nothing listens there: refused at once
        down_seen += [p["task"] for p in ps.status()["peers"] if p["down"]]
        assert not down_seen
        assert ps.status()["membership_version"] == version
        assert ps.status()["cluster"].as_dict() == real
        grown = rss_mib(pid) - before
        print(f"ps RSS {before:.1f} MiB -> +{grown:.1f} MiB after 21 changes of 2,000 invented "
              f"tasks and one of 64; the 64 refused in {refused_in:.2f} s")
        assert grown < 16


def test_changes_from_clients_are_refused_unless_the_operator_enables_them():
    with clusterwire.Server({"w": ["127.0.0.1:0"]}, job_name="w", task_index=0) as w0, \
            clusterwire.Server({"w": ["127.0.0.1:1", "127.0.0.1:0"]}, job_name="w",
                               task_index=1) as w1:
        grown = {"w": [address_of(w0), address_of(w1)]}
        with pytest.raises(errors.PermissionDeniedError,
                           match="allow_membership_changes.*--allow-membership-changes"):
            clusterwire.Session(w0.target).update_cluster(grown)
        with pytest.raises(errors.PermissionDeniedError, match="allow_membership_changes"):
            raw(address_of(w0), heartbeat(1, grown, ("w", 1)))
        assert w0.membership_version == 0
        assert w0.cluster_spec.task_indices("w") == [0]
        # The task's own operator may still change it (Server.update_cluster).
        assert w0.update_cluster(grown) == 1

    # `serve --allow-membership-changes` enables them.
    with clusterwire.Server({"w": ["127.0.0.1:1", "127.0.0.1:0"]}, job_name="w",
                            task_index=1) as w1:
        served = subprocess.Popen(
            [sys.executable, "-m", "clusterwire", "serve", "--cluster",
             json.dumps({"w": ["127.0.0.1:0"]}), "--job-name", "w", "--task-index", "0",
             "--allow-membership-changes", "--quiet"], stdout=subprocess.PIPE, text=True)
        try:
            target = await_ready(served, 30)
            assert target is not None
            grown = {"w": [target.split("://")[1], address_of(w1)]}
            assert clusterwire.Session(target, timeout=20).update_cluster(grown) == 1
        finally:
            served.terminate()
            served.wait(30)
            served.stdout.close()


def test_a_peer_that_stops_answering_is_backed_off_and_its_channel_closed():
    with heartbeating(3, {}) as servers:
        gone = address_of(servers[2])
        membership, peers = servers[0]._service.membership, servers[0]._service._peers
        servers[2].stop()
        wait_for(lambda: ("w", 2) in membership._retry_at and gone not in peers._channels,
                 10, "task 2 backed off, its channel closed")
        assert [p["down"] for p in clusterwire.Session(servers[0].target).status()["peers"]] \
            == [False, True]


def test_peers_that_never_answer_do_not_hold_up_the_heartbeats_of_live_ones():
    """64 peers whose heartbeats hang for their whole deadline, 3 that answer: the live
    ones are never down, the hanging ones are backed off (a few sends each) and their
    channels closed once they failed FAILS_BEFORE_BACKOFF times (8 senders share them)."""
    interval, window = 0.1, 4.0
    live = {("w", i) for i in range(1, 4)}
    cluster = clusterwire.ClusterSpec({"w": [f"10.0.0.1:{1000 + i}" for i in range(68)]})
    addresses = {task: address for task, address in cluster.task_addresses().items()}
    sends: dict[str, int] = {}
    forgotten: set[str] = set()
    lock, hang = threading.Lock(), threading.Event()

    def send(address: str, view: View, timeout: float) -> View:
        with lock:
            sends[address] = sends.get(address, 0) + 1
        if address in {addresses[task] for task in live}:
            return view
        hang.wait(timeout)  # an address that never answers, for the send's whole deadline
        raise errors.DeadlineExceededError(f"no answer from {address}")

    def identify(task, address, timeout) -> None:
        raise AssertionError("nothing joins or moves here")

    membership = Membership(("w", 0), cluster, lambda old, new: None,
                            PeerLink(send, identify, forgotten.add), interval, 5 * interval)
    membership.start()
    try:
        deadline, samples = time.monotonic() + window, threading.Event()
        while time.monotonic() < deadline:  # a sample every interval
            down = {task for task, _, _, is_down in membership.peers() if is_down}
            assert not down & live, f"live peers marked down: {down & live}"
            samples.wait(interval)
    finally:
        membership.stop()
        hang.set()
    dead = [address for task, address in addresses.items() if task not in live | {("w", 0)}]
    failed_enough = {address for address in dead
                     if sends.get(address, 0) >= FAILS_BEFORE_BACKOFF}
    assert len(failed_enough) > len(dead) // 2
    assert failed_enough <= forgotten
    assert max(sends.get(address, 0) for address in dead) <= 8
    assert min(sends[addresses[task]] for task in live) >= window / interval / 2


def test_a_version_bumped_on_the_same_cluster_does_not_abort_a_barrier():
    """Raw heartbeats that only raise the version (each within MAX_VERSION_STEP) are adopted,
    and a barrier waiting meanwhile goes on to complete."""
    with heartbeating(2, {}) as (w0, w1):
        outcome: list[BaseException] = []

        def arrive() -> None:
            try:
                clusterwire.Session(w1.target).barrier("step", timeout=30)
            except errors.OpError as err:
                outcome.append(err)

        waiter = threading.Thread(target=arrive)
        waiter.start()
        wait_for(lambda: any(s.name == "clusterwire_requests_in_flight" and s.value >= 1
                             for s in w0._service.status().metrics), 20, "the arrival held")
        cluster = w0.cluster_spec.as_dict()
        for bump in range(1, 11):
            raw(address_of(w0), heartbeat(1 + bump * MAX_VERSION_STEP, cluster, ("w", 1)))
        assert w0.membership_version == 1 + 10 * MAX_VERSION_STEP
        clusterwire.Session(w0.target).barrier("step", timeout=30)
        waiter.join(30)
        assert not waiter.is_alive() and not outcome


def test_a_task_restarted_far_behind_catches_up_from_its_peers():
    """A task restarted (version 0, on a new port) in a cluster more than MAX_VERSION_STEP
    versions on: the views its peers push are too far ahead for it, but the answers to its
    own heartbeats bring it up to date, and its new address, confirmed, reaches them."""
    with heartbeating(2, {}) as (w0, w1):
        cluster = w0.cluster_spec.as_dict()
        for bump in range(1, 3):
            raw(address_of(w0), heartbeat(1 + bump * MAX_VERSION_STEP, cluster, ("w", 1)))
        far = 1 + 2 * MAX_VERSION_STEP
        wait_for(lambda: w1.membership_version == far, 20, "task 1 at the bumped version")
        w1.stop()
        again = clusterwire.Server({"w": [address_of(w0), "127.0.0.1:0"]}, job_name="w",
                                   task_index=1, config=HEARTBEAT)
        try:
            wait_for(lambda: w0.cluster_spec.task_address("w", 1) == address_of(again), 20,
                     "task 0 learning task 1's new address")
            assert again.membership_version == w0.membership_version == far + 1
            puts_reach(clusterwire.Session(w0.target), "/job:w/task:1",
                       clusterwire.Session(again.target), clusterwire.Session(w0.target),
                       "caught-up")
        finally:
            again.stop()


def test_views_that_hang_their_probes_do_not_hold_up_a_real_change():
    """Raw heartbeats moving a task to a listener that never answers (each probe hangs for
    its whole deadline) keep one verification lane busy; a real join spreading from a peer
    is still adopted at once, through the answers to the task's own heartbeats."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # the kernel completes connections; nothing ever answers on them
    try:
        with heartbeating(2, {"allow_membership_changes": True}) as (w0, w1):
            hanging = {"w": [address_of(w0), f"127.0.0.1:{hole.getsockname()[1]}"]}
            for bump in range(2, 6):
                raw(address_of(w0), heartbeat(bump, hanging, ("w", 1)))
            newcomer = clusterwire.Server(
                {"w": [address_of(w0), address_of(w1), "127.0.0.1:0"]}, job_name="w",
                task_index=2, config={**HEARTBEAT, "allow_membership_changes": True})
            try:
                started = time.monotonic()
                w1.update_cluster({"w": [address_of(w0), address_of(w1),
                                         address_of(newcomer)]})
                wait_for(lambda: w0.cluster_spec.task_indices("w") == [0, 1, 2], 20,
                         "task 0 adopting the join")
                adopted_in = time.monotonic() - started
                assert adopted_in < PROBE_SECONDS / 2, adopted_in
                assert w0.cluster_spec.task_address("w", 1) == address_of(w1)
            finally:
                newcomer.stop()
    finally:
        hole.close()
