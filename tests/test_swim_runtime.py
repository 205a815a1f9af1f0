"""SWIM failure detection wired into the runtime (``membership_protocol="swim"``), on real
task processes on 127.0.0.1 (LocalCluster) and in-process servers: a SIGKILLed task is down
in every other task's status within the bound the protocol's constants give; an idle
cluster marks no task down; a stopped task leaves; hostile swim requests are refused with
the right error and the task keeps serving; the default (heartbeats) path has no SWIM."""

from __future__ import annotations

import json
import time

import pytest
from conftest import child_env, in_process_job, wait_for
from emulated_hosts import requires_netns

import clusterwire
from clusterwire import errors, swim
from clusterwire.local_cluster import LocalCluster
from clusterwire.protos.service_pb2 import Request, TaskRef
from clusterwire.rpc import RequestClient
from clusterwire.testing.hosts import EmulatedHosts

pytestmark = pytest.mark.timeout(180)

INTERVAL = 0.3
SWIM = {"membership_protocol": "swim", "membership_heartbeat_seconds": INTERVAL,
        "peer_timeout_seconds": 5.0}
CONFIG = swim.Config(probe_interval=INTERVAL, probe_timeout=INTERVAL / 2)
TASKS = 5
#: How long the idle cluster is watched: this many probe rounds.
IDLE_ROUNDS = 30


def detection_bound(tasks: int, config: swim.Config) -> float:
    """Seconds until a killed member is dead at every other one, from the constants: a pass
    of a prober's round robin finds it, the slowest suspicion timeout (no confirmations)
    expires, and the death is piggybacked for as many rounds as an update is sent."""
    _, slowest = config.suspicion_bounds(tasks)
    rounds = (tasks - 1) + config.retransmits(tasks)
    return rounds * config.probe_interval + slowest


def down_map(session: clusterwire.Session) -> dict[str, bool]:
    return {p["task"]: p["down"] for p in session.status()["peers"]}


def raw(address: str, request: Request):
    """``request`` sent over the wire as any client could."""
    client = RequestClient("grpc", timeout=10, in_process=False)
    try:
        return client.send(address, request, retry=False)
    finally:
        client.close()


def swim_request(message: bytes, sender: tuple[str, int]) -> Request:
    return Request(method="swim", swim=message, from_task=TaskRef(job=sender[0],
                                                                   index=sender[1]))


@pytest.fixture(scope="module")
def idle_cluster():
    with LocalCluster({"w": TASKS}, config=SWIM) as cluster:
        yield cluster


def test_an_idle_cluster_marks_no_task_down(idle_cluster):
    """Every task's status is read, in turn, for IDLE_ROUNDS probe rounds: no task is ever
    down at another, and every peer was heard from (SWIM probes ran)."""
    sessions = [clusterwire.Session(idle_cluster.target("w", i), timeout=10)
                for i in range(TASKS)]
    end = time.monotonic() + IDLE_ROUNDS * INTERVAL
    reads = 0
    while time.monotonic() < end:
        for index, session in enumerate(sessions):
            peers = session.status()["peers"]
            assert len(peers) == TASKS - 1
            assert not [p["task"] for p in peers if p["down"]], f"false down at w:{index}"
            reads += 1
    assert reads >= TASKS
    for session in sessions:
        assert all(p["last_seen"] > 0 for p in session.status()["peers"])


def test_hostile_swim_requests_are_refused_and_the_task_serves(idle_cluster):
    address = idle_cluster.target("w", 0).split("://")[1]
    ping = swim.Message(swim.Kind.PING, 1, "w:1", "w:0")
    with pytest.raises(errors.ResourceExhaustedError, match="MAX_MESSAGE_BYTES=16384"):
        raw(address, swim_request(b"[" * (swim.MAX_MESSAGE_BYTES + 1), ("w", 1)))
    with pytest.raises(errors.PermissionDeniedError,
                       match=r"/job:w/task:2 says it is from 'w:1'.*only as itself \('w:2'\)"):
        raw(address, swim_request(ping.to_bytes(), ("w", 2)))
    with pytest.raises(errors.PermissionDeniedError, match="from_task /job:ghost/task:0"):
        raw(address, swim_request(ping.to_bytes(), ("ghost", 0)))
    with pytest.raises(errors.InvalidArgumentError, match="not a SWIM message"):
        raw(address, swim_request(b"{not json", ("w", 1)))
    lying = swim.Message(swim.Kind.PING, 2, "w:1", "w:0", (
        swim.Update("w:3", swim.State.DEAD, 10**6),))
    raw(address, swim_request(lying.to_bytes(), ("w", 1)))  # taken, its update dropped
    response, _ = raw(address, swim_request(ping.to_bytes(), ("w", 1)))
    ack = swim.Message.from_bytes(response.swim)
    assert (ack.kind, ack.seq, ack.sender) == (swim.Kind.ACK, 1, "w:0")
    session = clusterwire.Session(idle_cluster.target("w", 0), timeout=10)
    session.put("still", 7)
    assert session.get("still") == 7
    assert not any(down_map(session).values())


def test_a_killed_task_is_down_everywhere_within_the_bound():
    bound = detection_bound(TASKS, CONFIG)
    with LocalCluster({"w": TASKS}, config=SWIM) as cluster:
        sessions = [clusterwire.Session(cluster.target("w", i), timeout=10)
                    for i in range(TASKS - 1)]
        for session in sessions:
            wait_for(lambda s=session: s.status()["peers"] and all(
                p["last_seen"] > 0 for p in s.status()["peers"]), 30, "every peer probed")
        cluster.process("w", TASKS - 1).kill()
        killed = time.monotonic()
        victim = f"/job:w/task:{TASKS - 1}"
        for session in sessions:
            wait_for(lambda s=session: down_map(s)[victim], bound, f"{victim} down")
        took = time.monotonic() - killed
        assert took < bound
        for session in sessions:
            assert [t for t, down in down_map(session).items() if down] == [victim]


@requires_netns
def test_a_cut_hosts_tasks_are_down_at_the_other_host_within_the_bound():
    """2 emulated hosts x 4 task processes: every peer heard, IDLE_ROUNDS rounds with no task
    down, then host 1's link is cut (its probes time out: nothing refuses them) and its 4
    tasks are down at each of host 0's within the bound, and nothing else is."""
    per_host, port = 4, 2300
    with EmulatedHosts(2) as hosts:
        addresses = [f"{host.address}:{port + i}" for host in hosts for i in range(per_host)]
        cluster = json.dumps({"w": addresses})
        served = [hosts[task // per_host].serve(
            "serve", "--cluster", cluster, "--job-name", "w", "--task-index", str(task),
            "--config", json.dumps(SWIM), env=child_env()) for task in range(len(addresses))]
        for task in served:
            task.wait_ready()
        client = hosts[0].interpreter(child_env())
        client.exec("import clusterwire")

        def peers(address: str) -> list[dict]:
            return client.eval(f"[{{'task': p['task'], 'down': p['down'], 'seen': "
                               f"p['last_seen']}} for p in clusterwire.Session("
                               f"'grpc://{address}', timeout=5).status()['peers']]")

        local = addresses[:per_host]
        for address in local:
            wait_for(lambda a=address: all(p["seen"] > 0 for p in peers(a)), 30,
                     f"every peer heard at {address}")
        end = time.monotonic() + IDLE_ROUNDS * INTERVAL
        while time.monotonic() < end:
            for address in local:
                assert not [p["task"] for p in peers(address) if p["down"]], address
        hosts.cut(1)
        cut = time.monotonic()
        bound = detection_bound(len(addresses), CONFIG)
        gone = {f"/job:w/task:{task}" for task in range(per_host, 2 * per_host)}
        for address in local:
            wait_for(lambda a=address: {p["task"] for p in peers(a) if p["down"]} == gone,
                     bound, f"host 1's tasks down at {address}")
        assert time.monotonic() - cut < bound


def test_a_joined_task_is_probed_and_found_down_when_it_stops():
    """A task joins through update_cluster (identify), announces itself to SWIM
    (allow_membership_changes), is heard from by every task, and is down at every task
    within the bound once it stops."""
    config = {**SWIM, "allow_membership_changes": True}
    with in_process_job("w", 3, protocol="grpc", config=config) as servers:
        addresses = [s.target.split("://")[1] for s in servers]
        joined = clusterwire.Server({"w": [*addresses, "127.0.0.1:0"]}, job_name="w",
                                    task_index=3, protocol="grpc", config=config)
        try:
            servers[0].update_cluster(joined.cluster_spec)
            sessions = [clusterwire.Session(s.target, timeout=10) for s in servers]
            for session in sessions:
                wait_for(lambda s=session: [p["last_seen"] > 0 for p in s.status()["peers"]
                                            if p["task"] == "/job:w/task:3"] == [True], 30,
                         "the joined task heard from")
        finally:
            joined.stop()
        stopped = time.monotonic()
        bound = detection_bound(4, CONFIG)
        for session in sessions:
            wait_for(lambda s=session: down_map(s)["/job:w/task:3"], bound, "w:3 down")
        assert time.monotonic() - stopped < bound
        for session in sessions:
            assert [t for t, down in down_map(session).items() if down] == ["/job:w/task:3"]


def test_a_stopped_task_leaves_and_is_marked_left_not_found_dead():
    """A task stopped with ``stop()`` sends SWIM's leave before it drains: the others hold
    it LEFT (a leave taken), not DEAD (a failure found by probes and suspicion), and show
    it down; the rest stay alive. A killed task sends nothing (the tests above)."""
    with in_process_job("w", 4, protocol="grpc", config=SWIM) as servers:
        sessions = [clusterwire.Session(s.target, timeout=10) for s in servers[:3]]
        wait_for(lambda: all(p["last_seen"] > 0 for s in sessions
                             for p in s.status()["peers"]), 30, "every peer heard")
        servers[3].stop()
        for server in servers[:3]:
            # LEFT is final; a probe that met w:3 just after its leave may suspect it first.
            wait_for(lambda s=server: s._service._swim.states()[("w", 3)] == swim.State.LEFT,
                     30, "w:3 left (not suspected or dead)")
            states = server._service._swim.states()
            del states[("w", 3)]
            # A passing suspicion of a live task, refuted, is SWIM at work on a busy machine.
            assert not {swim.State.DEAD, swim.State.LEFT} & set(states.values())
        for session in sessions:
            assert [t for t, down in down_map(session).items() if down] == ["/job:w/task:3"]


def test_a_false_suspicion_is_refuted_on_a_cluster_started_on_port_0():
    """A suspicion of a live task (sent by a token holder as another task's news) is refuted
    by the suspect with a higher incarnation before any task holds it dead: the members
    follow the ports bound after the port-0 start, so the refutation's address is the one
    they know."""
    with in_process_job("w", 3, protocol="grpc", config=SWIM) as servers:
        sessions = [clusterwire.Session(s.target, timeout=10) for s in servers]
        wait_for(lambda: all(p["last_seen"] > 0 for s in sessions
                             for p in s.status()["peers"]), 30, "every peer heard")
        rumour = swim.Message(swim.Kind.PING, 1, "w:2", "w:0", (
            swim.Update("w:1", swim.State.SUSPECT, 0, origin="w:2"),))
        raw(servers[0].target.split("://")[1], swim_request(rumour.to_bytes(), ("w", 2)))
        _, slowest = CONFIG.suspicion_bounds(3)
        end = time.monotonic() + slowest + CONFIG.retransmits(3) * INTERVAL
        while time.monotonic() < end:
            assert not any(down for s in sessions for down in down_map(s).values())
        for server in servers[::2]:
            state, incarnation = server._service._swim._swim.members()["w:1"]
            assert (state, incarnation >= 1) == (swim.State.ALIVE, True)


def test_the_default_path_has_no_swim_and_refuses_swim_requests():
    with in_process_job("w", 2, protocol="grpc") as servers:
        address = servers[0].target.split("://")[1]
        ping = swim.Message(swim.Kind.PING, 1, "w:1", "w:0")
        with pytest.raises(errors.FailedPreconditionError, match='membership_protocol="swim"'):
            raw(address, swim_request(ping.to_bytes(), ("w", 1)))
        assert clusterwire.Session(servers[0].target).status()["peers"] == []


def test_membership_protocol_settings_are_checked():
    with pytest.raises(errors.InvalidArgumentError, match="'gossip' is not one of"):
        clusterwire.Server({"w": ["127.0.0.1:0"]}, config={"membership_protocol": "gossip"},
                           start=False)
    with pytest.raises(errors.InvalidArgumentError, match="membership_timeout_seconds=2.0"):
        clusterwire.Server({"w": ["127.0.0.1:0"]}, config={
            "membership_protocol": "swim", "membership_timeout_seconds": 2.0}, start=False)
