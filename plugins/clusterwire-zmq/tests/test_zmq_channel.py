"""The zmq transport's own behaviour beyond the conformance kit.

Unreachable and foreign peers fail fast with the right error, buffers travel without
copies, limits are enforced before sending, listeners stop cleanly and restart on the
same port, and options are validated.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest
import zmq
from clusterwire_zmq.transport import ZmqTransport
from zmq_test_support import channel_to, free_port, payload, serving, zmq_transport

from clusterwire import Server, Session, errors
from clusterwire.testing.peer import echo_handler
from clusterwire.transport import ConnectionFailed, Frame, HandshakeFailed, ListenOptions

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


def test_a_refused_port_is_connection_failed_at_once():
    with channel_to(f"127.0.0.1:{free_port()}") as channel:
        started = time.monotonic()
        with pytest.raises(ConnectionFailed):
            channel.call(Frame(b"x", []), timeout=10)
        assert time.monotonic() - started < 2


def test_a_silent_tcp_peer_fails_within_the_callers_deadline():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts the connection in the kernel, never speaks ZMTP
        with channel_to(f"127.0.0.1:{silent.getsockname()[1]}") as channel:
            started = time.monotonic()
            with pytest.raises(ConnectionFailed):
                channel.call(Frame(b"x", []), timeout=0.5)
            assert 0.4 < time.monotonic() - started < 2


def test_a_peer_speaking_another_protocol_is_a_handshake_failure():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def answer_http() -> None:
            connection, _ = server.accept()
            with connection, contextlib.suppress(OSError):  # the client may reset first
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 4)
                connection.recv(1024)

        responder = threading.Thread(target=answer_http, daemon=True)
        responder.start()
        with channel_to(f"127.0.0.1:{server.getsockname()[1]}") as channel:
            started = time.monotonic()
            with pytest.raises(HandshakeFailed):
                channel.call(Frame(b"x", []), timeout=10)
            assert time.monotonic() - started < 5
        responder.join(5)


def test_the_size_limit_is_checked_before_anything_is_sent():
    calls: list[Frame] = []

    def handler(frame: Frame) -> Frame:
        calls.append(frame)
        return Frame(b"", [])

    with serving(handler, ListenOptions(max_message_bytes=MiB)) as listener, \
            channel_to(listener.address) as channel:
        with pytest.raises(errors.ResourceExhaustedError, match="max_message_bytes"):
            channel.call(Frame(b"big", [np.zeros(MiB + 1, np.uint8)]), timeout=10)
        assert calls == []
        channel.call(Frame(b"fits", [np.zeros(MiB, np.uint8)]), timeout=10)
        assert len(calls) == 1


def test_large_buffers_travel_without_copies():
    seen: list[object] = []

    def handler(frame: Frame) -> Frame:
        seen.extend(memoryview(b).obj for b in frame.buffers)
        return Frame(frame.header, list(frame.buffers))

    sent = payload(64 * MiB)
    with serving(handler) as listener, channel_to(listener.address) as channel:
        channel.call(Frame(b"warm", [b"x"]), timeout=30)
        seen.clear()
        tracemalloc.start()
        try:
            reply = channel.call(Frame(b"big", [sent, b"small"]), timeout=60)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    # No Python-level copy of the 64 MiB on either side: libzmq's own buffers carry it.
    assert peak < 4 * MiB, f"Python allocated {peak} bytes during a 64 MiB echo"
    assert isinstance(seen[0], zmq.Frame)  # the handler got the received zmq frame itself
    assert isinstance(memoryview(reply.buffers[0]).obj, zmq.Frame)
    assert np.array_equal(np.frombuffer(reply.buffers[0], np.uint8), sent)
    assert bytes(reply.buffers[1]) == b"small"


@pytest.mark.parametrize("inline_bytes", [0, 1 << 24])
def test_every_inline_threshold_carries_every_shape(inline_bytes):
    transport = ZmqTransport({"inline_bytes": inline_bytes})
    buffers = [b"", payload(10), payload(70_000, 1), np.arange(12.0).reshape(3, 4)]
    with serving(transport=transport) as listener, \
            channel_to(listener.address, transport=transport) as channel:
        reply = channel.call(Frame(b"shapes", buffers), timeout=30)
    for received, expected in zip(reply.buffers, buffers, strict=True):
        assert bytes(received) == memoryview(expected).cast("B").tobytes()


@pytest.mark.parametrize("options,match", [
    ({"chunk_bytes": 1}, "Unknown option"),
    ({"inline_bytes": -1}, "inline_bytes"),
    ({"inline_bytes": True}, "inline_bytes"),
    ({"heartbeat_seconds": 0}, "heartbeat_seconds"),
])
def test_bad_options_are_invalid_argument(options, match):
    with pytest.raises(errors.InvalidArgumentError, match=match):
        ZmqTransport(options)


def test_a_channel_recovers_when_its_listener_restarts_on_the_same_port():
    channel = None
    try:
        with serving() as first:
            address = first.address
            channel = zmq_transport().connect(address)
            channel.call(Frame(b"one", [b"1"]), timeout=10)
        # The listener is gone: the channel's pooled connection is dead, the port closed.
        with pytest.raises(errors.UnavailableError):
            channel.call(Frame(b"none", []), timeout=5)
        with serving(address=address):
            assert bytes(channel.call(Frame(b"two", [b"2"]), timeout=10).header) == b"two"
    finally:
        if channel is not None:
            channel.close()


def test_stop_lets_calls_finish_within_the_grace_period():
    entered = threading.Event()

    def handler(frame: Frame) -> Frame:
        entered.set()
        time.sleep(0.3)  # the call's own work, which the grace period must cover
        return frame

    results: list[Frame] = []
    with serving(handler) as listener, channel_to(listener.address) as channel:
        caller = threading.Thread(target=lambda: results.append(
            channel.call(Frame(b"slow", []), timeout=10)))
        caller.start()
        assert entered.wait(10)
        listener.stop(5)
        caller.join(10)
    assert results and bytes(results[0].header) == b"slow"


def test_max_concurrent_calls_is_resource_exhausted():
    gate = threading.Event()

    def handler(frame: Frame) -> Frame:
        gate.wait(10)
        return frame

    outcomes: list[str] = []
    options = ListenOptions(max_workers=8, max_concurrent_calls=2)
    with serving(handler, options) as listener, channel_to(listener.address) as channel:
        def call() -> None:
            try:
                channel.call(Frame(b"x", []), timeout=20)
                outcomes.append("done")
            except errors.ResourceExhaustedError:
                outcomes.append("exhausted")
                if outcomes.count("exhausted") == 4:
                    gate.set()

        threads = [threading.Thread(target=call) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        gate.set()
    assert sorted(outcomes) == ["done"] * 2 + ["exhausted"] * 4


def test_max_workers_bounds_concurrent_handlers():
    running, peak, lock = [0], [0], threading.Lock()

    def handler(frame: Frame) -> Frame:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)  # the work being measured
        with lock:
            running[0] -= 1
        return frame

    with serving(handler, ListenOptions(max_workers=3)) as listener, \
            channel_to(listener.address) as channel:
        threads = [threading.Thread(target=channel.call, args=(Frame(b"x", []), 20))
                   for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert 2 <= peak[0] <= 3


def test_a_blocked_handler_never_hides_requests_on_other_connections():
    """Like a barrier: one call's handler waits for another client's call to arrive.

    libzmq re-signals a connection's messages only after a read found it empty, so a
    listener that stopped reading after a successful read could leave the second call
    unseen while the first blocks.
    """
    arrived = threading.Event()

    def handler(frame: Frame) -> Frame:
        if frame.header == b"wait":
            assert arrived.wait(10), "the other client's call never reached a handler"
        else:
            arrived.set()
        return frame

    with serving(handler) as listener, channel_to(listener.address) as first, \
            channel_to(listener.address) as second:
        for _ in range(30):
            arrived.clear()
            waiter = threading.Thread(target=first.call, args=(Frame(b"wait", []), 20))
            waiter.start()
            second.call(Frame(b"go", []), timeout=20)
            waiter.join(20)
            assert not waiter.is_alive()


_CLIENT = """
import sys
from clusterwire.plugins import get_plugin_manager
from clusterwire.transport import Frame
channel = get_plugin_manager().transport("zmq").connect(sys.argv[1])
for index in range(int(sys.argv[2])):
    body = bytes([index % 256]) * 1024
    assert bytes(channel.call(Frame(b"c", [body]), timeout=20).buffers[0]) == body
channel.close()
print("DONE", flush=True)
"""


def test_many_client_processes_calling_at_once():
    """8 processes, one connection each, calling back to back: none may stall."""
    with serving() as listener:
        clients = [subprocess.Popen([sys.executable, "-c", _CLIENT, listener.address, "300"],
                                    stdout=subprocess.PIPE, text=True) for _ in range(8)]
        try:
            outputs = [client.communicate(timeout=50)[0] for client in clients]
        finally:
            for client in clients:
                if client.poll() is None:
                    client.kill()
                client.communicate(timeout=10)
    assert all(client.returncode == 0 for client in clients)
    assert outputs == ["DONE\n"] * 8


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_listeners_and_channels_release_threads_and_descriptors():
    def cycle() -> None:
        with serving() as listener, channel_to(listener.address) as channel:
            channel.call(Frame(b"x", [payload(100_000)]), timeout=10)
            workers = [t for t in threading.enumerate() if t.name.startswith("clusterwire-zmq")]
        for worker in workers:  # stop() has told them to exit
            worker.join(10)

    cycle()  # first use starts pyzmq's and the client context's own threads
    threads, fds = threading.active_count(), _open_fds()
    for _ in range(5):
        cycle()
    assert threading.active_count() <= threads
    assert _open_fds() <= fds + 2


@pytest.mark.parametrize("host", ["localhost", "::1"])
def test_host_names_and_ipv6(host):
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        listener = zmq_transport().listen(f"[{host}]:0" if ":" in host else f"{host}:0",
                                          echo_handler, ListenOptions())
    except errors.UnavailableError as err:
        pytest.skip(f"cannot bind {host}: {err}")
    listener.start()
    try:
        assert listener.address.rsplit(":", 1)[0].strip("[]") == host
        with channel_to(listener.address) as channel:
            assert bytes(channel.call(Frame(b"v6?", [b"1"]), timeout=10).header) == b"v6?"
    finally:
        listener.stop(0)


def test_two_zmq_servers_forward_to_each_other():
    cluster = {"a": ["127.0.0.1:0"], "b": ["127.0.0.1:0"]}
    with Server(cluster, job_name="a", protocol="zmq") as a, \
            Server(cluster, job_name="b", protocol="zmq") as b:
        spec = {"a": [a.target.split("://")[1]], "b": [b.target.split("://")[1]]}
        with Session(a.target, timeout=20) as session:
            for target in (a.target, b.target):
                with Session(target, timeout=20) as each:
                    each.complete_cluster(spec)
            session.put("v", payload(3 * MiB), task="/job:b/task:0")
            assert np.array_equal(session.get("v", task="/job:b/task:0"), payload(3 * MiB))
            assert session.status(task="/job:b/task:0")["job"] == "b"
