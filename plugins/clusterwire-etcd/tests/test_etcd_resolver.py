"""clusterwire-etcd against a real etcd: the resolver reads the spec, a task registered under
a lease appears and is kept alive, a SIGKILLed task's key expires within its TTL, the watch
and ``Server.from_resolver(..., watch=)`` follow a join and a leave, and malformed keys,
values and endpoints are refused with clear errors."""

from __future__ import annotations

import http.server
import json
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import etcd_test_support
import pytest
from clusterwire_etcd import EtcdClusterResolver, EtcdRegistration
from clusterwire_etcd.gateway import EtcdGateway, b64, prefix_end
from clusterwire_etcd.layout import MAX_TASKS
from etcd_test_support import etcd_fixture, free_ports  # noqa: F401 (the "etcd" fixture)

import clusterwire
from clusterwire import errors
from clusterwire.local_cluster import await_ready
from clusterwire.plugins import get_plugin_manager

pytestmark = pytest.mark.timeout(60)

HEARTBEAT = {"membership_heartbeat_seconds": 0.2, "membership_timeout_seconds": 0.6,
             "peer_timeout_seconds": 0.5, "allow_membership_changes": True}


def put(url: str, key: str, value: str | bytes) -> None:
    EtcdGateway(url).call("/v3/kv/put", {"key": b64(key), "value": b64(value)})


def until(condition, timeout: float, what: str) -> float:
    """Seconds until ``condition()`` holds (polled: etcd's state has no event here); fails
    after ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - started


def tasks(resolver: EtcdClusterResolver) -> dict:
    try:
        return resolver.cluster_spec().as_dict()
    except errors.NotFoundError:
        return {}


def test_the_resolver_reads_the_spec_under_its_prefix(etcd):
    put(etcd, "/clusterwire/read/worker/1", "127.0.0.1:2001")
    put(etcd, "/clusterwire/read/worker/0", "127.0.0.1:2000")
    put(etcd, "/clusterwire/read/ps/0", "localhost:3000")
    put(etcd, "/clusterwire/reader/worker/0", "127.0.0.1:9")  # another cluster: not read
    resolver = get_plugin_manager().resolver_spec("etcd").factory(
        etcd, "read", task_type="worker", task_id=1)
    assert resolver.cluster_spec().as_dict() == {
        "ps": ["localhost:3000"], "worker": ["127.0.0.1:2000", "127.0.0.1:2001"]}
    assert resolver.master() == "grpc://127.0.0.1:2001"
    assert resolver.master("ps", 0, rpc_layer="grpc+local") == "grpc+local://localhost:3000"
    put(etcd, "/clusterwire/read/worker/0", "127.0.0.1:2002")  # as it is now, every call
    assert resolver.cluster_spec().task_address("worker", 0) == "127.0.0.1:2002"


def test_a_registered_task_appears_under_a_lease_and_leaves_on_stop(etcd):
    resolver = EtcdClusterResolver(etcd, "lease")
    with clusterwire.Server({"worker": ["127.0.0.1:0"]}, job_name="worker",
                            task_index=0) as server:
        registration = EtcdRegistration.for_server(server, etcd, "lease", ttl=5)
        with registration:
            address = server.target.split("://")[1]
            assert resolver.cluster_spec().as_dict() == {"worker": [address]}
            alive = EtcdGateway(etcd).call("/v3/lease/timetolive", {"ID": str(registration.lease)})
            assert int(alive["grantedTTL"]) == 5 and 0 < int(alive["TTL"]) <= 5
            # A second task claiming the same index is refused, naming the key.
            with pytest.raises(errors.AlreadyExistsError, match="/clusterwire/lease/worker/0"):
                EtcdRegistration(etcd, "lease", "worker", 0, "127.0.0.1:1", ttl=5).start()
            assert resolver.cluster_spec().as_dict() == {"worker": [address]}
        # stop() revokes the lease: the key is gone at once, not after the TTL.
        assert tasks(resolver) == {}
        # A registration for a server ends when the server stops, within ttl/3.
        registration = EtcdRegistration.for_server(server, etcd, "lease", ttl=3).start()
        assert tasks(resolver) == {"worker": [address]}
    gone = until(lambda: tasks(resolver) == {}, 10, "the stopped server's key to go")
    assert gone < 3, f"key gone {gone:.1f} s after the server stopped (lease TTL 3 s)"
    assert registration.lease is None


TASK = textwrap.dedent("""
    import sys
    import clusterwire
    from clusterwire.ready_line import say_ready
    from clusterwire_etcd import EtcdRegistration
    server = clusterwire.Server({"worker": ["127.0.0.1:0"]}, job_name="worker", task_index=0)
    EtcdRegistration.for_server(server, sys.argv[1], "killed", ttl=2).start()
    say_ready(server.target)
    sys.stdin.read()
""")


def test_a_sigkilled_tasks_key_expires_within_its_ttl(etcd):
    resolver = EtcdClusterResolver(etcd, "killed")
    task = subprocess.Popen([sys.executable, "-c", TASK, etcd], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        target = await_ready(task, 30)
        assert target, "the task did not start"
        assert tasks(resolver) == {"worker": [target.split("://")[1]]}
        # Kept alive: the key outlives its 2 s TTL (checked throughout 3 s).
        kept = time.monotonic() + 3
        while time.monotonic() < kept:
            assert tasks(resolver) == {"worker": [target.split("://")[1]]}
            time.sleep(0.1)
        task.send_signal(signal.SIGKILL)
        task.wait(10)
        gone = until(lambda: tasks(resolver) == {}, 10, "the dead task's key to expire")
        assert gone <= 2 + 1.5, f"key expired {gone:.1f} s after the kill (TTL 2 s)"
        print(f"key expired {gone:.2f} s after the kill")
    finally:
        if task.poll() is None:
            task.kill()
        task.wait(10)
        task.stdin.close()
        task.stdout.close()


def test_the_watch_and_a_watching_server_follow_a_join_and_a_leave(etcd):
    watched = EtcdClusterResolver(etcd, "watch", task_type="worker", task_id=0,
                                  address="127.0.0.1:0")
    server = clusterwire.Server.from_resolver(watched, config=HEARTBEAT, watch=5.0)
    first = EtcdRegistration.for_server(server, etcd, "watch", ttl=5).start()
    other = clusterwire.Server({"worker": ["127.0.0.1:0", "127.0.0.1:0"]}, job_name="worker",
                               task_index=1, config=HEARTBEAT)
    try:
        until(lambda: server.membership_version == 0 and tasks(watched) == {
            "worker": [server.target.split("://")[1]]}, 10, "the first registration")
        version = server.membership_version
        with EtcdRegistration.for_server(other, etcd, "watch", ttl=5):
            # Far under the 5 s poll: etcd's watch woke the server's watch.
            joined = until(lambda: server.cluster_spec.num_tasks("worker") == 2, 4,
                           "the join to become a membership version")
            assert server.membership_version > version
            version = server.membership_version
            assert server.cluster_spec.task_address("worker", 1) == other.target.split("://")[1]
        left = until(lambda: server.cluster_spec.num_tasks("worker") == 1, 4,
                     "the leave to become a membership version")
        assert server.membership_version > version
        print(f"join seen after {joined:.2f} s, leave after {left:.2f} s")
        started = time.monotonic()
        server.stop()  # not held up by the watch waiting on etcd (nothing changes now)
        assert time.monotonic() - started < 2
    finally:
        first.stop()
        server.stop()
        other.stop()
        watched.close()


def test_wait_for_change_reports_a_join_and_a_leave(etcd):
    with EtcdClusterResolver(etcd, "events") as resolver:
        assert tasks(resolver) == {}
        assert resolver.wait_for_change(0.2) is False
        with EtcdRegistration(etcd, "events", "worker", 0, "127.0.0.1:4000", ttl=5):
            assert resolver.wait_for_change(10) is True
            assert tasks(resolver) == {"worker": ["127.0.0.1:4000"]}
        assert resolver.wait_for_change(10) is True
        assert tasks(resolver) == {}


def test_the_watch_reconnects_when_etcd_restarts(tmp_path):
    if etcd_test_support.ETCD is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    started = etcd_test_support.start(tmp_path / "data")
    assert started, "etcd did not start"
    process, url = started
    ports = (int(url.rsplit(":", 1)[1]), free_ports(1)[0])
    resolver = EtcdClusterResolver(url, "restart")
    try:
        assert resolver.wait_for_change(0.2) is False  # watching
        etcd_test_support.stop(process)
        assert resolver.wait_for_change(10) is True  # the stream ended: read afresh
        with pytest.raises(errors.UnavailableError, match=f"No etcd answers at {url}"):
            resolver.cluster_spec()
        started = etcd_test_support.start(tmp_path / "data", ports)
        assert started, "etcd did not restart on its client port"
        process = started[0]
        put(url, "/clusterwire/restart/worker/0", "127.0.0.1:4000")
        until(lambda: resolver.wait_for_change(0.5) and tasks(resolver) == {
            "worker": ["127.0.0.1:4000"]}, 15, "the watch to report the put after the restart")
    finally:
        resolver.close()
        etcd_test_support.stop(process)
        shutil.rmtree(tmp_path / "data", ignore_errors=True)


@pytest.mark.parametrize("key, value, match", [
    ("/clusterwire/bad/worker/0", "not an address", r"'/clusterwire/bad/worker/0'.*port"),
    ("/clusterwire/bad/worker/0", "127.0.0.1:0", "port 0"),
    ("/clusterwire/bad/worker/0", "evil host:1", "neither an IP address nor a DNS name"),
    ("/clusterwire/bad/worker/0", "h:1" + "0" * 300, "over 261 bytes"),
    ("/clusterwire/bad/worker/01", "127.0.0.1:1", r"'/clusterwire/bad/worker/01' at \S+ is not"),
    ("/clusterwire/bad/worker", "127.0.0.1:1", r"'/clusterwire/bad/worker' at \S+ is not"),
    ("/clusterwire/bad/9job/0", "127.0.0.1:1", "is not /clusterwire/bad/<job>/<index>"),
    ("/clusterwire/bad/worker/0", b"\xff:1", "must be UTF-8"),
])
def test_a_malformed_key_or_value_is_refused_naming_it(etcd, key, value, match):
    put(etcd, key, value)
    try:
        with pytest.raises(errors.InvalidArgumentError, match=match) as caught:
            EtcdClusterResolver(etcd, "bad").cluster_spec()
        assert "etcdctl put/del" in str(caught.value)
    finally:
        EtcdGateway(etcd).call("/v3/kv/deleterange", {"key": b64(key)})


def test_more_tasks_than_a_membership_holds_are_refused(etcd):
    gateway = EtcdGateway(etcd)
    for first in range(0, MAX_TASKS + 1, 128):  # etcd takes at most 128 operations a txn
        gateway.call("/v3/kv/txn", {"success": [
            {"request_put": {"key": b64(f"/clusterwire/many/worker/{i}"),
                             "value": b64("127.0.0.1:1")}}
            for i in range(first, min(first + 128, MAX_TASKS + 1))]})
    try:
        with pytest.raises(errors.ResourceExhaustedError,
                           match=f"More than {MAX_TASKS} keys under /clusterwire/many/"):
            EtcdClusterResolver(etcd, "many").cluster_spec()
    finally:
        key = b"/clusterwire/many/"
        gateway.call("/v3/kv/deleterange", {"key": b64(key), "range_end": b64(prefix_end(key))})


def test_the_cli_resolves_through_the_plugin(etcd):
    put(etcd, "/clusterwire/cli/worker/0", "127.0.0.1:2222")
    done = subprocess.run(
        [sys.executable, "-m", "clusterwire", "resolve", "--resolver", "etcd",
         "--resolver-arg", f"endpoint={etcd}", "--resolver-arg", "cluster=cli",
         "--resolver-arg", "task_type=worker", "--resolver-arg", "task_id=0"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["cluster"] == {"worker": ["127.0.0.1:2222"]}
    assert answer["master"] == "grpc://127.0.0.1:2222"


class NotEtcd(http.server.BaseHTTPRequestHandler):
    """An HTTP server that is not etcd: a 404 page, or a JSON answer of another shape."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = ((200, b'{"kvs": "not a list"}') if self.path == "/v3/kv/range"
                        else (404, b"<html>no such page</html>"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_an_http_server_that_is_not_etcd_is_named():
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotEtcd) as web:
        serving = threading.Thread(target=web.serve_forever, daemon=True)
        serving.start()
        url = f"http://127.0.0.1:{web.server_address[1]}"
        try:
            with pytest.raises(errors.InvalidArgumentError,
                               match=f"etcd at {url} answered a range without a list"):
                EtcdClusterResolver(url, "c").cluster_spec()
            with pytest.raises(errors.UnavailableError,
                               match=f"{url}/v3/lease/grant answered HTTP 404 .*not as etcd"):
                EtcdRegistration(url, "c", "worker", 0, "127.0.0.1:1").start()
        finally:
            web.shutdown()
        serving.join(10)


def test_no_etcd_an_empty_prefix_and_bad_arguments_are_clear_errors(etcd):
    nothing = f"http://127.0.0.1:{free_ports(1)[0]}"
    with pytest.raises(errors.UnavailableError, match=f"No etcd answers at {nothing}"):
        EtcdClusterResolver(nothing, "c").cluster_spec()
    with pytest.raises(errors.NotFoundError, match=r"No task is registered under "
                       r"/clusterwire/empty/ at http://127\.0\.0\.1:\d+\. Start the tasks"):
        EtcdClusterResolver(etcd, "empty").cluster_spec()
    with pytest.raises(errors.InvalidArgumentError, match="'https://x:2379' is not an etcd"):
        EtcdClusterResolver("https://x:2379", "c")
    with pytest.raises(errors.InvalidArgumentError, match="Cluster name 'a/b'"):
        EtcdClusterResolver(etcd, "a/b")
    with pytest.raises(errors.InvalidArgumentError, match="ttl must be a whole number"):
        EtcdRegistration(etcd, "c", "worker", 0, "127.0.0.1:1", ttl=0.5)
    with pytest.raises(errors.InvalidArgumentError, match="port 0"):
        EtcdRegistration(etcd, "c", "worker", 0, "127.0.0.1:0")
