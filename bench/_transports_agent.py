"""Client agents of bench_transports.py: one process measures one path, on command.

    python bench/_transports_agent.py --spec JSON --reply-fd N

The spec names the kind of client (raw TCP, bare grpcio, bare pyzmq, bare
ucxx, numpy memcpy, a clusterwire Session to another process, a Session to a
grpc+local Server inside this process, or a bare clusterwire transport Channel)
and where its server is. The agent
connects, prepares its data (puts the tensors it will get), then answers JSON
commands read from stdin, one per line, on the reply descriptor (not stdout:
UCX may print there), one JSON object per line:

* ``warm n`` / ``lat n``: n 8-byte round trips (``lat`` returns each one's ns);
* ``check v``: one transfer of bulk variant v, checked byte for byte;
* ``bulk v n``: n timed transfers of variant v, back to back (seconds each);
* ``rate_setup threads`` then ``rate seconds``: 1 KiB calls by ``threads``
  threads, each with its own client (Session, grpcio channel, zmq socket), for
  ``seconds``; returns the calls made and the time they took.

Every path's 8-byte round trip returns the 8 bytes it sent: clusterwire paths
``Session.call`` an echo ``@remote`` function with an 8-byte uint8 array.
Bulk variants return the received bytes; the agent drops them before the next
command (a mapped grpc+local segment is unmapped then).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _baselines  # noqa: E402
import _transports_baselines as bare  # noqa: E402

MIB = 1 << 20
EIGHT = bytes(range(8))
KIB = bytes(range(256)) * 4
PAGE = 4096

Caller = tuple[Callable[[], Any], Callable[[], None]]  # (1 KiB call, close)


def _touch(array: np.ndarray) -> np.ndarray:
    """Read one byte of every page (what a reader of a lazily mapped buffer pays first)."""
    flat = np.frombuffer(array, np.uint8) if not isinstance(array, np.ndarray) else array
    np.add.reduce(flat.reshape(-1)[::PAGE], dtype=np.uint64)
    return array


class Path:
    """One client path: 8-byte round trip, bulk variants, 1 KiB callers."""

    def __init__(self) -> None:
        # variant -> (function returning the received bytes, expected size)
        self.variants: dict[str, tuple[Callable[[], Any], int]] = {}

    def call8(self) -> Any:
        raise NotImplementedError

    def check8(self, result: Any) -> bool:
        return bytes(np.asarray(result, np.uint8).reshape(-1)) == EIGHT if isinstance(
            result, np.ndarray) else bytes(result) == EIGHT

    def caller(self) -> Caller | None:
        return None

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class TcpPath(Path):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.client = _baselines.TcpClient(spec["port"])
        self.out = np.zeros(spec["nbytes"], np.uint8)  # preallocated, pages faulted in
        view = memoryview(self.out)

        def fetch():
            self.client.fetch_blob(view)
            return self.out

        self.variants["64M"] = (fetch, spec["nbytes"])

    def call8(self):
        return self.client.ping(EIGHT)

    def close(self):
        self.client.close()


class GrpcioPath(Path):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.port = spec["port"]
        self.client = _baselines.GrpcClient(self.port)
        self.out = np.zeros(spec["nbytes"], np.uint8)
        view = memoryview(self.out)

        def stream():
            self.client.blob_stream_into(view)
            return self.out

        self.variants["unary"] = (lambda: self.client.blob(b""), spec["nbytes"])
        self.variants["stream"] = (stream, spec["nbytes"])

    def call8(self):
        return self.client.echo(EIGHT)

    def caller(self) -> Caller:
        client = _baselines.GrpcClient(self.port)
        return (lambda: client.echo(KIB)), client.close

    def info(self):
        import grpc

        return {"grpcio": grpc.__version__}

    def close(self):
        self.client.close()


class PyzmqPath(Path):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.token = spec["token"]
        self.client = bare.PyzmqClient(self.token)
        self.variants["64M"] = (self.client.fetch_blob, spec["nbytes"])

    def call8(self):
        return self.client.echo(EIGHT)

    def caller(self) -> Caller:
        client = bare.PyzmqClient(self.token, self.client.context)
        return (lambda: client.echo(KIB)), client.close

    def info(self):
        import zmq

        return {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}

    def close(self):
        self.client.close()


class UcxxPath(Path):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.client = bare.UcxxClient(spec["token"], spec["nbytes"])
        self.variants["64M"] = (self.client.fetch_blob, spec["nbytes"])
        self.variants["64M-fresh"] = (self.client.fetch_blob_fresh, spec["nbytes"])

    def call8(self):
        return self.client.ping()

    def check8(self, result):
        return bytes(result) == b"P" + EIGHT[1:]

    def info(self):
        return {"UCX_TLS": os.environ.get("UCX_TLS", "all")}

    def close(self):
        self.client.close()


class MemcpyPath(Path):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        for size in spec["sizes"]:
            source = np.frombuffer(_baselines.blob(size), np.uint8)
            out = np.zeros(size, np.uint8)  # preallocated, pages faulted in

            def copy(source=source, out=out):
                np.copyto(out, source)
                return out

            self.variants[f"{size // MIB}M"] = (copy, size)

            def copy_fresh(source=source):
                out = np.empty(source.nbytes, np.uint8)
                np.copyto(out, source)
                return out

            if size == spec["nbytes"]:
                self.variants[f"{size // MIB}M-fresh"] = (copy_fresh, size)

    def call8(self):
        return EIGHT


class SessionPath(Path):
    """A clusterwire Session to ``target`` (or to a grpc+local Server in this process)."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        import _transports_remote as remote

        from clusterwire import Server, Session

        self.server = None
        if spec["kind"] == "inprocess":
            self.server = Server({"worker": ["127.0.0.1:0"]}, job_name="worker", task_index=0,
                                 protocol=spec["protocol"])
            self.target = self.server.target
        else:
            self.target = spec["target"]
        self._Session = Session
        self.echo = remote.ECHO
        self.session = Session(self.target)
        self.small = np.frombuffer(EIGHT, np.uint8).copy()
        self.kib = np.frombuffer(KIB, np.uint8).copy()
        for size in spec["sizes"]:
            name = f"{size // MIB}M"
            self.session.put(name, np.frombuffer(_baselines.blob(size), np.uint8).copy())
            self.variants[name] = (lambda name=name: self.session.get(name), size)
        if spec["kind"] == "inprocess":
            self.session.put("8B", np.frombuffer(_baselines.blob(8), np.uint8).copy())
            self.variants["8B"] = (lambda: self.session.get("8B"), 8)
        if spec.get("made"):
            size = spec["nbytes"]
            self.session.call(remote.STORE, self.target, "made", size)
            self.variants["made"] = (lambda: self.session.get("made"), size)
            self.variants["made+touch"] = (lambda: _touch(self.session.get("made")), size)
            self.variants["returned"] = (lambda: self.session.call(remote.RETURN, size), size)
            self.variants["64M+touch"] = (lambda: _touch(self.session.get("64M")), size)

    def call8(self):
        return self.session.call(self.echo, self.small)

    def caller(self) -> Caller:
        session = self._Session(self.target)
        return (lambda: session.call(self.echo, self.kib)), session.close

    def info(self):
        status = self.session.status()
        return {"protocol": status["protocol"], "transport": status["transport"],
                "UCX_TLS": os.environ.get("UCX_TLS")}

    def close(self):
        self.session.close()
        if self.server is not None:
            self.server.stop()


class ChannelPath(Path):
    """A clusterwire transport's Channel to an echo listener: no Session, no service."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        from clusterwire.plugins import get_plugin_manager
        from clusterwire.transport import Frame

        self.protocol = spec["protocol"]
        self.channel = get_plugin_manager().transport(self.protocol).connect(spec["token"])
        self.frame = Frame(b"echo", [np.frombuffer(EIGHT, np.uint8).copy()])

    def call8(self):
        return self.channel.call(self.frame, timeout=30.0).buffers[0]

    def close(self):
        self.channel.close()


KINDS = {"tcp": TcpPath, "grpcio": GrpcioPath, "pyzmq": PyzmqPath, "ucxx": UcxxPath,
         "memcpy": MemcpyPath, "session": SessionPath, "inprocess": SessionPath,
         "channel": ChannelPath}


class Rate:
    """``threads`` threads, each with its own client, calling for a given time on command."""

    def __init__(self, path: Path, threads: int) -> None:
        self.callers = []
        for _ in range(threads):
            caller = path.caller()
            if caller is None:
                raise RuntimeError("this path has no calls/s measurement")
            self.callers.append(caller)
        self._start = threading.Barrier(threads + 1)
        self._done = threading.Barrier(threads + 1)
        self._deadline = 0.0
        self._stop = False
        self.counts = [0] * threads
        self.ends = [0.0] * threads
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._work, args=(i,), daemon=True)
                        for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def _work(self, index: int) -> None:
        call = self.callers[index][0]
        clock = time.perf_counter
        while True:
            self._start.wait()
            if self._stop:
                return
            deadline, count = self._deadline, 0
            try:
                while clock() < deadline:
                    call()
                    count += 1
            except Exception as err:  # reported to the driver, which fails the run
                self.errors.append(f"{type(err).__name__}: {err}")
            self.counts[index], self.ends[index] = count, clock()
            self._done.wait()

    def run(self, seconds: float) -> tuple[int, float]:
        start = time.perf_counter()
        self._deadline = start + seconds
        self._start.wait()
        self._done.wait()
        if self.errors:
            raise RuntimeError("; ".join(self.errors[:3]))
        return sum(self.counts), max(self.ends) - start

    def close(self) -> None:
        self._stop = True
        self._start.wait()
        for thread in self.threads:
            thread.join(5)
        for _, close in self.callers:
            close()


def _same(result: Any, size: int, expected: dict[int, np.ndarray]) -> bool:
    if size not in expected:
        expected[size] = np.frombuffer(_baselines.blob(size), np.uint8)
    got = result if isinstance(result, np.ndarray) else np.frombuffer(result, np.uint8)
    got = got.reshape(-1).view(np.uint8)
    return got.nbytes == size and bool(np.array_equal(got, expected[size]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args()
    replies = os.fdopen(args.reply_fd, "w", buffering=1)

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")

    spec = json.loads(args.spec)
    try:
        path = KINDS[spec["kind"]](spec)
        result = path.call8()
        if not path.check8(result):
            raise AssertionError(f"8-byte round trip returned {result!r}")
        reply({"ok": True, "info": path.info(), "variants": sorted(path.variants)})
    except Exception:
        reply({"ok": False, "error": traceback.format_exc()})
        return
    rate: Rate | None = None
    expected: dict[int, np.ndarray] = {}
    clock = time.perf_counter_ns
    try:
        for line in sys.stdin:
            command = json.loads(line)
            op = command["op"]
            try:
                if op == "quit":
                    break
                if op in ("warm", "lat"):
                    call, samples = path.call8, []
                    for _ in range(command["n"]):
                        start = clock()
                        call()
                        samples.append(clock() - start)
                    reply({"ok": True, "ns": samples if op == "lat" else []})
                elif op == "check":
                    fn, size = path.variants[command["variant"]]
                    result = fn()
                    ok = _same(result, size, expected)
                    del result
                    reply({"ok": ok, "error": "" if ok else "wrong bytes"})
                elif op == "bulk":
                    fn, seconds = path.variants[command["variant"]][0], []
                    for _ in range(command.get("n", 1)):
                        start = time.perf_counter()
                        result = fn()
                        seconds.append(time.perf_counter() - start)
                        del result
                    reply({"ok": True, "seconds": seconds})
                elif op == "rate_setup":
                    rate = Rate(path, command["threads"])
                    rate.run(command.get("warm", 0.3))
                    reply({"ok": True})
                elif op == "rate":
                    calls, elapsed = rate.run(command["seconds"])  # type: ignore[union-attr]
                    reply({"ok": True, "calls": calls, "seconds": elapsed})
                else:
                    reply({"ok": False, "error": f"unknown op {op!r}"})
            except Exception:
                reply({"ok": False, "error": traceback.format_exc()})
    finally:
        if rate is not None:
            rate.close()
        path.close()


if __name__ == "__main__":
    main()
