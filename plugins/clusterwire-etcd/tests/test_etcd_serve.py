"""``clusterwire serve --resolver etcd --watch S`` against a real etcd: each task registers its
key once it serves (READY comes after), follows the others' joins and leaves through etcd's
watch, and withdraws its key when it stops; a task whose key another holds is refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from clusterwire_etcd import EtcdClusterResolver
from etcd_test_support import etcd_fixture  # noqa: F401 (the "etcd" fixture)
from test_etcd_resolver import HEARTBEAT, tasks, until

import clusterwire
from clusterwire.local_cluster import await_ready

pytestmark = pytest.mark.timeout(90)
TTL = 3


def serve(etcd: str, cluster: str, index: int, *extra: str,
          address: str = "127.0.0.1:0") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "clusterwire", "serve", "--resolver", "etcd",
         "--resolver-arg", f"endpoint={etcd}", "--resolver-arg", f"cluster={cluster}",
         "--resolver-arg", "task_type=worker", "--resolver-arg", f"task_id={index}",
         "--resolver-arg", f"address={address}", "--resolver-arg", f"ttl={TTL}",
         "--config", json.dumps(HEARTBEAT), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(process: subprocess.Popen, signum: int = signal.SIGTERM) -> str:
    """Its stderr, the process stopped with ``signum`` (killed if it has not ended 30 s
    later)."""
    if process.poll() is None:
        process.send_signal(signum)
    try:
        return process.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate(timeout=30)[1]


def view(target: str) -> dict:
    """The cluster as the task at ``target`` holds it."""
    with clusterwire.Session(target, timeout=10) as session:
        return session.status()["cluster"].as_dict()


def test_served_tasks_register_follow_each_other_and_withdraw_on_stop(etcd):
    resolver = EtcdClusterResolver(etcd, "served")
    first = serve(etcd, "served", 0, "--watch", "5")
    second = None
    try:
        target = await_ready(first, 60)
        assert target, stop(first)
        address = target.split("://")[1]
        assert tasks(resolver) == {"worker": [address]}  # registered before READY
        second = serve(etcd, "served", 1, "--watch", "5")
        other = await_ready(second, 60)
        assert other, stop(second)
        both = {"worker": [address, other.split("://")[1]]}
        assert tasks(resolver) == both
        # Far under the 5 s poll: etcd's watch woke the first task's watch.
        joined = until(lambda: view(target) == both, 4, "the first task to see the join")
        assert "stopped" in stop(second)
        assert second.returncode == 0
        # Withdrawn on stop, not left to expire with the 3 s lease.
        assert tasks(resolver) == {"worker": [address]}
        left = until(lambda: view(target) == {"worker": [address]}, 4,
                     "the first task to see the leave")
        print(f"join seen after {joined:.2f} s, leave after {left:.2f} s")
    finally:
        for process in (first, second):
            if process is not None:
                stop(process)
        resolver.close()
    assert tasks(EtcdClusterResolver(etcd, "served")) == {}


def test_a_task_of_another_host_whose_key_is_held_is_refused_and_stops(etcd):
    first = serve(etcd, "held", 0)
    try:
        assert await_ready(first, 60), stop(first)
        started = time.monotonic()
        twin = serve(etcd, "held", 0, address="127.0.0.2:0")  # another host, the same task
        assert twin.wait(60) != 0
        err = stop(twin)
        assert "AlreadyExistsError" in err and "/clusterwire/held/worker/0" in err, err
        assert "Traceback" not in err
        # It waited the TTL out (a dead task's key would have expired), then gave up.
        assert TTL <= time.monotonic() - started < 60
    finally:
        stop(first)


def test_a_task_restarted_after_sigkill_takes_its_address_and_key_again(etcd):
    resolver = EtcdClusterResolver(etcd, "restarted")
    first = serve(etcd, "restarted", 0)
    again = None
    try:
        target = await_ready(first, 60)
        assert target, stop(first)
        stop(first, signal.SIGKILL)  # its key stays until the lease expires
        started = time.monotonic()
        again = serve(etcd, "restarted", 0)
        assert await_ready(again, 60) == target, stop(again)
        waited = time.monotonic() - started
        assert tasks(resolver) == {"worker": [target.split("://")[1]]}
        print(f"restarted task registered after {waited:.2f} s (TTL {TTL} s)")
    finally:
        if again is not None:
            stop(again)
        resolver.close()


def test_watch_without_a_resolver_is_refused():
    done = subprocess.run(
        [sys.executable, "-m", "clusterwire", "serve", "--cluster",
         '{"worker": ["127.0.0.1:0"]}', "--job-name", "worker", "--task-index", "0",
         "--watch", "5"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--watch follows --resolver" in done.stderr
