"""The grpc fast lane under TLS: a TLS listener's lane runs inside TLS with the listener's
certificates, its channels take it for small calls, and its port refuses what gRPC's TLS
port refuses (another authority's certificate, a plaintext client, a missing client
certificate under mutual TLS), closing silent connections at the handshake deadline.

Listeners and Servers run on 127.0.0.1 in this process; every wait polls an outcome with a
deadline, and every socket, channel, listener and Server is closed at the end.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time

import grpc_listeners
import numpy as np
import pytest
from conftest import wait_for
from grpc_listeners import TOKEN

import clusterwire
from clusterwire import errors
from clusterwire.plugins import PluginManager, set_plugin_manager
from clusterwire.security import Security, TlsConfig
from clusterwire.testing.floods import SilentFlood, require_descriptors
from clusterwire.testing.peer import SLEEP, echo_handler
from clusterwire.transport import Frame
from clusterwire.transports._grpc_common.call_pool import set_receive_timeout
from clusterwire.transports.grpc import lane, lane_tls
from clusterwire.transports.grpc.transport import GrpcListener, GrpcTransport

pytest.importorskip("cryptography")
from clusterwire.testing.certs import Authority  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LANE = {"fast_lane": True}
FLOOD = 256


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    authority = Authority(directory)
    stranger = Authority(directory, "stranger CA")
    return {"ca": authority, "server": authority.issue("server"),
            "server 1": authority.issue("server-1"),
            "client": authority.issue("client"), "stranger": stranger,
            "stranger server": stranger.issue("stranger-server")}


def server_tls(pki, client_auth: bool = False, pair: str = "server") -> TlsConfig:
    return TlsConfig(certificate_chain=pki[pair].cert.read_bytes(),
                     private_key=pki[pair].key.read_bytes(),
                     root_certificates=pki["ca"].pair.cert.read_bytes(),
                     require_client_auth=client_auth)


def client_tls(pki, cert: str | None = None, ca: str = "ca") -> TlsConfig:
    return TlsConfig(certificate_chain=pki[cert].cert.read_bytes() if cert else None,
                     private_key=pki[cert].key.read_bytes() if cert else None,
                     root_certificates=pki[ca].pair.cert.read_bytes())


def listening(tls: TlsConfig, handler=echo_handler, **limits
              ) -> contextlib.AbstractContextManager[GrpcListener]:
    return grpc_listeners.listening(LANE, handler, tls=tls, **limits)


def channel_to(address: str, tls: TlsConfig | None) -> contextlib.AbstractContextManager:
    return grpc_listeners.channel_to(address, transport_options=LANE, tls=tls)


def echo(channel, payload: bytes = b"8 bytes!", timeout: float = 10) -> float:
    started = time.monotonic()
    reply = channel.call(Frame(b"small", [payload]), timeout=timeout)
    assert bytes(reply.buffers[0]) == payload
    return time.monotonic() - started


def lane_client(listener: GrpcListener, tls: TlsConfig) -> lane.LaneClient:
    """A lane client handed the listener's tickets directly (as if gRPC had given them):
    what the lane's port itself accepts or refuses."""
    return lane.LaneClient(listener.address, lambda _: listener.lane.ticket("127.0.0.1"),
                           1 << 20, tls)


def dial(sock: socket.socket, pki, host: str = "127.0.0.1") -> lane_tls.TlsStream:
    """A TLS lane connection on ``sock`` that trusts the test authority."""
    return lane_tls.dial(sock, lane_tls.client_context(client_tls(pki)), host,
                         time.monotonic() + 10)


def hello_parts() -> list[memoryview]:
    return lane.framing.inline_parts(b"hi", [])


# -- the lane under TLS -------------------------------------------------------------------


def test_small_calls_of_a_tls_channel_take_the_tls_lane(pki):
    with listening(server_tls(pki)) as listener, \
            channel_to(listener.address, client_tls(pki)) as channel:
        assert listener.lane is not None and channel._lane is not None
        for payload in (b"8 bytes!", b"", b"x" * 70_000, b"y" * (300 << 10)):
            echo(channel, payload)
        assert listener.lane.calls == 4 and channel._lane.calls == 4
        (served,) = listener.lane._served.values()
        assert isinstance(served.sock, lane_tls.TlsStream)  # one connection, inside TLS
        big = bytes(range(256)) * (8 << 10)  # 2 MiB: uploaded and fetched over gRPC
        echo(channel, big, timeout=30)
        assert listener.lane.calls == 4
        with pytest.raises(errors.InternalError):  # the handler's error, mapped as on gRPC
            channel.call(Frame(b"fail", []), timeout=10)
        with pytest.raises(errors.DeadlineExceededError):
            channel.call(Frame(SLEEP + b"2", []), timeout=0.2)
        echo(channel)  # the lane serves on after a deadline (a new connection)
        # Replies counted by the channel; calls run, errors too, by the listener.
        assert channel._lane.calls == 5 and listener.lane.calls == 7


def test_mutual_tls_lane(pki):
    with listening(server_tls(pki, client_auth=True)) as listener:
        with channel_to(listener.address, client_tls(pki, cert="client")) as channel:
            echo(channel)
            assert channel._lane.calls == 1
        # A ticket in hand but no client certificate: refused at the lane's handshake, and
        # the call goes over gRPC (which refuses it too).
        anonymous = lane_client(listener, client_tls(pki))
        try:
            assert anonymous.call(hello_parts(), time.monotonic() + 10) is None
        finally:
            anonymous.close()
        assert listener.lane.calls == 1


def test_a_tls_clusters_small_calls_go_over_the_lane(pki, tmp_path):
    config = tmp_path / "plugins.toml"
    config.write_text("[options.grpc]\nfast_lane = true\n")

    def config_of_task(pair: str) -> dict:
        # Certificates of their own: a task forwards to the other over the transport, not
        # in process (that path is taken with the server's own credentials only).
        return {"tls_cert_file": str(pki[pair].cert), "tls_key_file": str(pki[pair].key),
                "tls_ca_file": str(pki["ca"].pair.cert), "allow_membership_changes": True}

    previous = set_plugin_manager(PluginManager(str(config)))
    servers: list[clusterwire.Server] = []
    try:
        servers.append(clusterwire.Server({"w": ["127.0.0.1:0"] * 2}, job_name="w",
                                          task_index=0, config=config_of_task("server")))
        first = servers[0].target.split("://")[1]
        servers.append(clusterwire.Server({"w": [first, "127.0.0.1:0"]}, job_name="w",
                                          task_index=1, config=config_of_task("server 1")))
        servers[0].update_cluster({"w": [first, servers[1].target.split("://")[1]]})
        lanes = [server._shell._listener.lane for server in servers]
        assert all(lane_server is not None for lane_server in lanes)
        with clusterwire.Session(servers[0].target,
                                 config={"tls_ca_file": str(pki["ca"].pair.cert)}) as session:
            assert "inside TLS" in session.status()["transport"]["small_calls"]
            before = [lane_server.calls for lane_server in lanes]
            small = np.arange(8, dtype=np.uint8)
            session.put("v", small)
            np.testing.assert_array_equal(session.get("v"), small)
            session.put("r", small, task="/job:w/task:1")  # forwarded by task 0
            np.testing.assert_array_equal(session.get("r", task="/job:w/task:1"), small)
            big = np.arange(1 << 21, dtype=np.int64)  # 16 MiB: fetched over gRPC
            session.put("big", big)
            np.testing.assert_array_equal(session.get("big"), big)
            served = [lane_server.calls - b for lane_server, b in zip(lanes, before,
                                                                        strict=True)]
            assert served[0] >= 4 and served[1] >= 2, served
    finally:
        for server in reversed(servers):
            server.stop()
        set_plugin_manager(previous)


# -- what the TLS lane's port refuses -------------------------------------------------------


def test_a_channel_with_another_authority_gets_no_lane(pki):
    with listening(server_tls(pki)) as listener:
        # Through gRPC: no ticket (gRPC's handshake fails first).
        with channel_to(listener.address, client_tls(pki, ca="stranger")) as channel:
            with pytest.raises(errors.UnauthenticatedError):
                echo(channel)
        # With a ticket in hand: the lane's certificate is not trusted, so no lane, and no
        # ticket asked for again for a while.
        stranger = lane_client(listener, client_tls(pki, ca="stranger"))
        try:
            assert stranger.call(hello_parts(), time.monotonic() + 10) is None
            assert stranger._after > time.monotonic() + lane._RETRY_S / 2
        finally:
            stranger.close()
        assert listener.lane.calls == 0 and not listener.lane._served


def test_a_lane_of_another_authority_is_not_trusted(pki):
    """The channel checks the lane as gRPC checks the listener: a lane presenting another
    authority's certificate, or one not naming the host dialled, fails the handshake."""
    with listening(server_tls(pki, pair="stranger server")) as listener, \
            socket.create_connection(("127.0.0.1", listener.lane.port), timeout=10) as sock:
        with pytest.raises(ssl.SSLCertVerificationError):
            dial(sock, pki)
    with listening(server_tls(pki)) as listener, \
            socket.create_connection(("127.0.0.1", listener.lane.port), timeout=10) as sock:
        with pytest.raises(ssl.SSLCertVerificationError, match="mismatch|match"):
            dial(sock, pki, "cluster.example")


def test_a_plaintext_client_is_refused_at_the_handshake(pki):
    """A plaintext HELLO with a good secret: the lane answers at most a TLS alert, then
    closes; the secret is not taken."""
    with listening(server_tls(pki)) as listener:
        secret = listener.lane.ticket("127.0.0.1")[-16:]
        with socket.create_connection(("127.0.0.1", listener.lane.port), timeout=10) as sock:
            sock.sendall(lane.message(lane.HELLO, secret))
            received = _until_closed(sock)
            assert not received or received[0] == 0x15, received  # an alert record
        assert not listener.lane._served and listener.lane.calls == 0
        assert listener.lane._tickets.take(secret) == "127.0.0.1"


def _until_closed(sock: socket.socket) -> bytes:
    """What ``sock`` receives until the listener closes it (its timeout: a failure)."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 16):
            received += chunk
    return received


def test_the_handshake_deadline_closes_silent_tls_connections(pki):
    """Connections that send nothing, half a ClientHello, or finish the TLS handshake and
    send no HELLO are all closed at the handshake deadline; a token holder's call meanwhile
    takes the lane within 1 s."""
    require_descriptors(4 * FLOOD + 4096)
    with listening(server_tls(pki), handshake_timeout_seconds=0.5) as listener:
        address = ("127.0.0.1", listener.lane.port)
        opened = time.monotonic()
        floods = [SilentFlood(FLOOD, socket.AF_INET, socket.SOCK_STREAM, address),
                  SilentFlood(FLOOD, socket.AF_INET, socket.SOCK_STREAM, address,
                              greeting=_client_hello()[:60])]
        shaken = socket.create_connection(address, timeout=10)
        try:
            stream = dial(shaken, pki)
            with channel_to(listener.address, client_tls(pki)) as channel:
                took = echo(channel)
                assert took < 1.0, f"a token holder's call took {took:.3f} s"
                assert channel._lane.calls == 1
            for flood in floods:
                wait_for(lambda f=flood: f.closed() == FLOOD, 30, "silent connections closed")
            shaken.settimeout(30)
            assert stream.recv_into(memoryview(bytearray(64))) == 0  # closed, unanswered
            closed_after = time.monotonic() - opened
            assert closed_after > 0.4  # by the deadline, not at accept
            print(f"\n{2 * FLOOD} silent TLS lane connections and a handshaken one: a token "
                  f"holder's call took {took * 1000:.1f} ms; all closed "
                  f"{closed_after:.2f} s after opening")
        finally:
            shaken.close()
            for flood in floods:
                flood.close()


def _client_hello() -> bytes:
    """The first bytes a TLS client sends."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, outgoing,
                                                server_hostname="127.0.0.1")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


# -- the lane's rules inside TLS ----------------------------------------------------------


def test_stop_tells_an_idle_tls_connection_closing(pki):
    with listening(server_tls(pki)) as listener:
        channel = GrpcTransport(LANE).connect(listener.address,
                                              Security(tls=client_tls(pki), token=TOKEN))
        try:
            echo(channel)
            listener.stop(0)  # the idle connection is told CLOSING (inside TLS)
            started = time.monotonic()
            with pytest.raises(errors.UnavailableError):
                channel.call(Frame(b"after", [b"x"]), timeout=10)
            assert time.monotonic() - started < 5
        finally:
            channel.close()


def test_a_closed_idle_tls_connection_is_replaced_and_calls_run_on(pki):
    with listening(server_tls(pki)) as listener, \
            channel_to(listener.address, client_tls(pki)) as channel:
        echo(channel)
        (served,) = listener.lane._served.values()
        served.close_when_idle()  # from another thread than the connection's: CLOSING
        echo(channel)
        assert channel._lane.calls == 2 and listener.lane.calls == 2


def test_stop_cancels_a_running_tls_lane_call_after_its_grace(pki):
    entered = threading.Event()

    def handler(frame: Frame) -> Frame:
        entered.set()
        time.sleep(3)
        return frame

    with listening(server_tls(pki), handler=handler) as listener, \
            channel_to(listener.address, client_tls(pki)) as channel:
        outcome: list[object] = []

        def call() -> None:
            try:
                outcome.append(channel.call(Frame(b"block", []), timeout=30))
            except errors.OpError as err:
                outcome.append(err)

        caller = threading.Thread(target=call)
        caller.start()
        assert entered.wait(10)
        listener.stop(0.2)
        caller.join(10)
        assert isinstance(outcome[0], errors.CancelledError), outcome


def test_an_oversized_tls_lane_message_is_refused_before_it_is_read(pki):
    with listening(server_tls(pki)) as listener, \
            socket.create_connection(("127.0.0.1", listener.lane.port), timeout=10) as sock:
        stream = dial(sock, pki)
        stream.sendall(lane.message(lane.HELLO, listener.lane.ticket("127.0.0.1")[-16:]))
        scratch = memoryview(bytearray(1 << 16))
        assert lane.read_message(stream, scratch, 1 << 16, lambda: True, lambda: True)[0] \
            == lane.READY
        stream.sendall(lane._MESSAGE.pack(lane.MAGIC, lane.CALL, 1 << 40))
        op, body, _ = lane.read_message(stream, scratch, 1 << 16, lambda: True, lambda: True)
        assert op == lane.ERROR and int.from_bytes(body[:4], "little") == \
            errors.RESOURCE_EXHAUSTED
        assert lane.read_message(stream, scratch, 1 << 16, lambda: True, lambda: True) is None


def test_many_threads_share_a_tls_channel(pki):
    with listening(server_tls(pki)) as listener, \
            channel_to(listener.address, client_tls(pki)) as channel:
        failures: list[BaseException] = []

        def calls(index: int) -> None:
            try:
                for round_ in range(50):
                    echo(channel, b"%d-%d" % (index, round_) * (1 + round_ * 100))
            except BaseException as err:  # noqa: BLE001 - reported below
                failures.append(err)

        threads = [threading.Thread(target=calls, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not failures and not any(thread.is_alive() for thread in threads)
        assert listener.lane.calls == 400


def test_bad_pem_material_is_invalid_argument():
    with pytest.raises(errors.InvalidArgumentError, match="tls_cert_file"):
        lane_tls.server_context(TlsConfig(certificate_chain=b"not a certificate",
                                          private_key=b"nor a key"))
    with pytest.raises(errors.InvalidArgumentError, match="tls_ca_file"):
        lane_tls.client_context(TlsConfig(root_certificates=b"not a CA"))


def test_a_tls_stream_resumes_partial_writes_and_survives_receive_timeouts(pki):
    """Over a socket pair with small kernel buffers: megabytes in many parts arrive whole and
    in order through partial sends; a receive that times out (the kernel timeout the lane
    arms) raises as the socket's would, and the next one reads on with the TLS intact."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        for sock in (ours, theirs):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        accepted: list[lane_tls.TlsStream] = []
        server = threading.Thread(target=lambda: accepted.append(lane_tls.accept(
            theirs, lane_tls.server_context(server_tls(pki)), time.monotonic() + 10)))
        server.start()
        client = lane_tls.dial(ours, lane_tls.client_context(client_tls(pki)), "127.0.0.1",
                               time.monotonic() + 10)
        server.join(10)
        (listener_side,) = accepted
        listener_side.settimeout(None)
        set_receive_timeout(listener_side, 0.05)
        with pytest.raises(BlockingIOError):  # nothing sent yet: the kernel timeout
            listener_side.recv_into(memoryview(bytearray(16)))
        parts = [memoryview(bytes([index % 251]) * size)
                 for index, size in enumerate([0, 7, 70_000, 1, 3 << 20, 100, 0, 999])]
        expected = b"".join(parts)
        received = bytearray()

        def read() -> None:
            view = memoryview(bytearray(1000))
            while len(received) < len(expected):
                try:
                    count = listener_side.recv_into(view)
                except BlockingIOError:
                    continue  # the kernel timeout while the writer is blocked
                if not count:
                    return
                received.extend(view[:count])

        reader = threading.Thread(target=read)
        reader.start()
        client.settimeout(None)
        assert client.sendmsg(parts) == len(expected)
        reader.join(30)
        assert not reader.is_alive() and bytes(received) == expected
        client.sendall(b"after")
        view = memoryview(bytearray(16))
        assert bytes(view[:listener_side.recv_into(view)]) == b"after"


def test_a_channel_without_a_ca_file_trusts_grpcs_roots_file(pki, monkeypatch):
    """Without tls_ca_file the lane trusts what gRPC trusts: the file
    GRPC_DEFAULT_SSL_ROOTS_FILE_PATH names (else the system's roots)."""
    monkeypatch.setenv("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH", str(pki["ca"].pair.cert))
    with listening(server_tls(pki)) as listener, channel_to(listener.address,
                                                            TlsConfig()) as channel:
        echo(channel)
        assert channel._lane.calls == 1
    monkeypatch.setenv("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH", "/nonexistent/roots.pem")
    with pytest.raises(errors.InvalidArgumentError, match="GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"):
        lane_tls.client_context(TlsConfig())
