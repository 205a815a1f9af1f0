"""grpc+local calls over Unix SOCK_SEQPACKET call connections (issue 16, same-host small calls).

A channel in another process reaches a listener over its Unix socket. Most checks here run
the channel in this process instead: a channel of the transport itself always takes the
connections (only the core's ``clusterwire.in_process`` skips them), so they exercise the same
connections; ``listener.unix_calls`` counts the calls served over them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
from conftest import child_env

from clusterwire import errors
from clusterwire.plugins import get_plugin_manager
from clusterwire.security import Security, TlsConfig
from clusterwire.testing.peer import echo_handler
from clusterwire.thread_pool import WorkSlots, parked
from clusterwire.transport import ConnectionFailed, Frame, HandshakeFailed, ListenOptions
from clusterwire.transports.local import sealed, unix, wire

MiB = 1 << 20
TOKEN = b"s" * 32


@pytest.fixture
def transport():
    return get_plugin_manager().transport("grpc+local")


@pytest.fixture
def listen(transport) -> Iterator:
    """Start listeners (echo by default) that this process's channels reach over Unix."""
    started = []

    def start(handler=echo_handler, **options):
        listener = transport.listen("127.0.0.1:0", handler, ListenOptions(**options))
        listener.start()
        started.append(listener)
        return listener

    yield start
    for listener in started:
        listener.stop(0)


@pytest.fixture
def channels(transport) -> Iterator:
    opened = []

    def connect(address: str, security: Security | None = None):
        opened.append(transport.connect(address, security))
        return opened[-1]

    yield connect
    for channel in opened:
        channel.close()


def echo(channel, header: bytes, buffers, timeout: float = 30) -> Frame:
    reply = channel.call(Frame(header, buffers), timeout=timeout)
    assert bytes(reply.header) == header and len(reply.buffers) == len(buffers)
    for received, sent in zip(reply.buffers, buffers, strict=True):
        assert bytes(memoryview(received).cast("B")) == bytes(memoryview(sent).cast("B"))
    return reply


def hello(address: str, token: bytes = b"") -> socket.socket:
    """A raw call connection, admitted (READY)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(unix.socket_name(address))
    sock.send(wire.encode_unix(wire.CALLS, 1, 0, token))
    assert wire.decode_unix(sock.recv(4096))[0] == wire.READY
    return sock


CLIENT = """
import sys
import numpy as np
from clusterwire.plugins import get_plugin_manager
from clusterwire.transport import Frame
channel = get_plugin_manager().transport("grpc+local").connect(sys.argv[1])
small = channel.call(Frame(b"small", [b"8 bytes!"]), timeout=30)
assert bytes(small.header) == b"small" and bytes(small.buffers[0]) == b"8 bytes!", small
big = np.arange(1 << 20, dtype=np.uint32)  # 4 MiB: a sealed segment
reply = channel.call(Frame(b"bulk", [big, b"tail"]), timeout=30)
assert np.array_equal(np.frombuffer(reply.buffers[0], np.uint32), big)
assert bytes(reply.buffers[1]) == b"tail"
channel.close()
print("OK")
"""


def test_calls_from_another_process_travel_over_unix_with_small_and_bulk_buffers(transport):
    seen = []

    def handler(frame: Frame) -> Frame:
        seen.append([sealed.locate(b) is not None for b in frame.buffers])
        return echo_handler(frame)

    listener = transport.listen("127.0.0.1:0", handler, ListenOptions())
    listener.start()
    try:
        done = subprocess.run([sys.executable, "-c", CLIENT, listener.address],
                              capture_output=True, text=True, timeout=60, env=child_env())
        assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
        assert listener.unix_calls == 2
        assert seen == [[False], [True, False]]  # the 4 MiB buffer came as a sealed segment
    finally:
        listener.stop(0)
    assert "unix" in transport.info()["control"]


def test_calls_in_many_shapes(listen, channels):
    listener = listen()
    channel = channels(listener.address)
    echo(channel, b"", [])
    echo(channel, b"h" * 1000, [b"", np.empty(0, np.uint8), b"x"])
    echo(channel, b"mixed", [np.arange(10), np.ones(3 * MiB, np.uint8), b"t"])
    # More than a packet of small buffers: the control message travels in a segment.
    echo(channel, b"many", [bytes([i % 256]) * 3000 for i in range(600)])
    # More segments than one message carries descriptors (re-sent received segments).
    parts = []
    for i in range(300):
        fd, _ = sealed.create_packed([memoryview(np.full(64 << 10, i % 256, np.uint8))])
        parts.append(sealed.open_segment(fd)[:64 << 10])
    reply = echo(channel, b"segments", parts)
    assert all(sealed.locate(b) is not None for b in reply.buffers)
    assert listener.unix_calls == 5


def test_a_late_answer_is_a_deadline_and_the_channel_goes_on(listen, channels):
    release = threading.Event()

    def handler(frame: Frame) -> Frame:
        if frame.header == b"slow":
            release.wait(30)
        return echo_handler(frame)

    listener = listen(handler)
    channel = channels(listener.address)
    try:
        started = time.monotonic()
        with pytest.raises(errors.DeadlineExceededError):
            channel.call(Frame(b"slow", [b"x"]), timeout=0.3)
        assert time.monotonic() - started < 2
        for i in range(3):
            echo(channel, b"after-%d" % i, [b"8 bytes!"], timeout=5)
    finally:
        release.set()


class _HeldCall(NamedTuple):
    """A call from another thread that its listener's handler holds until ``release``."""

    listener: Any
    channel: Any
    caller: threading.Thread
    outcome: list[object]
    release: threading.Event


def _held_call(listen, channels, frame: Frame) -> _HeldCall:
    """Start a listener whose handler waits for ``release`` (at most 30 s), send ``frame``
    to it from a thread, and return once the handler holds it."""
    entered, release = threading.Event(), threading.Event()

    def handler(request: Frame) -> Frame:
        entered.set()
        release.wait(30)
        return echo_handler(request)

    listener = listen(handler)
    channel = channels(listener.address)
    outcome: list[object] = []
    caller = threading.Thread(target=lambda: outcome.append(_outcome(channel, frame, 30)))
    caller.start()
    if not entered.wait(10):
        release.set()
        raise AssertionError("the handler never got the call")
    return _HeldCall(listener, channel, caller, outcome, release)


def test_stop_answers_a_call_in_flight_with_cancelled(listen, channels, transport):
    listener, channel, caller, outcome, release = _held_call(listen, channels,
                                                             Frame(b"block", []))
    try:
        started = time.monotonic()
        listener.stop(0.2)
        caller.join(10)
        assert not caller.is_alive() and isinstance(outcome[0], errors.CancelledError), outcome
        assert time.monotonic() - started < 3
        with pytest.raises(ConnectionFailed):  # the Unix name is gone: not sent at all
            channel.call(Frame(b"again", []), timeout=5)
        again = transport.listen(listener.address, echo_handler, ListenOptions())
        again.stop(0)  # the port and the Unix name are free
    finally:
        release.set()


def test_stop_lets_calls_in_flight_finish_within_the_grace(listen, channels):
    listener, _, caller, outcome, release = _held_call(listen, channels,
                                                       Frame(b"drained", [b"ok"]))
    stopper = threading.Thread(target=listener.stop, args=(20,))
    stopper.start()
    try:
        deadline = time.monotonic() + 10
        while _unix_accepts(listener.address):  # stopping: new connections are refused
            assert time.monotonic() < deadline, "the listener kept accepting"
            time.sleep(0.01)
        release.set()
        caller.join(10)
        stopper.join(10)
        assert not stopper.is_alive(), "stop() waited out its grace with nothing running"
        assert isinstance(outcome[0], Frame) and bytes(outcome[0].header) == b"drained"
    finally:
        release.set()


def _outcome(channel, frame: Frame, timeout: float) -> object:
    try:
        return channel.call(frame, timeout=timeout)
    except errors.OpError as err:
        return err


def _unix_accepts(address: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        return sock.connect_ex(unix.socket_name(address)) == 0


def test_the_token_is_checked_when_a_connection_opens(listen, channels):
    listener = listen(security=Security(token=TOKEN))
    for presented in (None, b"x" * 32):
        with pytest.raises(errors.UnauthenticatedError):
            channels(listener.address, Security(token=presented)).call(
                Frame(b"no", [b"x"]), timeout=10)
    echo(channels(listener.address, Security(token=TOKEN)), b"yes", [b"x"])
    assert listener.unix_calls == 1


def test_a_tls_listener_refuses_plaintext_call_connections(listen, channels, tmp_path):
    pytest.importorskip("cryptography")
    from clusterwire.testing.certs import Authority

    authority = Authority(tmp_path)
    pair = authority.issue("server")
    listener = listen(security=Security(tls=TlsConfig(
        certificate_chain=pair.cert.read_bytes(), private_key=pair.key.read_bytes())))
    started = time.monotonic()
    with pytest.raises(HandshakeFailed):
        channels(listener.address).call(Frame(b"plain", []), timeout=10)
    assert time.monotonic() - started < 2
    client = Security(tls=TlsConfig(root_certificates=authority.pair.cert.read_bytes()))
    echo(channels(listener.address, client), b"tls", [np.ones(MiB, np.uint8)])
    assert listener.unix_calls == 0  # under TLS, calls go through gRPC


def test_max_connections_is_honoured_and_freed_on_close(listen, channels):
    listener = listen(max_connections=1)
    first = channels(listener.address)
    echo(first, b"first", [b"x"])  # holds the one connection (idle in its pool)
    second = channels(listener.address)
    with pytest.raises(errors.ResourceExhaustedError, match="max_connections"):
        second.call(Frame(b"second", []), timeout=10)
    first.close()
    deadline = time.monotonic() + 10
    while True:  # the listener sees the close asynchronously
        try:
            echo(second, b"second", [b"x"], timeout=10)
            break
        except errors.ResourceExhaustedError:
            assert time.monotonic() < deadline, "the closed connection was never freed"
            time.sleep(0.01)


def test_garbage_on_a_call_connection_closes_only_that_connection(listen, channels):
    listener = listen()
    good = channels(listener.address)
    echo(good, b"before", [b"x"])
    r, w = os.pipe()
    try:
        for garbage, fds in ((b"junk", []), (wire.encode_unix(wire.HELLO, 1, 0), []),
                             (wire.encode_unix(wire.SEGMENTS, 1, 2), [r]),  # one, not two
                             (wire.encode_unix(wire.READY, 1, 0), []),
                             (b"CWL1" + b"\0" * (wire.MAX_PACKET + 10), [])):  # truncated
            with hello(listener.address) as sock:
                if fds:
                    socket.send_fds(sock, [garbage], fds)
                else:
                    sock.send(garbage)
                assert sock.recv(4096) == b"", garbage[:16]  # closed by the listener
                echo(good, b"still", [b"x"])
    finally:
        os.close(r)
        os.close(w)
    # A malformed control message is answered (InvalidArgumentError); the connection stays.
    with hello(listener.address) as sock:
        for _ in range(2):
            sock.send(wire.LAYOUT.prefix.pack(b"CWL1", 0, 7, 100, 0) + b"short header")
            op, _, _, payload = wire.decode_unix(sock.recv(4096))
            assert op == wire.ERROR
            assert wire.decode_error(payload)[0] == errors.INVALID_ARGUMENT
    echo(good, b"after", [b"x"])


def test_concurrent_calls_from_8_threads(listen, channels):
    listener = listen()
    channel = channels(listener.address)
    failures: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for i in range(40):
                size = 200 * MiB // 1000 if i % 10 == 0 else int(rng.integers(0, 4096))
                echo(channel, b"t%d-%d" % (seed, i), [rng.integers(0, 255, size, np.uint8)])
        except BaseException as err:  # reported below
            failures.append(err)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures[:3]
    assert listener.unix_calls == 8 * 40


def test_max_workers_bounds_handlers_and_a_parked_wait_frees_its_slot(listen, channels):
    waiting, released = threading.Event(), threading.Event()
    running, peak = [0], [0]
    lock = threading.Lock()

    def handler(frame: Frame) -> Frame:
        if frame.header == b"wait":
            waiting.set()
            with parked():  # a barrier's wait: it must not hold the one worker
                released.wait(10)
        elif frame.header == b"set":
            released.set()
        else:
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.002)  # work that takes a moment, so overlaps would show
            with lock:
                running[0] -= 1
        return Frame(frame.header, [])

    listener = listen(handler, max_workers=1)
    channel = channels(listener.address)
    outcome: list[object] = []
    waiter = threading.Thread(target=lambda: outcome.append(
        _outcome(channel, Frame(b"wait", []), 20)))
    waiter.start()
    try:
        assert waiting.wait(10)
        started = time.monotonic()
        channel.call(Frame(b"set", []), timeout=5)  # needs the slot the waiter parked
        waiter.join(10)
        assert isinstance(outcome[0], Frame), outcome
        assert time.monotonic() - started < 5
    finally:
        released.set()
    workers = [threading.Thread(target=lambda: [channel.call(Frame(b"work", []), timeout=30)
                                                for _ in range(20)]) for _ in range(4)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(60)
    assert peak[0] == 1, f"{peak[0]} handlers ran at once with max_workers=1"


def test_work_slots_park_and_close():
    slots = WorkSlots(1)
    assert slots.acquire()
    taken = threading.Event()
    other = threading.Thread(target=lambda: (slots.acquire() and taken.set()))
    other.start()
    assert not taken.wait(0.05)  # the one slot is held
    slots.park()  # a parked wait gives it to the other thread
    assert taken.wait(10)
    slots.unpark()  # back from the wait: counts again at once (2 working, briefly)
    assert slots.working == 2
    slots.release()
    slots.release()
    assert slots.acquire()
    late: list[bool] = []
    blocked = threading.Thread(target=lambda: late.append(slots.acquire()))
    blocked.start()
    slots.close()
    blocked.join(10)
    other.join(10)
    assert late == [False]
