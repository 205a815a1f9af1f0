"""grpc+local's reply segment pool (transports/local/pool.py): reuse, bounds, the seals.

A listener's call connection packs replies into reusable segments and refills one only once
its client released it. The checks run a listener and a channel of this process (the
channel always takes the Unix call connections, see test_local_unix_calls), and a client
process for what happens when a client dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import mmap
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import child_env, end_child, wait_for

from clusterwire import errors
from clusterwire.envelope import BULK
from clusterwire.transport import Frame, ListenOptions
from clusterwire.transports.local import pool, sealed, unix, wire
from clusterwire.transports.local.calls import CallConnection
from clusterwire.transports.local.transport import LocalTransport

MiB = 1 << 20


def filled(frame: Frame) -> Frame:
    """The handler: a reply of ``size`` MiB (the request's header, "size:value"), every byte
    ``value``: a fresh buffer each time, so it is packed into a segment."""
    size, value = (int(part) for part in bytes(frame.header).split(b":"))
    return Frame(b"ok", [np.full(size * MiB, value, np.uint8)])


@pytest.fixture(autouse=True)
def short_linger(monkeypatch):
    """Pools without connections close after 0.3 s here (10 s by default)."""
    monkeypatch.setattr(pool, "LINGER_S", 0.3)


@pytest.fixture
def serve() -> Iterator:
    """serve(**transport options) -> (listener, channel) over a call connection."""
    opened = []

    def start(**options):
        transport = LocalTransport(options)
        listener = transport.listen("127.0.0.1:0", filled, ListenOptions())
        listener.start()
        channel = transport.connect(listener.address)
        opened.append((listener, channel))
        return listener, channel

    yield start
    for listener, channel in opened:
        channel.close()
        listener.stop(0)


def call(channel, size: int, value: int) -> np.ndarray:
    reply = channel.call(Frame(f"{size}:{value}".encode(), []), timeout=30)
    array = reply.buffers[0]
    assert array.nbytes == size * MiB and array[0] == value and array[-1] == value
    return array


def leased(array: np.ndarray) -> sealed.LeasedMapping:
    """The leased mapping a received array lies in."""
    base = array
    while not isinstance(base, sealed.LeasedMapping):
        base = base.obj if isinstance(base, memoryview) else base.base
    return base


def pool_of(listener):
    """The reply pool of this process's call connections to ``listener`` (they share one)."""
    pools = {id(c._pool): c._pool for c in listener._connections
             if isinstance(c, CallConnection)}
    assert len(pools) == 1
    return next(iter(pools.values()))


def test_replies_reuse_the_connections_segments(serve):
    listener, channel = serve()
    for value in range(50):
        call(channel, 2, value)  # dropped at once: released before the next call
    pool = pool_of(listener)
    assert (pool.reused, pool.fresh) == (50, 0)
    assert pool.nbytes == 2 * MiB  # one segment served all 50


def test_the_next_connections_of_a_process_find_its_segments(serve):
    listener, channel = serve()
    held = call(channel, 2, 1)
    call(channel, 2, 2)  # a second segment: the first is held
    del held
    gc.collect()
    call(channel, 2, 3)  # releases both, refills one
    first = pool_of(listener)
    channel.close()  # an epoch ends: its connections close
    wait_for(lambda: listener.connections() == 0, 30, "the closed channel's connection")
    # The segment the last reply went in was not released on that connection: closed, never
    # refilled. The other waits for the process's next connections.
    assert not first._used and len(first._free) == 1 and first.nbytes == 2 * MiB
    waiting = set(first._free)
    later = listener._transport.connect(listener.address)  # the next epoch's
    try:
        call(later, 2, 7)
        assert pool_of(listener) is first and set(first._used) == waiting
        assert (first.reused, first.fresh, first.nbytes) == (4, 0, 2 * MiB)
    finally:
        later.close()
    # Without connections the pool closes after LINGER_S (its descriptors with it).
    wait_for(lambda: pool_descriptors() == 0, 30, "the idle pool closed")
    assert first.nbytes == 0


def test_a_segment_is_not_refilled_while_a_view_of_it_lives(serve):
    listener, channel = serve(reply_pool_bytes=3 * MiB)  # room for one 3 MiB segment
    held = call(channel, 3, 1)
    mapping = leased(held)
    private = np.frombuffer(mapping.clusterwire_private_map(0, MiB), np.uint8)
    for value in range(2, 12):
        call(channel, 3, value)
    pool = pool_of(listener)
    assert pool.fresh == 10  # the held segment was never refilled ...
    assert np.all(held == 1) and np.all(private == 1)
    private[:] = 7  # ... and a private copy-on-write view writes only its own pages
    assert np.all(held == 1)
    del held, mapping
    gc.collect()
    call(channel, 3, 20)  # the private view still holds the lease
    assert pool.fresh == 11 and np.all(private == 7)
    del private
    gc.collect()
    call(channel, 3, 21)
    call(channel, 3, 22)
    assert pool.reused == 3  # the first, then twice after the release


def test_a_client_that_never_releases_pins_at_most_the_limit(serve):
    listener, channel = serve(reply_pool_bytes=8 * MiB)
    held = [call(channel, 2, value) for value in range(20)]
    pool = pool_of(listener)
    assert pool.nbytes == 8 * MiB and (pool.reused, pool.fresh) == (4, 16)
    assert [int(array[0]) for array in held] == list(range(20))  # nothing overwritten
    assert all(np.all(array == value) for value, array in enumerate(held))
    held.clear()
    gc.collect()
    call(channel, 2, 99)
    assert pool.reused == 5 and pool.nbytes == 8 * MiB


def test_the_client_can_neither_write_nor_resize_a_reply_segment(serve):
    _, channel = serve()
    array = call(channel, 1, 5)
    fd = os.dup(leased(array).fd)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, MiB, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):  # F_SEAL_SEAL: no seal can be added either
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # a new open file is no help
        try:
            with pytest.raises(PermissionError):
                os.pwrite(reopened, b"x", 0)
        finally:
            os.close(reopened)
    finally:
        os.close(fd)
    assert np.all(array == 5)


def test_a_reply_segment_is_not_re_sent_by_descriptor(serve):
    _, channel = serve()
    array = call(channel, 1, 3)
    assert sealed.locate(array) is None  # a forwarded reply is copied into a segment of its own


def test_a_listener_refuses_a_reusable_segment_in_a_request(serve):
    listener, _ = serve()
    fd, writable = sealed.create_reusable(MiB, [], [])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    try:
        sock.connect(unix.socket_name(listener.address))
        sock.send(wire.encode_unix(wire.CALLS, 1, 0))
        assert wire.decode_unix(sock.recv(4096))[0] == wire.READY
        message = wire.LAYOUT.encode((0, 7), b"1:1", [memoryview(writable)], [BULK], [(0, 0)])
        socket.send_fds(sock, [message], [fd])
        op, ident, _, payload = wire.decode_unix(sock.recv(4096))
        code, text = wire.decode_error(payload)
        assert (op, ident, code) == (wire.ERROR, 7, errors.INVALID_ARGUMENT)
        assert "not sealed against writes" in text
    finally:
        sock.close()
        writable.close()
        os.close(fd)


def test_a_malformed_release_closes_only_its_connection(serve):
    listener, channel = serve()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    try:
        sock.connect(unix.socket_name(listener.address))
        sock.send(wire.encode_unix(wire.CALLS, 1, 0))
        assert wire.decode_unix(sock.recv(4096))[0] == wire.READY
        sock.send(wire.encode_unix(wire.RELEASE, 0, 0, b"7 bytes"))
        assert sock.recv(4096) == b""  # closed
    finally:
        sock.close()
    call(channel, 1, 1)
    channel._pool._released.extend([1, 2, 3])  # inodes of no segment: ignored
    call(channel, 1, 2)
    assert pool_of(listener).reused == 2


CLIENT = """
import sys
from clusterwire.transport import Frame
from clusterwire.transports.local.transport import LocalTransport
channel = LocalTransport().connect(sys.argv[1])
held = [channel.call(Frame(b"4:%d" % value, []), timeout=30) for value in range(4)]
print("HOLDING", flush=True)
sys.stdin.read()
"""


def pool_descriptors() -> int:
    """Descriptors of this process open on reply pool segments."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            count += "memfd:clusterwire-pool" in os.readlink(f"/proc/self/fd/{fd}")
    return count


def test_the_segments_are_closed_when_the_client_dies(serve):
    listener, _ = serve()
    assert pool_descriptors() == 0
    child = subprocess.Popen([sys.executable, "-c", CLIENT, listener.address],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=child_env())
    try:
        assert child.stdout.readline().strip() == "HOLDING"
        pool = pool_of(listener)
        assert pool.nbytes == 16 * MiB
        # Two each, the pool's and its mmap's (the copies sent with the replies are closed
        # just after the send).
        wait_for(lambda: pool_descriptors() == 8, 30, "the 4 segments' own descriptors")
        child.kill()
        child.wait(30)
        wait_for(lambda: listener.connections() == 0, 30, "the dead client's connection")
        wait_for(lambda: pool_descriptors() == 0, 30, "the pool's descriptors closed")
        assert pool.nbytes == 0
    finally:
        end_child(child)
