"""Baselines for bench_session.py: raw TCP sockets and bare grpcio, no clusterwire.

Each baseline server runs in its own process::

    python bench/_baselines.py --role tcp|grpc --blob-bytes N [--chunk-bytes C]

binds port 0 on 127.0.0.1, prints ``PORT <n>`` on stdout and serves until its
stdin closes (so it also exits if the benchmark dies) or it gets SIGTERM. The
blob it serves is ``blob(N)``, so the client can check it byte for byte.

* TCP: one connection at a time, TCP_NODELAY on both ends. ``P`` + 8 bytes is
  answered with those 8 bytes; ``B`` + 8 bytes with the N-byte blob.
* gRPC: a generic handler with identity (de)serializers (raw bytes, no
  protobuf): ``Echo`` (unary_unary, returns its request), ``Blob`` (one
  unary_unary message of N bytes) and ``BlobStream`` (unary_stream of
  pre-cut ``chunk_bytes`` messages). A 16-thread pool, like clusterwire's server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent import futures

import numpy as np

HOST = "127.0.0.1"
SERVICE = "bench.Baseline"
REGISTERED_SERVICE = "bench.RegisteredBaseline"
_SEED = 20240601


def blob(nbytes: int) -> bytes:
    """The deterministic payload every blob server sends (pseudo-random bytes)."""
    return np.random.default_rng(_SEED).bytes(nbytes)


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    filled, total = 0, view.nbytes
    while filled < total:
        received = sock.recv_into(view[filled:], min(total - filled, 4 << 20))
        if not received:
            raise ConnectionError(f"peer closed after {filled} of {total} bytes")
        filled += received


# ----------------------------------------------------------------------------- servers


def _serve_tcp(payload: bytes) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((HOST, 0))
    listener.listen(4)
    print(f"PORT {listener.getsockname()[1]}", flush=True)
    data = memoryview(payload)
    request = bytearray(9)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                while True:
                    _recv_exact_into(conn, memoryview(request))
                    if request[0:1] == b"P":
                        conn.sendall(request[1:])
                    else:
                        conn.sendall(data)
            except (ConnectionError, OSError):
                continue


def _serve_grpc(payload: bytes, chunk_bytes: int) -> None:
    import grpc

    pieces = [payload[i:i + chunk_bytes] for i in range(0, len(payload), chunk_bytes)]

    def echo(request: bytes, _context) -> bytes:
        return request

    def whole(_request: bytes, _context) -> bytes:
        return payload

    def stream(_request: bytes, _context):
        yield from pieces

    server = grpc.server(
        futures.ThreadPoolExecutor(16),
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", -1),
                 ("grpc.max_send_message_length", -1)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Blob": grpc.unary_unary_rpc_method_handler(whole),
        "BlobStream": grpc.unary_stream_rpc_method_handler(stream),
    })])
    # What grpc_tools generates since grpcio 1.63 (and clusterwire's transports use).
    server.add_registered_method_handlers(REGISTERED_SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo)})
    port = server.add_insecure_port(f"{HOST}:0")
    server.start()
    print(f"PORT {port}", flush=True)
    threading.Event().wait()


def exit_with_parent() -> None:
    """Exit this server process when its parent closes our stdin (or dies) or on SIGTERM."""

    def watch_stdin() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch_stdin, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))


def _server_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["tcp", "grpc"], required=True)
    parser.add_argument("--blob-bytes", type=int, required=True)
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    args = parser.parse_args(argv)

    exit_with_parent()
    payload = blob(args.blob_bytes)
    if args.role == "tcp":
        _serve_tcp(payload)
    else:
        _serve_grpc(payload, args.chunk_bytes)


# ----------------------------------------------------------------------------- clients


class ServerProcess:
    """A baseline server subprocess; ``port`` is its bound port. A context manager."""

    def __init__(self, role: str, blob_bytes: int, chunk_bytes: int = 1 << 20,
                 timeout: float = 30.0):
        command = [sys.executable, os.path.abspath(__file__), "--role", role,
                   "--blob-bytes", str(blob_bytes), "--chunk-bytes", str(chunk_bytes)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        try:
            found: list[int] = []

            def read() -> None:
                line = self.proc.stdout.readline()  # type: ignore[union-attr]
                if line.startswith("PORT "):
                    found.append(int(line.split()[1]))

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(timeout)
            if not found:
                raise RuntimeError(f"baseline {role} server did not start "
                                   f"(exit code {self.proc.poll()})")
            self.port = found[0]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the server and reap it (idempotent)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream and not stream.closed:
                stream.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class TcpClient:
    """Raw TCP client of the ``tcp`` server (TCP_NODELAY)."""

    def __init__(self, port: int):
        self.sock = socket.create_connection((HOST, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reply = bytearray(8)
        self._reply_view = memoryview(self._reply)

    def ping(self, payload: bytes) -> bytearray:
        """Send 8 bytes, receive them back."""
        self.sock.sendall(b"P" + payload)
        _recv_exact_into(self.sock, self._reply_view)
        return self._reply

    def fetch_blob(self, out: memoryview) -> None:
        """Receive the whole blob into the preallocated ``out``."""
        self.sock.sendall(b"B" + bytes(8))
        _recv_exact_into(self.sock, out)

    def close(self) -> None:
        self.sock.close()


class GrpcClient:
    """Bare grpcio client of the ``grpc`` server (raw bytes, no serializers)."""

    def __init__(self, port: int):
        import grpc

        self.channel = grpc.insecure_channel(f"{HOST}:{port}", options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.echo = self.channel.unary_unary(f"/{SERVICE}/Echo")
        self.echo_registered = self.channel.unary_unary(f"/{REGISTERED_SERVICE}/Echo",
                                                        _registered_method=True)
        self.blob = self.channel.unary_unary(f"/{SERVICE}/Blob")
        self._stream = self.channel.unary_stream(f"/{SERVICE}/BlobStream")

    def blob_stream_into(self, out: memoryview) -> None:
        """Receive the blob as a chunk stream into the preallocated ``out``."""
        filled = 0
        for chunk in self._stream(b""):
            out[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
        if filled != out.nbytes:
            raise RuntimeError(f"stream delivered {filled} of {out.nbytes} bytes")

    def close(self) -> None:
        self.channel.close()


if __name__ == "__main__":
    _server_main(sys.argv[1:])
