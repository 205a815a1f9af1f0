"""The transport conformance checks (see ``clusterwire.testing``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from clusterwire import codec, errors
from clusterwire.local_cluster import READY_PREFIX, LocalCluster
from clusterwire.plugins import get_plugin_manager
from clusterwire.protos.service_pb2 import Value
from clusterwire.security import Security, TlsConfig
from clusterwire.server import Server
from clusterwire.session import Session
from clusterwire.testing.floods import SilentFlood, peer_closed, require_descriptors, wait_for
from clusterwire.testing.peer import ANNOUNCE, FAIL, PEER, SLEEP, echo_handler
from clusterwire.testing.proxy import TrickleProxy
from clusterwire.transport import Channel, Frame, Listener, ListenOptions, Transport

_MiB = 1 << 20


@dataclass(frozen=True)
class Capabilities:
    """What a transport supports; checks for unsupported features are skipped."""

    #: The listener owns a TCP port that raw bytes can be sent to (malformed-input check).
    raw_tcp_port: bool = True
    #: Frames of 256 MiB and more.
    large_frames: bool = True
    #: Listener and channel in different processes.
    cross_process: bool = True
    #: Servers of this protocol forward requests to each other (a multi-task cluster).
    cluster: bool = True
    #: Received buffers are writable (a zero-copy transport may hand out read-only memory).
    writable_buffers: bool = True
    #: The listener checks a cluster token (Security.token) on every request.
    token_auth: bool = True
    #: A call still running when its listener stops is answered CancelledError every
    #: time (False: now and then UnavailableError instead, as the connection's end can
    #: overtake the answer).
    cancels_on_stop: bool = True
    #: The control plane speaks TLS when Security.tls is set.
    tls: bool = True
    #: With max_pending_connections unauthenticated TCP connections held, a new one closes
    #: the oldest of them (``ListenOptions.max_pending_connections``).
    evicts_oldest_pending_tcp: bool = True
    #: A channel can reach the listener through a plain TCP proxy, and its request bytes
    #: travel through it (the trickled-upload check slows them down there).
    trickle_via_proxy: bool = True
    #: How the listener tells clients apart (``Frame.peer`` of the requests it hands its
    #: handler): "ip", a TCP peer's IP address (a client through a proxy that connects from
    #: 127.0.0.2 is "127.0.0.2"); "uid", "uid:N" of a Unix peer's user (a client that
    #: switched to another user is told apart; checked when the kit runs as root).
    peers: str = "ip"


class _Peer:
    """A listener in a child process (``python -m clusterwire.testing.peer``)."""

    def __init__(self, protocol: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clusterwire.testing.peer", protocol],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = ""
        deadline = time.monotonic() + 60
        while not line.startswith(READY_PREFIX):
            line = self.proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"conformance peer for {protocol!r} did not start")
        self.address = line[len(READY_PREFIX):].strip()

    def wait_for(self, text: str, timeout: float) -> None:
        line = _line_within(self.proc.stdout, timeout)
        assert line is not None and line.strip() == text, f"peer did not say {text!r}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


def _line_within(stream, timeout: float) -> str | None:
    """The next line of a child's ``stream``, or None if none came within ``timeout``
    seconds. The reading thread may outlive this call: closing the stream under it later
    ends it quietly (an exception on it would fail whatever test runs then)."""
    lines: list[str] = []

    def read() -> None:
        with contextlib.suppress(OSError, ValueError):  # closed by the test's cleanup
            lines.append(stream.readline())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return lines[0] if lines else None


def _call_in_background(channel: Channel, frame: Frame,
                        timeout: float) -> tuple[threading.Thread, list[object]]:
    """Start ``channel.call`` on a thread; its result or clusterwire error lands in the list."""
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(channel.call(frame, timeout=timeout))
        except errors.OpError as err:
            outcome.append(err)

    caller = threading.Thread(target=call)
    caller.start()
    return caller, outcome


def _payload(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _same_bytes(received, sent) -> bool:
    as_bytes = [np.frombuffer(memoryview(b).cast("B"), np.uint8) for b in (received, sent)]
    return np.array_equal(*as_bytes)


# A client process whose channel gets descriptors over 1023 (it holds 1,100 others first).
_HIGH_DESCRIPTORS_CLIENT = """
import os, resource, sys
from clusterwire.plugins import get_plugin_manager
from clusterwire.testing.peer import SLEEP
from clusterwire.transport import Frame
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
wanted = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
if wanted < 1200:
    sys.exit(print("SKIP: the hard limit is", hard))
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
channel = get_plugin_manager().transport(sys.argv[1]).connect(sys.argv[2])
for i in range(20):
    reply = channel.call(Frame(b"high-%d" % i, [b"8 bytes!"]), timeout=30)
    assert bytes(reply.header) == b"high-%d" % i and bytes(reply.buffers[0]) == b"8 bytes!"
channel.call(Frame(SLEEP + b"0.2", []), timeout=30)  # a wait long enough to sleep in
channel.close()
print("OK, descriptors up to", max(held))
"""


#: The peer address and the user a client of another peer uses (``Capabilities.peers``).
_OTHER_PEER = "127.0.0.2"
_OTHER_UID = 65534

# A client that prints the peer the listener saw, then switches to another user (its
# modules loaded: they may live where that user cannot read) and prints it again.
_OTHER_USER_CLIENT = """
import os, sys
from clusterwire.plugins import get_plugin_manager
from clusterwire.transport import Frame
transport = get_plugin_manager().transport(sys.argv[1])
def seen():
    channel = transport.connect(sys.argv[2])
    try:
        return bytes(channel.call(Frame(b"peer", []), timeout=30).header).decode()
    finally:
        channel.close()
print(seen(), flush=True)
os.setgid(int(sys.argv[3]))
os.setuid(int(sys.argv[3]))
print(seen(), flush=True)
"""

#: Silent connections an unauthenticated peer holds in the flood checks.
_FLOOD = 1024
#: How fast a token holder's small call must answer under a flood or trickled uploads.
_SMALL_CALL_BUDGET = 1.0
_TOKEN = b"t" * 32
#: How long closing silent connections may take beyond their deadline (far below libzmq's
#: and gRPC's own handshake timeouts, so those cannot pass for the listener's).
_CLOSE_SLACK = 5.0


# A token holder in its own process (so grpc+local goes through its sockets, not an
# in-process shortcut). It prints READY after a first call, then times a fresh channel's
# 8-byte call for each line it reads.
_TOKEN_HOLDER = """
import sys, time
from clusterwire.plugins import get_plugin_manager
from clusterwire.security import Security
from clusterwire.transport import Frame
transport = get_plugin_manager().transport(sys.argv[1])
security = Security(token=sys.argv[3].encode())
def call():
    started = time.monotonic()
    channel = transport.connect(sys.argv[2], security)
    try:
        reply = channel.call(Frame(b"small", [b"8 bytes!"]), timeout=10)
        assert bytes(reply.buffers[0]) == b"8 bytes!", reply
        return time.monotonic() - started
    finally:
        channel.close()
call()
print("READY", flush=True)
for _ in sys.stdin:
    try:
        print(call(), flush=True)
    except Exception as err:
        print("FAILED", type(err).__name__, err, flush=True)
"""


class _TokenHolder:
    """A child process making token-holding small calls to ``address`` on request."""

    def __init__(self, protocol: str, address: str, token: bytes):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TOKEN_HOLDER, protocol, address, token.decode()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            ready = self._line(60)
            assert ready == "READY", f"the token holder did not start: {ready!r}"
        except BaseException:
            self.close()
            raise

    def _line(self, timeout: float) -> str:
        line = _line_within(self.proc.stdout, timeout)
        assert line is not None, f"the token holder said nothing within {timeout} s"
        return line.strip()

    def call(self) -> float:
        """Seconds a fresh channel's 8-byte call took (connecting included)."""
        self.proc.stdin.write("call\n")
        self.proc.stdin.flush()
        answer = self._line(30)
        assert not answer.startswith("FAILED"), answer
        return float(answer)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()


class TransportSuite:
    """Subclass as ``TestXxx`` with ``protocol`` (and ``capabilities``) set."""

    protocol: str = ""
    capabilities: Capabilities = Capabilities()
    host: str = "127.0.0.1"

    # -- fixtures ---------------------------------------------------------------------

    @pytest.fixture
    def transport(self) -> Transport:
        return get_plugin_manager().transport(self.protocol)

    def _listen(self, transport: Transport, handler=echo_handler,
                options: ListenOptions | None = None) -> Listener:
        listener = transport.listen(f"{self.host}:0", handler, options or ListenOptions())
        listener.start()
        return listener

    @pytest.fixture
    def listener(self, transport) -> Iterator[Listener]:
        listener = self._listen(transport)
        yield listener
        listener.stop(0)

    @classmethod
    def _peer(cls) -> _Peer:
        if not cls.capabilities.cross_process:
            pytest.skip(f"{cls.protocol} does not run across processes")
        return _Peer(cls.protocol)

    @pytest.fixture(scope="class")
    @classmethod
    def peer_process(cls) -> Iterator[_Peer]:
        peer = cls._peer()
        yield peer
        peer.close()

    @pytest.fixture(params=["same-process", "other-process"])
    def channel(self, request, transport) -> Iterator[Channel]:
        """A channel to an echo listener in this process, then in a child process."""
        if request.param == "same-process":
            listener = request.getfixturevalue("listener")
            address = listener.address
        else:
            address = request.getfixturevalue("peer_process").address
        channel = transport.connect(address)
        yield channel
        channel.close()

    @pytest.fixture
    def peer(self) -> Iterator[_Peer]:
        peer = self._peer()
        yield peer
        peer.close()

    def _blocking_listener(self, transport: Transport) -> tuple[Listener, threading.Event]:
        """A listener whose handler signals entry, then blocks for 5 s."""
        entered = threading.Event()

        def handler(frame: Frame) -> Frame:
            entered.set()
            time.sleep(5)
            return frame

        return self._listen(transport, handler), entered

    def _echo(self, channel: Channel, header: bytes, buffers, timeout: float = 60) -> Frame:
        response = channel.call(Frame(header, buffers), timeout=timeout)
        assert bytes(response.header) == header
        assert len(response.buffers) == len(buffers)
        for received, sent in zip(response.buffers, buffers, strict=True):
            assert _same_bytes(received, sent)
        return response

    # -- payloads ---------------------------------------------------------------------

    def test_empty_frame(self, channel):
        self._echo(channel, b"", [])

    def test_header_only_and_empty_buffers(self, channel):
        self._echo(channel, b"h" * 1000, [b"", np.empty(0, np.uint8), b""])

    def test_small_frame(self, channel):
        self._echo(channel, b"small", [b"12345678"])

    def test_encoded_values(self, channel):
        value = {"scalar": np.array(3.5), "strided": np.arange(40.0).reshape(5, 8)[::2, ::3],
                 "empty": np.zeros((0, 4)), "text": "x", "raw": b"\x00\xff"}
        header, buffers = codec.encode(value)
        response = channel.call(Frame(header.SerializeToString(), buffers), timeout=30)
        result = codec.decode(Value.FromString(bytes(response.header)), list(response.buffers))
        np.testing.assert_array_equal(result["strided"], value["strided"])
        assert result["scalar"].shape == () and float(result["scalar"]) == 3.5
        assert result["empty"].shape == (0, 4) and result["raw"] == b"\x00\xff"

    def test_received_buffers_are_writable_and_owned(self, channel):
        sent = _payload(4 * _MiB)
        response = self._echo(channel, b"w", [sent])
        view = memoryview(response.buffers[0]).cast("B")
        if not self.capabilities.writable_buffers:
            assert view.readonly, "a transport sharing memory must hand out read-only views"
            return
        assert not view.readonly
        view[0] = (int(sent[0]) + 1) % 256
        assert view[0] != sent[0]

    def test_many_buffers(self, channel):
        # 1.5 MB of small buffers: past a 1 MiB inline budget, small ones take the data path.
        buffers = [_payload(n, n) for n in range(0, 3000, 3)]
        response = self._echo(channel, b"many", buffers)
        if self.capabilities.writable_buffers:
            assert not any(memoryview(b).cast("B").readonly for b in response.buffers)

    def test_multi_megabyte_buffers(self, channel):
        self._echo(channel, b"mb", [_payload(5 * _MiB + 3, 1), b"tail", _payload(9 * _MiB, 2)])

    def test_256_mib_frame(self, channel):
        if not self.capabilities.large_frames:
            pytest.skip(f"{self.protocol} does not carry large frames")
        self._echo(channel, b"big", [_payload(256 * _MiB, 3)], timeout=120)

    # -- concurrency, deadlines, cancellation ----------------------------------------

    def test_concurrent_calls_from_many_threads(self, channel):
        failures: list[BaseException] = []

        def worker(seed: int) -> None:
            try:
                for i in range(20):
                    self._echo(channel, f"t{seed}-{i}".encode(), [_payload(1000 + i, seed)])
            except BaseException as err:  # collected and reported below
                failures.append(err)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not failures, failures[:3]

    def test_deadline(self, channel):
        started = time.monotonic()
        with pytest.raises(errors.DeadlineExceededError):
            channel.call(Frame(SLEEP + b"3", []), timeout=0.3)
        assert time.monotonic() - started < 2.5
        self._echo(channel, b"after", [b"x"])

    def test_close_cancels_calls_in_flight(self, transport):
        listener, entered = self._blocking_listener(transport)
        channel = transport.connect(listener.address)
        caller, outcome = _call_in_background(channel, Frame(b"block", []), 30)
        assert entered.wait(10)
        started = time.monotonic()
        channel.close()
        caller.join(10)
        listener.stop(0)
        assert not caller.is_alive()
        assert outcome and isinstance(outcome[0], (errors.CancelledError,
                                                   errors.UnavailableError))
        assert time.monotonic() - started < 2.5
        with pytest.raises((errors.CancelledError, errors.UnavailableError)):
            channel.call(Frame(b"closed", []), timeout=5)

    def test_handler_failure_is_an_error_not_a_crash(self, channel):
        with pytest.raises(errors.OpError):
            channel.call(Frame(FAIL, []), timeout=10)
        self._echo(channel, b"still", [b"serving"])

    # -- failures of the peer --------------------------------------------------------

    def test_connect_to_a_closed_port(self, transport):
        with socket.socket() as probe:
            probe.bind((self.host, 0))
            port = probe.getsockname()[1]
        channel = transport.connect(f"{self.host}:{port}")
        started = time.monotonic()
        try:
            with pytest.raises(errors.UnavailableError):
                channel.call(Frame(b"x", []), timeout=5)
        finally:
            channel.close()
        assert time.monotonic() - started < 6

    def test_peer_in_another_process(self, transport, peer):
        channel = transport.connect(peer.address)
        try:
            self._echo(channel, b"cross", [_payload(3 * _MiB)])
        finally:
            channel.close()

    def test_peer_killed_mid_transfer(self, transport, peer):
        channel = transport.connect(peer.address)
        caller, outcome = _call_in_background(
            channel, Frame(ANNOUNCE + str(256 * _MiB).encode(), []), 20)
        peer.wait_for("ENTERED", 30)
        peer.proc.send_signal(signal.SIGKILL)
        caller.join(25)
        channel.close()
        assert not caller.is_alive()
        assert outcome and isinstance(outcome[0], (errors.UnavailableError,
                                                   errors.AbortedError,
                                                   errors.CancelledError)), outcome

    def test_client_with_descriptors_over_1023(self, listener):
        # select() cannot wait on a descriptor over 1023; a busy process has such ones.
        if not self.capabilities.cross_process:
            pytest.skip(f"{self.protocol} has no channels in other processes")
        done = subprocess.run(
            [sys.executable, "-c", _HIGH_DESCRIPTORS_CLIENT, self.protocol, listener.address],
            capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        if done.stdout.startswith("SKIP"):
            pytest.skip(f"cannot raise the descriptor limit: {done.stdout.strip()}")
        assert done.stdout.startswith("OK"), done.stdout

    def test_stop_with_calls_in_flight(self, transport):
        listener, entered = self._blocking_listener(transport)
        channel = transport.connect(listener.address)
        caller, outcome = _call_in_background(channel, Frame(b"block", []), 30)
        assert entered.wait(10)
        started = time.monotonic()
        listener.stop(0.2)
        caller.join(15)
        channel.close()
        assert not caller.is_alive() and outcome
        # The contract: CancelledError (the call did not run to its end; not Unavailable,
        # which would invite a retry), and a stop bounded by its grace.
        allowed = errors.CancelledError if self.capabilities.cancels_on_stop else (
            errors.CancelledError, errors.UnavailableError)
        assert isinstance(outcome[0], allowed), outcome
        assert time.monotonic() - started < 3

    # -- limits and malformed input ---------------------------------------------------

    def test_oversized_frame_is_resource_exhausted(self, transport):
        listener = self._listen(transport, options=ListenOptions(max_message_bytes=_MiB))
        channel = transport.connect(listener.address)
        try:
            with pytest.raises(errors.ResourceExhaustedError):
                channel.call(Frame(b"big", [_payload(2 * _MiB)]), timeout=30)
            self._echo(channel, b"fits", [_payload(_MiB // 2)])
        finally:
            channel.close()
            listener.stop(0)

    def test_raw_garbage_does_not_take_the_listener_down(self, transport, listener):
        if not self.capabilities.raw_tcp_port:
            pytest.skip(f"{self.protocol} has no raw TCP port")
        host, port = listener.address.rsplit(":", 1)
        for payload in (b"\x00" * 100, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 64,
                        b"\xff" * 70000):
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as sock:
                sock.sendall(payload)
        channel = transport.connect(listener.address)
        try:
            self._echo(channel, b"after garbage", [b"ok"])
        finally:
            channel.close()

    # -- abuse: silent connections, frames in many parts, trickled uploads ------------

    def unix_endpoint(self, listener: Listener) -> tuple[int, str] | None:
        """(socket type, address) of a Unix socket the listener serves beside its port, if
        any: the flood checks also run against it. Override for such a transport."""
        return None

    def _flood_target(self, listener: Listener, path: str) -> tuple[int, int, object]:
        """(family, socket type, address) of the listener's TCP port or Unix socket."""
        if path == "unix":
            endpoint = self.unix_endpoint(listener)
            if endpoint is None:
                pytest.skip(f"{self.protocol} serves no Unix socket")
            return (socket.AF_UNIX, *endpoint)
        if not self.capabilities.raw_tcp_port:
            pytest.skip(f"{self.protocol} has no raw TCP port")
        host, port = listener.address.rsplit(":", 1)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return family, socket.SOCK_STREAM, (host.strip("[]"), int(port))

    def _small_call_under(self, listener: Listener, path: str) -> tuple[SilentFlood, float]:
        """Let an unauthenticated peer hold ``_FLOOD`` silent connections to the listener,
        then time a token holder's fresh 8-byte call (from another process)."""
        target = self._flood_target(listener, path)
        require_descriptors(4 * _FLOOD + 4096)  # both ends are in this process
        holder = _TokenHolder(self.protocol, listener.address, _TOKEN)
        try:
            flood = SilentFlood(_FLOOD, *target)
            try:
                return flood, holder.call()
            except BaseException:
                flood.close()
                raise
        finally:
            holder.close()

    @pytest.mark.parametrize("path", ["tcp", "unix"])
    def test_silent_connections_close_at_the_handshake_deadline(self, transport, path):
        if not (self.capabilities.token_auth and self.capabilities.cross_process):
            pytest.skip(f"{self.protocol} checks no token or has no other-process channels")
        options = ListenOptions(security=Security(token=_TOKEN), handshake_timeout_seconds=0.5)
        listener = self._listen(transport, options=options)
        try:
            flood, seconds = self._small_call_under(listener, path)
            try:
                assert seconds < _SMALL_CALL_BUDGET, (
                    f"a token holder's call took {seconds:.3f} s under {_FLOOD} silent "
                    "connections")
                wait_for(lambda: flood.closed() == _FLOOD,
                          options.handshake_timeout_seconds + _CLOSE_SLACK,
                          f"the listener closing {_FLOOD} silent connections")
            finally:
                flood.close()
        finally:
            listener.stop(0)

    @pytest.mark.parametrize("path", ["tcp", "unix"])
    def test_silent_connection_flood_closes_the_oldest(self, transport, path):
        if not (self.capabilities.token_auth and self.capabilities.cross_process):
            pytest.skip(f"{self.protocol} checks no token or has no other-process channels")
        if path == "tcp" and not self.capabilities.evicts_oldest_pending_tcp:
            pytest.skip(f"{self.protocol} cannot close a chosen pending TCP connection")
        options = ListenOptions(security=Security(token=_TOKEN), handshake_timeout_seconds=60)
        listener = self._listen(transport, options=options)
        try:
            flood, seconds = self._small_call_under(listener, path)
            try:
                assert seconds < _SMALL_CALL_BUDGET, (
                    f"a token holder's call took {seconds:.3f} s while {_FLOOD} silent "
                    "connections were held")
                evicted = _FLOOD - options.max_pending_connections
                wait_for(lambda: flood.closed() >= evicted, _CLOSE_SLACK,
                          f"the listener closing the {evicted} oldest silent connections")
                assert not peer_closed(flood.sockets[-1]), "the newest one was closed"
            finally:
                flood.close()
        finally:
            listener.stop(0)

    def test_oversized_frame_in_many_buffers_is_resource_exhausted(self, transport):
        listener = self._listen(transport, options=ListenOptions(max_message_bytes=_MiB))
        channel = transport.connect(listener.address)
        try:
            # Every buffer fits the limit; together they do not (large ones, and small ones
            # that ride the control path).
            for buffers in ([_payload(64 << 10, n) for n in range(32)],
                            [_payload(512, n) for n in range(4096)]):
                with pytest.raises(errors.ResourceExhaustedError):
                    channel.call(Frame(b"parts", buffers), timeout=30)
            self._echo(channel, b"fits", [_payload(64 << 10, n) for n in range(8)])
        finally:
            channel.close()
            listener.stop(0)

    def test_trickled_uploads_do_not_starve_small_calls(self, transport):
        if not (self.capabilities.trickle_via_proxy and self.capabilities.token_auth):
            pytest.skip(f"{self.protocol}'s request bytes cannot be slowed by a TCP proxy")
        listener = self._listen(transport, options=ListenOptions(security=Security(token=_TOKEN)))
        proxy = TrickleProxy(listener.address)
        uploads = [transport.connect(proxy.address, Security(token=_TOKEN)) for _ in range(16)]
        callers = []
        try:
            for upload in uploads:
                callers.append(_call_in_background(upload, Frame(b"up", [_payload(4 * _MiB)]),
                                                   120)[0])
            wait_for(lambda: proxy.trickling(len(uploads)), 60,
                      "16 uploads being trickled through the proxy")
            assert all(caller.is_alive() for caller in callers), "an upload ended early"
            small = transport.connect(listener.address, Security(token=_TOKEN))
            try:
                for i in range(5):
                    started = time.monotonic()
                    self._echo(small, b"small-%d" % i, [b"8 bytes!"], timeout=10)
                    seconds = time.monotonic() - started
                    assert seconds < _SMALL_CALL_BUDGET, (
                        f"a small call took {seconds:.3f} s beside 16 trickled uploads")
            finally:
                small.close()
        finally:
            for upload in uploads:
                upload.close()
            for caller in callers:
                caller.join(30)
            proxy.close()
            listener.stop(0)

    # -- peers: who sent a request (Frame.peer, the servers' fair shares) ---------------

    def _own_peer(self) -> str:
        return self.host.strip("[]") if self.capabilities.peers == "ip" else \
            f"uid:{os.getuid()}"

    def test_the_handler_sees_the_client_as_its_peer(self, channel):
        reply = channel.call(Frame(PEER, []), timeout=30)
        assert bytes(reply.header).decode() == self._own_peer()

    def test_a_client_of_another_peer_is_told_apart(self, transport, listener):
        if self.capabilities.peers == "uid":
            self._check_another_user(listener)
            return
        if self.host != "127.0.0.1":
            pytest.skip("the other peer is 127.0.0.2, beside a listener on 127.0.0.1")
        proxy = TrickleProxy(listener.address, burst=1 << 62, source=_OTHER_PEER)
        channel = transport.connect(proxy.address)
        try:
            seen = [bytes(channel.call(Frame(PEER, []), timeout=30).header).decode()
                    for _ in range(2)]
            mine = self._echo_peer(transport, listener)
        finally:
            channel.close()
            proxy.close()
        assert seen == [_OTHER_PEER] * 2 and mine == self._own_peer()

    @staticmethod
    def _echo_peer(transport: Transport, listener: Listener) -> str:
        channel = transport.connect(listener.address)
        try:
            return bytes(channel.call(Frame(PEER, []), timeout=30).header).decode()
        finally:
            channel.close()

    def _check_another_user(self, listener: Listener) -> None:
        if os.geteuid() != 0:
            pytest.skip("a client of another user needs the kit to run as root")
        done = subprocess.run(
            [sys.executable, "-c", _OTHER_USER_CLIENT, self.protocol, listener.address,
             str(_OTHER_UID)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.split() == [self._own_peer(), f"uid:{_OTHER_UID}"], done.stdout

    # -- security ----------------------------------------------------------------------

    def _secure_pair(self, transport, listen: Security, connect: Security):
        listener = self._listen(transport, options=ListenOptions(security=listen))
        return listener, transport.connect(listener.address, connect)

    def test_token_is_required_and_checked(self, transport):
        if not self.capabilities.token_auth:
            pytest.skip(f"{self.protocol} does not check tokens")
        token = b"k" * 32
        listener = self._listen(transport, options=ListenOptions(security=Security(token=token)))
        try:
            for presented in (None, b"x" * 32):
                channel = transport.connect(listener.address, Security(token=presented))
                try:
                    with pytest.raises(errors.UnauthenticatedError):
                        channel.call(Frame(b"no", [_payload(_MiB)]), timeout=10)
                finally:
                    channel.close()
            channel = transport.connect(listener.address, Security(token=token))
            try:
                self._echo(channel, b"yes", [_payload(_MiB)])
            finally:
                channel.close()
        finally:
            listener.stop(0)

    @pytest.fixture(scope="class")
    @classmethod
    def authority(cls, tmp_path_factory):
        pytest.importorskip("cryptography")
        from clusterwire.testing.certs import Authority

        return Authority(tmp_path_factory.mktemp("pki"))

    def _tls(self, authority, pair=None, client_auth=False, ca=True) -> TlsConfig:
        return TlsConfig(
            certificate_chain=pair.cert.read_bytes() if pair else None,
            private_key=pair.key.read_bytes() if pair else None,
            root_certificates=authority.pair.cert.read_bytes() if ca else None,
            require_client_auth=client_auth)

    def test_tls(self, transport, authority):
        if not self.capabilities.tls:
            pytest.skip(f"{self.protocol} does not speak TLS")
        server = self._tls(authority, authority.issue("server"), ca=False)
        listener = self._listen(transport, options=ListenOptions(security=Security(tls=server)))
        try:
            good = transport.connect(listener.address, Security(tls=self._tls(authority)))
            try:
                self._echo(good, b"tls", [_payload(2 * _MiB)])
            finally:
                good.close()
            started = time.monotonic()
            plain = transport.connect(listener.address, Security())
            try:
                with pytest.raises((errors.UnavailableError, errors.UnauthenticatedError)):
                    plain.call(Frame(b"plain", []), timeout=20)
            finally:
                plain.close()
            assert time.monotonic() - started < 15, "a plaintext client must fail, not hang"
        finally:
            listener.stop(0)

    def test_tls_refuses_a_certificate_from_another_authority(self, transport, authority,
                                                              tmp_path):
        if not self.capabilities.tls:
            pytest.skip(f"{self.protocol} does not speak TLS")
        from clusterwire.testing.certs import Authority

        stranger = Authority(tmp_path, "stranger CA")
        server = self._tls(stranger, stranger.issue("server"), ca=False)
        listener = self._listen(transport, options=ListenOptions(security=Security(tls=server)))
        try:
            channel = transport.connect(listener.address, Security(tls=self._tls(authority)))
            try:
                with pytest.raises(errors.UnauthenticatedError):
                    channel.call(Frame(b"x", []), timeout=20)
            finally:
                channel.close()
        finally:
            listener.stop(0)

    def test_mutual_tls(self, transport, authority):
        if not self.capabilities.tls:
            pytest.skip(f"{self.protocol} does not speak TLS")
        server = self._tls(authority, authority.issue("server"), client_auth=True)
        listener = self._listen(transport, options=ListenOptions(security=Security(tls=server)))
        try:
            client = self._tls(authority, authority.issue("client"))
            channel = transport.connect(listener.address, Security(tls=client))
            try:
                self._echo(channel, b"mtls", [b"ok"])
            finally:
                channel.close()
            anonymous = transport.connect(listener.address, Security(tls=self._tls(authority)))
            try:
                with pytest.raises((errors.UnavailableError, errors.UnauthenticatedError)):
                    anonymous.call(Frame(b"x", []), timeout=20)
            finally:
                anonymous.close()
        finally:
            listener.stop(0)

    # -- addresses --------------------------------------------------------------------

    def test_port_zero_gives_a_contact_address(self, listener):
        host, port = listener.address.rsplit(":", 1)
        assert host == self.host and int(port) > 0

    def test_busy_port_is_unavailable(self, transport, listener):
        with pytest.raises(errors.UnavailableError):
            transport.listen(listener.address, echo_handler, ListenOptions())

    def test_stop_frees_the_port(self, transport):
        listener = self._listen(transport)
        listener.stop(0)
        again = transport.listen(listener.address, echo_handler, ListenOptions())
        again.stop(0)

    def test_stop_right_after_start_fails_no_thread(self, transport):
        # A thread the listener started must not trip over what stop() already closed.
        failures: list[BaseException | None] = []
        previous, before = threading.excepthook, set(threading.enumerate())
        threading.excepthook = lambda args: failures.append(args.exc_value)
        try:
            for _ in range(30):
                self._listen(transport).stop(0)
            deadline = time.monotonic() + 1  # those that end, end at once; pools stay
            for thread in set(threading.enumerate()) - before:
                thread.join(max(deadline - time.monotonic(), 0))
        finally:
            threading.excepthook = previous
        assert not failures, failures

    # -- through Server and Session ------------------------------------------------

    def test_server_and_session(self):
        with Server({"w": [f"{self.host}:0"]}, protocol=self.protocol) as server:
            assert server.target.startswith(f"{self.protocol}://")
            with Session(server.target) as session:
                array = np.arange(1000, dtype=np.float32).reshape(10, 100)
                session.put("a", array)
                np.testing.assert_array_equal(session.get("a"), array)
                assert session.status()["protocol"] == self.protocol

    def test_three_process_cluster(self):
        if not (self.capabilities.cluster and self.capabilities.cross_process):
            pytest.skip(f"{self.protocol} does not run multi-process clusters")
        with LocalCluster({"ps": 1, "worker": 2}, protocol=self.protocol, host=self.host
                          ) as cluster, Session(cluster.target("worker", 0)) as session:
            value = _payload(6 * _MiB, 9)
            for task in ("/job:ps/task:0", "/job:worker/task:1"):
                session.put("v", value, task=task)
                assert np.array_equal(session.get("v", task=task), value)
                assert session.status(task=task)["protocol"] == self.protocol
