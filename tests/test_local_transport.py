"""grpc+local: zero-copy in process, sealed shared memory across processes, nothing leaked."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from conftest import child_env

from clusterwire import Server, Session
from clusterwire.errors import UnavailableError, UnimplementedError
from clusterwire.local_cluster import LocalCluster
from clusterwire.transports.local import sealed, wire

MiB = 1 << 20


def shared_memory_of(pid: int | str = "self") -> list[str]:
    """The shared-memory files process ``pid`` maps or holds open: named (/dev/shm/...) and
    memfds ("/memfd:..."). A process's own, unlike /dev/shm's listing, which other work on
    the machine changes."""
    held = []
    with open(f"/proc/{pid}/maps") as maps:
        held += [fields[5] for fields in map(str.split, maps) if len(fields) == 6]
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return sorted(p for p in held if p.startswith(("/dev/shm/", "/memfd:")))


def named_shared_memory(pids: list[int | str]) -> set[str]:
    """The /dev/shm files the processes ``pids`` map or hold open (other libraries' too:
    UCX's, once a verbs test ran in this process)."""
    return {p for pid in pids for p in shared_memory_of(pid) if p.startswith("/dev/shm/")}


def our_segments() -> Counter[str]:
    """This process's mappings and descriptors of grpc+local's segments (memfds named
    clusterwire...)."""
    return Counter(p for p in shared_memory_of() if "clusterwire" in p)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def server():
    server = Server({"w": ["127.0.0.1:0"]}, protocol="grpc+local")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pair():
    """Two grpc+local tasks in their own processes."""
    with LocalCluster({"a": 1, "b": 1}, protocol="grpc+local", env=child_env(),
                      imports=["cw_test_functions"]) as cluster:
        yield cluster


def test_same_process_get_is_zero_copy_and_read_only(server):
    with Session(server.target) as session:
        session.put("x", np.arange(8 * MiB, dtype=np.uint8))
        first, second = session.get("x"), session.get("x")
    assert np.shares_memory(first, second)
    assert not first.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        first[0] = 1


def test_same_process_put_copies_writable_memory(server):
    array = np.zeros(MiB, np.uint8)
    with Session(server.target) as session:
        session.put("x", array)
        array[:] = 9  # the caller keeps mutating its own array
        assert session.get("x").sum() == 0
        small = np.ones(1024, np.uint8)
        small.flags.writeable = False
        session.put("small", small)  # small and immutable: shared, not copied
        assert np.shares_memory(session.get("small"), small)


def test_same_process_put_seals_large_values_once(server):
    frozen = np.ones(MiB, np.uint8)
    frozen.flags.writeable = False
    with Session(server.target) as session:  # in-process: LocalTransport.keep seals it ...
        session.put("frozen", frozen)
        first, again = session.get("frozen"), session.get("frozen")
    assert not np.shares_memory(first, frozen)
    assert sealed.locate(first) is not None and np.shares_memory(first, again)  # ... then shared


def test_cross_process_values_are_sealed_segments_shared_without_copies(pair):
    value = np.random.default_rng(0).standard_normal(4 * MiB)
    with Session(pair.target("a")) as session:
        session.put("v", value, task="/job:b/task:0")
        first = session.get("v", task="/job:b/task:0")
        again = session.get("v", task="/job:b/task:0")
    np.testing.assert_array_equal(first, value)
    assert sealed.locate(first) is not None and not first.flags.writeable
    (map_a, off_a), (map_b, off_b) = sealed.locate(first), sealed.locate(again)
    assert os.fstat(map_a.fd).st_ino == os.fstat(map_b.fd).st_ino  # the stored segment, re-sent
    assert off_a == off_b


def test_mixed_small_and_large_values_cross_process(pair):
    value = {"small": np.arange(10), "large": np.ones((512, 1024)), "text": "t", "b": b"xy"}
    with Session(pair.target("b")) as session:
        session.put("m", value, task="/job:a/task:0")
        result = session.get("m", task="/job:a/task:0")
        session.delete("m", task="/job:a/task:0")
    np.testing.assert_array_equal(result["large"], value["large"])
    assert result["small"].tolist() == list(range(10)) and result["b"] == b"xy"


def test_nothing_in_dev_shm_and_no_descriptor_leak(pair):
    pids = ["self", pair.process("a").pid, pair.process("b").pid]
    before_shm, before_fds = named_shared_memory(pids), open_fds()
    with Session(pair.target("a")) as session:
        for i in range(20):
            session.put("leak", np.full(MiB, i, np.uint8), task="/job:b/task:0")
            got = session.get("leak", task="/job:b/task:0")
            assert got[0] == i
            assert named_shared_memory(pids) <= before_shm  # segments are memfds: unnamed
            del got
        session.delete("leak", task="/job:b/task:0")
    gc.collect()
    assert open_fds() <= before_fds + 1


def test_segments_released_after_a_peer_is_killed():
    before = our_segments()
    with LocalCluster({"a": 1, "b": 1}, protocol="grpc+local", env=child_env(),
                      config={"peer_timeout_seconds": 2}) as cluster:
        with Session(cluster.target("a")) as session:
            session.put("v", np.ones(8 * MiB), task="/job:b/task:0")
            held = session.get("v", task="/job:b/task:0")
            victim = cluster.process("b")
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            with pytest.raises(UnavailableError):
                session.get("v", task="/job:b/task:0")
            assert held.sum() == 8 * MiB  # what we received stays valid
    del held
    gc.collect()
    assert our_segments() <= before


def test_server_stop_releases_everything(server):
    before = open_fds()
    with Session(server.target) as session:
        session.put("x", np.ones(2 * MiB))
    server.stop()
    gc.collect()
    assert open_fds() <= before
    assert not any("clusterwire" in p for p in named_shared_memory(["self"]))


def rogue_connect(target: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(f"\0clusterwire-local:{target.split('://')[1]}")
    return sock


def test_rogue_unix_client_cannot_take_the_server_down(server):
    for payload in (b"", b"garbage", b"\x00" * 17, wire.encode_unix(9, 1, 0)):
        with rogue_connect(server.target) as sock:
            sock.send(payload)
    with rogue_connect(server.target) as sock:  # descriptors that are not sealed memfds
        r, w = os.pipe()
        socket.send_fds(sock, [wire.encode_unix(wire.SEGMENTS, 1, 2)], [r, w])
        os.close(r)
        os.close(w)
    with Session(server.target) as session:
        session.put("ok", np.ones(MiB))
        assert session.get("ok").sum() == MiB


def test_unsealed_segment_is_refused():
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 16)
    with pytest.raises(Exception, match="not sealed"):
        sealed.open_segment(fd)


def test_a_server_of_another_protocol_is_a_clear_error():
    with Server({"w": ["127.0.0.1:0"]}, protocol="grpc") as plain:
        address = plain.target.split("://")[1]
        with Session(f"grpc+local://{address}", timeout=1) as session:
            with pytest.raises(UnimplementedError,
                               match=r"serves grpc, not the protocol .* use grpc://"):
                session.get("x")


def test_demo_runs_over_grpc_local():
    result = subprocess.run([sys.executable, "-m", "clusterwire", "demo", "--protocol",
                             "grpc+local", "--steps", "20"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verdict: OK" in result.stdout
