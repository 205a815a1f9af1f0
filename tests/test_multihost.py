"""Clusters across emulated hosts (issue 20): every task, worker and client in a network
namespace of its own, talking over veths and a bridge (``clusterwire.testing.hosts``)."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter

import numpy as np
import pytest
from conftest import child_env, wait_for
from emulated_hosts import requires_netns

from clusterwire import errors
from clusterwire.testing.certs import Authority
from clusterwire.testing.hosts import PREFIX, EmulatedHosts, Host, Interpreter, Served, remove_stale

pytestmark = [requires_netns, pytest.mark.timeout(60)]

PORT = 2222
BIG = np.random.default_rng(20).standard_normal(2 << 20).astype(np.float32)  # 8 MiB
SMALL = np.arange(12, dtype=np.int64).reshape(3, 4)
#: Each emulated host has only its veth: UCX uses TCP over it. Shared memory (which UCX would
#: pick between namespaces of one kernel, as it shares /dev/shm) is what other hosts lack.
VERBS_ENV = {"UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp,self"}


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.strip()}


def namespaces_of(hosts: EmulatedHosts) -> set[str]:
    return {name for name in namespaces() if name.startswith(hosts.prefix + "-")}


def root_links() -> list[str]:
    listing = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return sorted(line.split(":")[1].strip() for line in listing.stdout.splitlines())


def test_the_test_bed_links_cuts_partitions_heals_and_leaves_nothing():
    finished = subprocess.Popen(["true"])
    finished.wait()
    stale = f"{PREFIX}{finished.pid}-0-sw"  # as a crashed run with that pid would leave
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in remove_stale() and stale not in namespaces()
    links = root_links()
    with EmulatedHosts(3) as hosts:
        addresses = [host.address for host in hosts.hosts]
        for host in hosts.hosts:
            shown = host.run(["ip", "-4", "-br", "addr", "show", "dev", "eth0"])
            assert shown.stdout.split()[1:] == ["UP", f"{host.address}/24"], shown
        probes = [host.interpreter() for host in hosts.hosts]
        for probe in probes:  # a refused connection is an answer: the host is reachable
            probe.exec("import socket\n"
                       "def reaches(address):\n"
                       "    try:\n"
                       "        socket.create_connection((address, 9), timeout=0.3).close()\n"
                       "    except ConnectionRefusedError:\n"
                       "        return True\n"
                       "    except OSError:\n"
                       "        return False\n"
                       "    return True")

        def links_up() -> list[list[bool]]:
            return [probe.eval(f"[reaches(a) for a in {addresses!r}]") for probe in probes]

        everyone = [[True] * 3] * 3
        assert links_up() == everyone
        assert namespaces_of(hosts) == {hosts.switch, *(host.name for host in hosts.hosts)}
        hosts.cut(1)
        assert links_up() == [[True, False, True], [False, True, False], [True, False, True]]
        hosts.heal(1)
        wait_for(lambda: links_up() == everyone, what="host 1 back")
        hosts.partition({0, 1}, {2})
        assert links_up() == [[True, True, False], [True, True, False], [False, False, True]]
        hosts.heal()
        wait_for(lambda: links_up() == everyone, what="the partition healed")
        processes = list(hosts.processes)
    assert all(process.poll() is not None for process in processes)
    assert namespaces_of(hosts) == set()
    assert root_links() == links

    # A test failing inside the block leaves nothing behind either.
    with pytest.raises(RuntimeError, match="a test failing"):
        with EmulatedHosts(1) as hosts:
            sleeper = hosts[0].popen(["sleep", "60"])
            raise RuntimeError("a test failing")
    assert sleeper.wait(5) == -9
    assert namespaces_of(hosts) == set()


def start_cluster(hosts: EmulatedHosts, placement: dict[str, int], protocol: str = "grpc",
                  env: dict[str, str] | None = None,
                  config: dict[str, object] | None = None) -> dict[str, Served]:
    """One task per job, each serving ``protocol`` on its host's address and ``PORT`` (with
    ServerOptions ``config``); the servers by job, once all serve."""
    cluster = json.dumps({job: [f"{hosts[i].address}:{PORT}"] for job, i in placement.items()})
    options = ["--config", json.dumps(config)] if config else []
    servers = {job: hosts[i].serve("serve", "--cluster", cluster, "--job-name", job,
                                   "--task-index", "0", "--protocol", protocol,
                                   "--import", "cw_test_functions", *options,
                                   env={**child_env(), **(env or {})})
               for job, i in placement.items()}
    for server in servers.values():
        server.wait_ready()
    return servers


@pytest.mark.parametrize("protocol", ["grpc", "grpc+verbs", "zmq"])
def test_tensors_move_between_tasks_on_different_hosts(protocol):
    env = {**VERBS_ENV, "UCX_PROTO_INFO": "y"} if protocol == "grpc+verbs" else {}
    with EmulatedHosts(3) as hosts:
        servers = start_cluster(hosts, {"a": 0, "b": 1}, protocol, env)
        client = hosts[2].interpreter({**child_env(), **env})
        client.exec(f"import numpy as np, clusterwire, cw_test_functions\n"
                    f"sess = clusterwire.Session({servers['a'].target!r}, timeout=15)\n"
                    f"big = np.random.default_rng(20).standard_normal(2 << 20)"
                    f".astype(np.float32)\n"
                    f"small = np.arange(12, dtype=np.int64).reshape(3, 4)")
        # Stored on a (the target), on b through a, and read back both ways.
        client.exec("sess.put('small', small); sess.put('big', big)\n"
                    "sess.put('small', small * 2, task='/job:b/task:0')\n"
                    "sess.put('big', big * 2, task='/job:b/task:0')")
        assert np.array_equal(client.eval("sess.get('small')"), SMALL)
        assert np.array_equal(client.eval("sess.get('big')"), BIG)
        got = client.eval("sess.get('big', task='/job:b/task:0')")
        assert got.dtype == np.float32 and np.array_equal(got, BIG * 2)
        assert np.array_equal(client.eval("sess.get('small', task='/job:b/task:0')"),
                              SMALL * 2)
        # b runs the function on what a stored; a runs it on b's.
        client.exec(f"sess_b = clusterwire.Session({servers['b'].target!r}, timeout=15)")
        assert np.array_equal(client.eval(
            "sess_b.call(cw_test_functions.scaled, sess_b.get('big', task='/job:a/task:0'), "
            "3.0)"), BIG * 3)
        assert np.array_equal(client.eval(
            "sess.call(cw_test_functions.scaled, small, 5, task='/job:b/task:0')"), SMALL * 5)
        pids = client.eval("(sess.call(cw_test_functions.where_am_i), "
                           "sess.call(cw_test_functions.where_am_i, task='/job:b/task:0'))")
        assert pids == (servers["a"].process.pid, servers["b"].process.pid)
        if protocol == "grpc+verbs":
            rendezvous = [line for line in client.output().splitlines() if "rendezvous" in line]
            assert rendezvous and all("tcp/eth0" in line for line in rendezvous), rendezvous


def test_grpc_local_between_hosts_fails_at_once_naming_the_reason(tmp_path):
    """grpc+local passes shared memory over Unix sockets, which do not cross hosts: a request
    to a task of another host, sent there or forwarded by a task, is refused at once with the
    reason (never a wait for the deadline, a hang or wrong data)."""
    with EmulatedHosts(2) as hosts:
        servers = start_cluster(hosts, {"a": 0, "b": 1}, "grpc+local")
        b_address = servers["b"].address
        client = hosts[0].interpreter(child_env())
        client.exec(f"import numpy as np, clusterwire\n"
                    f"sess = clusterwire.Session({servers['a'].target!r}, timeout=10)\n"
                    f"big = np.random.default_rng(20).standard_normal(2 << 20)"
                    f".astype(np.float32)\n"
                    f"sess.put('big', big)")
        assert np.array_equal(client.eval("sess.get('big')"), BIG)  # same host: works
        for request in [f"clusterwire.Session({servers['b'].target!r}).get('big', timeout=10)",
                        "sess.get('big', task='/job:b/task:0')",
                        "sess.put('big', big, task='/job:b/task:0')"]:
            started = time.monotonic()
            with pytest.raises(errors.FailedPreconditionError) as raised:
                client.eval(request)
            assert time.monotonic() - started < 2, request
            assert (f"grpc+local connects only tasks of the same host, and 192.0.2.11 (of "
                    f"{b_address}) is not an address of this host") in raised.value.message
        # Nothing reached b: a client of its own host finds its store empty.
        local = hosts[1].interpreter(child_env())
        assert local.eval(f"__import__('clusterwire').Session({servers['b'].target!r})"
                          f".list()") == []
        # Under TLS a client sends its segments over a Unix connection beside the gRPC call:
        # refused the same way, before any handshake.
        authority = Authority(tmp_path)
        pair = authority.issue("server")
        tls = hosts[1].serve(
            "serve", "--cluster", json.dumps({"t": [f"{hosts[1].address}:{PORT + 1}"]}),
            "--job-name", "t", "--task-index", "0", "--protocol", "grpc+local", "--config",
            json.dumps({"tls_cert_file": str(pair.cert), "tls_key_file": str(pair.key)}),
            env=child_env()).wait_ready()
        started = time.monotonic()
        with pytest.raises(errors.FailedPreconditionError,
                           match=rf"192\.0\.2\.11 \(of {tls.address}\) is not an address"):
            client.eval(f"clusterwire.Session({tls.target!r}, config={{'tls_ca_file': "
                        f"{str(authority.pair.cert)!r}}}).get('x', timeout=10)")
        assert time.monotonic() - started < 2


def data_service(hosts: EmulatedHosts, dispatcher_host: int, worker_hosts: list[int],
                 *dispatcher_args: str, worker_env: dict[str, str] | None = None) -> str:
    """A dispatcher on one host and a worker on each of ``worker_hosts``, all serving; the
    dispatcher's target."""
    address = f"{hosts[dispatcher_host].address}:{PORT}"
    dispatcher = hosts[dispatcher_host].serve(
        "dispatcher", "--bind-address", hosts[dispatcher_host].address, "--port", str(PORT),
        *dispatcher_args, env=child_env()).wait_ready()
    workers = [hosts[i].serve("worker", "--dispatcher-address", address, "--worker-address",
                              f"{hosts[i].address}:%port%", "--heartbeat-interval-ms", "100",
                              "--import", "cw_data_functions",
                              env={**child_env(), **(worker_env or {})})
               for i in worker_hosts]
    for worker in workers:
        worker.wait_ready()
    return dispatcher.target


def consumer(host: Host, target: str, workers: int) -> Interpreter:
    """An interpreter in ``host`` with ``data``, ``fns`` (cw_data_functions), ``Counter``,
    ``elements_sent(address)`` (a worker's count) and ``workers()`` (the dispatcher's: address
    -> seconds since its last heartbeat), once the dispatcher lists ``workers``."""
    client = host.interpreter(child_env())
    client.exec(f"from collections import Counter\n"
                f"import cw_data_functions as fns\n"
                f"from clusterwire import data\n"
                f"target = {target!r}\n"
                f"def elements_sent(address):\n"
                f"    return sum(m.value for m in data.service_status(address).metrics\n"
                f"               if m.name == 'clusterwire_data_elements_total')\n"
                f"def workers():\n"
                f"    return {{w.address: w.heartbeat_age_seconds\n"
                f"            for w in data.service_status(target).workers}}")
    wait_for(lambda: len(client.eval("workers()")) == workers, what=f"{workers} workers")
    return client


def test_data_service_with_workers_on_three_hosts_reads_every_element_once():
    count = 3000
    with EmulatedHosts(5) as hosts:
        target = data_service(hosts, 0, [1, 2, 3], worker_env={"CW_DATA_SLOW_S": "0.0005"})
        client = consumer(hosts[4], target, 3)
        workers = sorted(client.eval("workers()"))
        assert [w.rsplit(":", 1)[0] for w in workers] == [h.address for h in hosts.hosts[1:4]]
        # A named job outlives its read: the workers keep counting what they sent for it.
        seen = client.eval(f"Counter(int(x) for x in data.Dataset.range({count})"
                           f".map(fns.slow_identity).apply(data.distribute("
                           f"'distributed_epoch', target, job_name='three-hosts')))")
        assert seen == Counter(range(count))
        sent = [client.eval(f"elements_sent({w!r})") for w in workers]
        assert sum(sent) == count and all(sent), sent  # each host served, none twice


def test_data_service_job_survives_losing_a_worker_host_mid_job():
    """A worker's host is cut off mid-job (alive, but unreachable): the dispatcher drops it
    after worker_timeout_ms, the consumer ends its reads of it then (not at their 15 s
    timeout) and moves its splits to the other workers, and the job ends with every element
    exactly once."""
    count = 3000
    with EmulatedHosts(5) as hosts:
        target = data_service(hosts, 0, [1, 2, 3], "--worker-timeout-ms", "500",
                              worker_env={"CW_DATA_SLOW_S": "0.002"})
        client = consumer(hosts[4], target, 3)
        victim = min(client.eval("workers()"))
        assert victim.startswith(hosts[1].address + ":")
        client.exec(f"it = iter(data.Dataset.range({count}).map(fns.slow_identity).apply("
                    f"data.distribute('distributed_epoch', target)))\n"
                    f"seen = Counter(int(next(it)) for _ in range(300))")
        assert client.eval(f"elements_sent({victim!r})") > 0  # it was serving the job
        hosts.cut(1)
        cut_at = time.monotonic()
        client.exec("seen.update(int(x) for x in it)", timeout=40)
        assert client.eval("seen") == Counter(range(count))
        since_cut = time.monotonic() - cut_at
        assert since_cut < 10  # the reads in flight to the victim would wait 15 s
        ages = client.eval("workers()")  # the dispatcher has not heard from the victim since
        assert ages.pop(victim) > since_cut and max(ages.values()) < 0.5, ages


def session_client(host: Host, servers: dict[str, Served]) -> Interpreter:
    """An interpreter in ``host`` with ``np``, ``clusterwire`` and a session ``to[job]`` to
    each task (timeout 10 s)."""
    client = host.interpreter(child_env())
    client.exec(f"import numpy as np, clusterwire\n"
                f"to = {{job: clusterwire.Session(target, timeout=10) for job, target in "
                f"{ {job: s.target for job, s in servers.items()} !r}.items()}}")
    return client


def fails_in_time(client: Interpreter, request: str, timeout: float) -> str:
    """The message of the UnavailableError or DeadlineExceededError ``request`` (run with
    ``timeout=``) raises, within that time (and a margin to notice)."""
    started = time.monotonic()
    with pytest.raises((errors.UnavailableError, errors.DeadlineExceededError)) as raised:
        client.eval(f"{request[:-1]}, timeout={timeout})")
    assert time.monotonic() - started < timeout + 1.5, request
    return raised.value.message


def reachable(client: Interpreter, request: str) -> bool:
    try:
        client.eval(f"{request[:-1]}, timeout=1)")
    except (errors.UnavailableError, errors.DeadlineExceededError):
        return False
    return True


def test_a_lost_host_fails_requests_to_it_in_time_and_is_reached_again_once_healed():
    with EmulatedHosts(4) as hosts:
        # The tasks give up on a peer after 2 s: a request they forward fails within the
        # client's time, naming the peer.
        servers = start_cluster(hosts, {"ps": 0, "lost": 1, "kept": 2},
                                config={"peer_timeout_seconds": 2})
        lost = servers["lost"].address
        client = session_client(hosts[3], servers)
        for value, job in enumerate(servers):
            client.exec(f"to['ps'].put('v', np.full(4, {value}), task='/job:{job}/task:0')")
        assert client.eval("to['lost'].get('v')").tolist() == [1] * 4

        hosts.cut(1)
        # The session with a connection to it, a new one, and one through another task.
        for request, timeout in [("to['lost'].get('v')", 2),
                                 (f"clusterwire.Session({servers['lost'].target!r}).get('v')", 2),
                                 ("to['ps'].get('v', task='/job:lost/task:0')", 3)]:
            assert lost in fails_in_time(client, request, timeout), request
        # The task that forwarded says it could not reach the lost one.
        assert [(p["task"], p["address"]) for p in
                client.eval("to['ps'].status()")["unreachable_peers"]] == [
            ("/job:lost/task:0", lost)]
        # The other hosts still reach each other, directly and forwarded.
        assert client.eval("to['ps'].get('v')").tolist() == [0] * 4
        assert client.eval("to['ps'].get('v', task='/job:kept/task:0')").tolist() == [2] * 4
        assert client.eval("to['kept'].get('v', task='/job:ps/task:0')").tolist() == [0] * 4

        hosts.heal(1)
        for request in ["to['lost'].get('v')", "to['ps'].get('v', task='/job:lost/task:0')"]:
            wait_for(lambda r=request: reachable(client, r), timeout=15, what=request)
            assert client.eval(request).tolist() == [1] * 4


def test_a_partition_splits_the_cluster_both_ways_and_heals():
    with EmulatedHosts(3) as hosts:
        servers = start_cluster(hosts, {"a": 0, "b": 1, "c": 2},
                                config={"peer_timeout_seconds": 2})
        near, far = session_client(hosts[0], servers), session_client(hosts[2], servers)
        for value, job in enumerate(servers):
            near.exec(f"to['a'].put('v', np.full(4, {value}), task='/job:{job}/task:0')")

        hosts.partition({0, 1}, {2})
        # Each side works within itself, and fails across, in time, naming the other side.
        assert near.eval("to['a'].get('v', task='/job:b/task:0')").tolist() == [1] * 4
        assert far.eval("to['c'].get('v')").tolist() == [2] * 4
        assert servers["c"].address in fails_in_time(
            near, "to['a'].get('v', task='/job:c/task:0')", 3)
        assert servers["a"].address in fails_in_time(
            far, "to['c'].get('v', task='/job:a/task:0')", 3)

        hosts.heal()
        for client, request, value in [(near, "to['a'].get('v', task='/job:c/task:0')", 2),
                                       (far, "to['c'].get('v', task='/job:a/task:0')", 0),
                                       (far, "to['b'].get('v')", 1)]:
            wait_for(lambda c=client, r=request: reachable(c, r), timeout=15, what=request)
            assert client.eval(request).tolist() == [value] * 4


def test_membership_splits_with_a_partition_and_converges_once_it_heals():
    heartbeat = {"membership_heartbeat_seconds": 0.3, "membership_timeout_seconds": 1.0,
                 "peer_timeout_seconds": 0.5, "allow_membership_changes": True}
    with EmulatedHosts(4) as hosts:
        cluster = {"w": [f"{hosts[i].address}:{PORT}" for i in range(3)]}
        tasks = [hosts[i].serve("serve", "--cluster", json.dumps(cluster), "--job-name", "w",
                                "--task-index", str(i), "--config", json.dumps(heartbeat),
                                env=child_env()) for i in range(3)]
        for task in tasks:
            task.wait_ready()
        client = hosts[3].interpreter(child_env())
        client.exec(f"import clusterwire\n"
                    f"to = [clusterwire.Session(t, timeout=5) for t in "
                    f"{[task.target for task in tasks]!r}]\n"
                    f"def view(i):\n"
                    f"    s = to[i].status()\n"
                    f"    return (s['membership_version'], s['cluster'].as_dict(),\n"
                    f"            sorted(p['task'] for p in s['peers'] if p['down']))")

        def views(tasks=(0, 1, 2)) -> list:
            return [client.eval(f"view({i})") for i in tasks]

        wait_for(lambda: all(not down for _, _, down in views()), what="every peer heard")
        hosts.partition({0, 1, 3}, {2})
        grown = {**cluster, "spare": [f"{hosts[1].address}:{PORT + 1}"]}
        # A task joins once it serves (it answers as itself).
        hosts[1].serve("serve", "--cluster", json.dumps(grown), "--job-name", "spare",
                       "--task-index", "0", "--config", json.dumps(heartbeat),
                       env=child_env()).wait_ready()
        assert client.eval(f"to[0].update_cluster({grown!r})") == 1
        # One side takes the change and marks the other side down; the other side is cut off.
        wait_for(lambda: [v[0] for v in views((0, 1))] == [1, 1],
                 what="version 1 on tasks 0, 1")
        wait_for(lambda: all("/job:w/task:2" in v[2] for v in views((0, 1))),
                 what="task 2 down on the other side")
        # Its connections stay open across the cut: heartbeats that get no answer say so
        # (a live peer's heartbeat late on a loaded machine is named until its next answer).
        wait_for(lambda: client.eval(
            "[p['task'] for p in to[0].status()['unreachable_peers']]") == ["/job:w/task:2"],
            what="task 2, and only task 2, unreachable from task 0")
        assert client.eval("view(0)")[1] == grown
        hosts.heal()
        wait_for(lambda: client.eval("view(2)")[0] == 1, timeout=15,
                 what="task 2 at version 1 once healed")
        healed = views()
        assert all(version == 1 and spec == grown for version, spec, _ in healed)
        wait_for(lambda: all(not any(t.startswith("/job:w/") for t in v[2]) for v in views()),
                 what="no task of w down once healed")
