"""The grpc transport's shared limits under abuse: silent connections, trickled uploads.

Everything runs on 127.0.0.1 against listeners in this process; every wait polls a
condition with a deadline, and every socket, call and listener is closed at the end.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from conftest import wait_for
from grpc_listeners import TOKEN, channel_to, listening

from clusterwire import Server, Session, errors
from clusterwire.local_cluster import LocalCluster
from clusterwire.protos.service_pb2 import Request
from clusterwire.security import Security
from clusterwire.testing.peer import ANNOUNCE, echo_handler
from clusterwire.testing.surfaces import allowed_for
from clusterwire.transport import Frame, ListenOptions
from clusterwire.transports._grpc_common.client import TOKEN_METADATA
from clusterwire.transports._grpc_common.status import grpc_error
from clusterwire.transports.grpc import framing
from clusterwire.transports.grpc.transport import GrpcTransport

SILENT = 1024
# A client's HTTP/2 preface and an empty SETTINGS frame: a connection that never sends a call.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def descriptors():
    """Room for the silent connections (both ends live in this process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * SILENT + 1024
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE's hard limit {hard} is below the {want} needed")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def timed_call(channel, payload: bytes = b"8 bytes!") -> float:
    """Seconds an echo of ``payload`` took."""
    start = time.monotonic()
    reply = channel.call(Frame(b"small", [payload]), timeout=10)
    elapsed = time.monotonic() - start
    assert bytes(reply.buffers[0]) == payload
    return elapsed


def open_silent(port: int, count: int, preface: bytes = b"") -> list[socket.socket]:
    """``count`` connections that send ``preface`` and then nothing."""
    sockets = []
    try:
        for _ in range(count):
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            if preface:
                sockets[-1].sendall(preface)
    except BaseException:
        close_all(sockets)
        raise
    return sockets


def close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Read what is there; True once the peer has closed (end of stream or reset)."""
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def wait_closed(sockets: list[socket.socket], timeout: float) -> None:
    """Wait until the server has closed every one of ``sockets``; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        still_open = len(sockets)
        while still_open:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{still_open} of {len(sockets)} connections still open"
            for key, _ in selector.select(remaining):
                if _closed_by_peer(key.fileobj):
                    selector.unregister(key.fileobj)
                    still_open -= 1


def upload_threads() -> int:
    return sum(t.name == "clusterwire-grpc-upload" for t in threading.enumerate())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preface", [b"", HTTP2_PREFACE], ids=["tcp", "http2"])
def test_silent_connections_do_not_lock_out_a_token_holder(preface):
    with listening(handshake_timeout_seconds=0.5) as listener:
        port = int(listener.address.rsplit(":", 1)[1])
        silent = open_silent(port, SILENT, preface)
        bulk_silent = open_silent(listener.bulk_port, SILENT)
        try:
            opened = time.monotonic()
            with channel_to(listener.address) as channel:
                took = timed_call(channel)  # a new connection, beside the silent ones
                assert took < 1.0, f"an 8-byte call took {took:.3f} s"
                # The bulk port kept the newest connections: this fetch used it.
                big = np.arange(_MiB, dtype=np.uint8).tobytes()
                assert timed_call(channel, big) < 5.0
                assert channel._bulk._idle  # a bulk connection, kept after its fetch
            wait_closed(silent + bulk_silent, timeout=15)
            assert time.monotonic() - opened > 0.3  # closed by the timeout, not at accept
            print(f"\n{SILENT} silent {'HTTP/2' if preface else 'TCP'} connections: an "
                  f"8-byte call took {took * 1000:.1f} ms; all closed "
                  f"{time.monotonic() - opened:.2f} s after opening")
        finally:
            close_all(silent + bulk_silent)


@pytest.mark.timeout(60)
def test_a_tls_handshake_that_never_starts_is_closed_at_the_deadline(tmp_path):
    pytest.importorskip("cryptography")
    from clusterwire.security import TlsConfig
    from clusterwire.testing.certs import Authority

    authority = Authority(tmp_path)
    pair = authority.issue("server")
    tls = TlsConfig(certificate_chain=pair.cert.read_bytes(), private_key=pair.key.read_bytes())
    listener = GrpcTransport().listen("127.0.0.1:0", echo_handler, ListenOptions(
        security=Security(tls=tls, token=TOKEN), handshake_timeout_seconds=0.5))
    listener.start()
    silent = []
    try:
        silent = open_silent(int(listener.address.rsplit(":", 1)[1]), 64)
        client = Security(tls=TlsConfig(root_certificates=authority.pair.cert.read_bytes()),
                          token=TOKEN)
        channel = GrpcTransport().connect(listener.address, client)
        try:
            assert timed_call(channel) < 1.0
        finally:
            channel.close()
        wait_closed(silent, timeout=10)
    finally:
        close_all(silent)
        listener.stop(0)


@pytest.mark.timeout(60)
def test_a_unary_request_that_never_arrives_takes_no_thread_without_the_token():
    """A call without the token is refused before its request is read: stalled unary
    requests cannot take the server's threads."""
    stall = threading.Event()

    def never() -> Iterator[bytes]:
        stall.wait(30)
        yield b""

    with listening(max_workers=4, small_call_reserve=1) as listener, \
            grpc.insecure_channel(listener.address) as raw:
        call = raw.stream_unary("/clusterwire.Transport/Call")
        stalled = [call.future(never(), timeout=30) for _ in range(16)]
        try:
            for future in stalled:
                assert future.exception(10).code() == grpc.StatusCode.UNAUTHENTICATED
            with channel_to(listener.address) as channel:
                assert timed_call(channel) < 1.0
        finally:
            stall.set()
            for future in stalled:
                future.cancel()


def trickle(prefix: bytes, stop: threading.Event, period: float) -> Iterator[bytes]:
    """An upload that sends its prefix, then 1 KiB every ``period`` s until ``stop``."""
    yield prefix
    while not stop.wait(period):
        yield b"x" * 1024


def big_put_prefix(name: str) -> bytes:
    header = Request(method="put", name=name).SerializeToString()
    return framing.encode_bulk(header, [64 * _MiB])


@pytest.mark.timeout(120)
def test_trickled_uploads_leave_small_calls_a_thread(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    config = {"auth_token_file": str(token_file)}
    server = Server({"w": ["127.0.0.1:0"]}, config=config)
    stop = threading.Event()
    try:
        address = server.target.removeprefix("grpc://")
        with grpc.insecure_channel(address) as raw:
            upload = raw.stream_unary("/clusterwire.Transport/Upload")
            trickles = [upload.future(trickle(big_put_prefix(f"t{i}"), stop, 0.5), timeout=60,
                                      metadata=((TOKEN_METADATA, TOKEN),))
                        for i in range(ListenOptions().max_workers)]
            try:
                # Waiting for their bytes, uploads hold no thread: none is refused as busy.
                wait_for(lambda: upload_threads() == len(trickles),
                         what="every upload to be read")
                with Session(server.target, config=config, timeout=10) as session:
                    start = time.monotonic()
                    session.put("small", np.arange(3))
                    assert session.get("small").tolist() == [0, 1, 2]
                    took = time.monotonic() - start
                assert took < 1.0, f"a small put and get took {took:.3f} s"
                assert not any(f.done() for f in trickles)  # still trickling
                print(f"\n{len(trickles)} uploads trickling: a small put + get took "
                      f"{took * 1000:.1f} ms")
            finally:
                stop.set()
                for future in trickles:
                    future.cancel()
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_a_stalled_upload_is_dropped_with_deadline_exceeded():
    stop = threading.Event()
    with listening(message_idle_timeout_seconds=0.5) as listener, \
            grpc.insecure_channel(listener.address) as raw:
        upload = raw.stream_unary("/clusterwire.Transport/Upload")
        start = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as info:
                upload(trickle(big_put_prefix("slow"), stop, 30), timeout=30,
                       metadata=((TOKEN_METADATA, TOKEN),))
        finally:
            stop.set()
        took = time.monotonic() - start
        error = grpc_error(info.value, listener.address)
        assert isinstance(error, errors.DeadlineExceededError), error
        assert "message_idle_timeout_seconds" in error.message
        assert 0.5 <= took < 5.0, took
        # Its thread and its slot are free again, and the reader thread has ended.
        wait_for(lambda: listener._streams.working == 0, what="the upload slot")
        wait_for(lambda: upload_threads() == 0, what="the upload's reader thread")
        with channel_to(listener.address) as channel:
            assert timed_call(channel, np.ones(3 * _MiB, np.uint8).tobytes()) < 5.0
        print(f"\na stalled upload was dropped after {took:.2f} s: {error.message}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("streamed", ["upload", "fetch"])
def test_a_busy_streamed_call_is_sent_again_until_a_thread_is_free(streamed):
    payload = np.full(2 * _MiB, 7, np.uint8).tobytes()
    # An upload of the payload, or a small request whose reply is fetched over gRPC.
    frame = Frame(b"big", [payload]) if streamed == "upload" else \
        Frame(ANNOUNCE + str(len(payload)).encode(), [])
    with listening({"bulk_plane": "grpc"}, max_workers=2, small_call_reserve=1) as listener:
        # The one thread for streamed requests is working (as a fast upload would).
        assert listener._streams.try_acquire()
        freed = threading.Timer(1.0, listener._streams.release)
        try:
            with channel_to(listener.address) as channel:
                # Refused as busy until the deadline; on a loaded machine gRPC's own
                # deadline may end the last attempt first.
                with pytest.raises(errors.DeadlineExceededError,
                                   match="no thread free|Deadline Exceeded"):
                    channel.call(frame, timeout=0.3)
                # The slot comes free within the deadline; the retried call then runs.
                freed.start()
                reply = channel.call(frame, timeout=20)
                assert bytes(reply.buffers[0]) == payload
        finally:
            freed.cancel()
            if freed.ident is not None:  # started
                freed.join()


def test_bulk_port_closes_the_oldest_pending_connection_and_silent_ones():
    with listening(max_pending_connections=4, handshake_timeout_seconds=0.5) as listener:
        first = open_silent(listener.bulk_port, 1)
        rest = []
        try:
            wait_for(lambda: len(listener._bulk._pending) == 1, what="the first connection")
            rest = open_silent(listener.bulk_port, 4)
            wait_closed(first, timeout=2)  # pushed out by the fifth, before its timeout
            wait_closed(rest, timeout=10)  # then the others at their handshake timeout
        finally:
            close_all(first + rest)


def test_bulk_port_cuts_off_a_client_that_stops_reading():
    with listening(message_idle_timeout_seconds=0.5) as listener, \
            grpc.insecure_channel(listener.address) as raw:
        reply = raw.unary_unary("/clusterwire.Transport/Call")(
            framing.encode_inline(b"big", [memoryview(np.zeros(64 * _MiB, np.uint8))]),
            timeout=30, metadata=((TOKEN_METADATA, TOKEN),))
        bulk_port, fetch_id = framing.LAYOUT.decode(reply, 1 << 40).fields
        with socket.create_connection(("127.0.0.1", bulk_port), timeout=5) as reader:
            reader.sendall(fetch_id.to_bytes(8, "little"))  # and never reads
            wait_for(lambda: listener._bulk._connections, what="the fetch to start")
            wait_for(lambda: not listener._bulk._connections, what="the server to cut it off")


@pytest.mark.parametrize("limits, named", [
    ({"max_workers": 4, "small_call_reserve": 4}, "small_call_reserve"),
    ({"small_call_reserve": -1}, "small_call_reserve"),
    ({"handshake_timeout_seconds": 0}, "handshake_timeout_seconds"),
    ({"message_idle_timeout_seconds": -1.0}, "message_idle_timeout_seconds"),
    ({"max_pending_connections": 0}, "max_pending_connections"),
])
def test_bad_limits_are_refused_naming_the_value(limits, named):
    with pytest.raises(errors.InvalidArgumentError, match=named):
        GrpcTransport().listen("127.0.0.1:0", echo_handler, ListenOptions(**limits))


@pytest.mark.timeout(60)
def test_grpc_verbs_control_plane_has_the_same_limits():
    pytest.importorskip("ucxx", reason="the verbs extra is not installed")
    from clusterwire.plugins import get_plugin_manager

    transport = get_plugin_manager().transport("grpc+verbs")
    stall = threading.Event()

    def never() -> Iterator[bytes]:
        stall.wait(30)
        yield b""

    listener = transport.listen("127.0.0.1:0", echo_handler, ListenOptions(
        security=Security(token=TOKEN), handshake_timeout_seconds=0.5))
    listener.start()
    silent = []
    try:
        silent = open_silent(int(listener.address.rsplit(":", 1)[1]), 64)
        with grpc.insecure_channel(listener.address) as raw:
            hello = raw.stream_unary("/clusterwire.Verbs/Hello")
            stalled = [hello.future(never(), timeout=30) for _ in range(8)]
            try:
                for future in stalled:  # refused before the request: no control thread taken
                    assert future.exception(10).code() == grpc.StatusCode.UNAUTHENTICATED
            finally:
                stall.set()
        channel = transport.connect(listener.address, Security(token=TOKEN))
        try:
            reply = channel.call(Frame(b"verbs", [b"8 bytes!"]), timeout=10)
            assert bytes(reply.buffers[0]) == b"8 bytes!"
        finally:
            channel.close()
        wait_closed(silent, timeout=10)
    finally:
        close_all(silent)
        listener.stop(0)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _timed_gets(target: str, config: dict, count: int) -> list[float]:
    took = []
    for _ in range(count):
        start = time.monotonic()
        with Session(target, config=config, timeout=10) as session:
            assert session.get("small").tolist() == [0]
        took.append(time.monotonic() - start)
    return took


#: Flood connections (or watches) the server must end before the timed gets, and again
#: during them: a whole pending table's worth, so the flood is past gRPC's quota for
#: unauthenticated connections and the door is turning it over while token holders call.
TURNOVER = ListenOptions().max_pending_connections
#: Flood connections (or watches) the server must end while the token holders call: four
#: tables' worth, so the door turns the flood over again and again during the gets (and the
#: RSS bound covers thousands of connects).
DURING = 4 * TURNOVER


def flood_gets(target: str, config: dict, pid: int, flood_args: list[str],
               progress: Callable[[dict], int]) -> tuple[list[float], float, float, int]:
    """Run ``cw_health_flood.py`` against ``target`` until ``progress`` of its JSON report
    (flood connections or streams the server ended) reaches TURNOVER, then time
    token-holder sessions' 8-byte gets: 8 of them, then one more at each report of the flood
    until it had DURING more ended since the first (a count, not a time: a flood
    starved of CPU on a busy machine ends fewer per second but as many in all). (Their
    seconds, the seconds they may take (the surface kit's ``allowed_for``: 1 s on an idle
    machine), the task's RSS growth in MiB, the flood's progress during the gets.)"""
    allowed = allowed_for(max(_timed_gets(target, config, 3)))
    before = rss_mib(pid)
    flood = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "cw_health_flood.py"),
         target.split("://")[1], *flood_args], stdout=subprocess.PIPE, text=True)
    latest = threading.Condition()
    reports: list[int] = []

    def read() -> None:
        for line in flood.stdout:
            with latest:
                reports.append(progress(json.loads(line)))
                latest.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with latest:
            assert latest.wait_for(lambda: reports and reports[-1] >= TURNOVER, 300), \
                f"the flood reached {reports[-1:]} of {TURNOVER}"
            start_progress = reports[-1]
        took = _timed_gets(target, config, 8)
        deadline = time.monotonic() + 300
        while reports[-1] - start_progress < DURING:  # one more get per flood report
            with latest:
                count = len(reports)
                # The flood runs at nice 19: beside CPU hogs its next report may be long in
                # coming, so wait while it lives (it ends only if it fails), up to the deadline.
                while not latest.wait_for(lambda seen=count: len(reports) > seen, 1):
                    assert flood.poll() is None, f"the flood exited ({flood.returncode})"
                    assert time.monotonic() < deadline, \
                        f"the flood ended {reports[-1] - start_progress} of {DURING} " \
                        "during the gets"
            took += _timed_gets(target, config, 1)
        return took, allowed, rss_mib(pid) - before, reports[-1] - start_progress
    finally:
        flood.kill()
        flood.wait(10)
        reader.join(10)
        flood.stdout.close()


@pytest.fixture
def token_task(tmp_path):
    """A task process with a token, holding an 8-byte tensor "small"; (cluster, config)."""
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    config = {"auth_token_file": str(token_file)}
    with LocalCluster({"w": 1}, config=config) as cluster:
        with Session(cluster.target("w"), config=config, timeout=10) as session:
            session.put("small", np.arange(1, dtype=np.int64))
        yield cluster, config


@pytest.mark.timeout(420)
def test_a_reconnecting_tokenless_flood_does_not_lock_token_holders_out(token_task):
    """1,280 tokenless connections from another process, each holding a health Watch and
    reconnecting whenever the server closes it (the attack that held gRPC's connection
    quota): every token holder's new session gets its 8-byte tensor within 1 s while the
    server ends DURING more watches."""
    cluster, config = token_task
    took, allowed, grown, during = flood_gets(cluster.target("w"), config, cluster.process("w").pid,
                                     ["1280"], lambda ended: sum(ended.values()))
    assert max(took) < allowed, (took, allowed)
    assert grown < 150, f"the task grew by {grown:.0f} MiB"
    assert during >= DURING
    print(f"\nreconnecting tokenless Watch flood ({during} more watches ended by the server "
          f"meanwhile): {len(took)} sessions' gets took {min(took) * 1000:.0f}-"
          f"{max(took) * 1000:.0f} ms; RSS +{grown:.0f} MiB")


@pytest.mark.timeout(420)
def test_a_reconnecting_silent_flood_from_another_peer_does_not_lock_token_holders_out(
        token_task):
    """1,344 silent connections from another peer address (127.0.0.2), each opened again
    as soon as the server closes it, at full speed (the issue's attack, which kept more
    connections than gRPC's quota open): every token holder's new session gets its tensor
    while the server closes DURING more of them."""
    cluster, config = token_task
    took, allowed, grown, during = flood_gets(cluster.target("w"), config, cluster.process("w").pid,
                                     ["1344", "silent", "127.0.0.2"],
                                     lambda report: report["closed"])
    assert max(took) < allowed, (took, allowed)
    assert grown < 150, f"the task grew by {grown:.0f} MiB"
    assert during >= DURING
    print(f"\nreconnecting silent flood from 127.0.0.2 ({during} more connections closed by the "
          f"server meanwhile): {len(took)} sessions' gets took {min(took) * 1000:.0f}-"
          f"{max(took) * 1000:.0f} ms; RSS +{grown:.0f} MiB")
