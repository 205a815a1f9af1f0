"""A peer without the token flooding a server surface, in its own process (for the surface
kit, ``clusterwire.testing.surfaces``).

``python -m clusterwire.testing.hostile_peer`` reads commands on stdin, one a line, and
serves them one after the other until stdin closes (one process for many floods: starting
one costs more than most floods). ``KIND HOST:PORT COUNT`` raises its descriptor limit,
opens the flood and prints ``READY <connections open>``; the next line (any) ends the flood
and it prints ``DONE <connections opened in all>``. A flood that fails prints ``FAILED
<why>`` instead. KIND is one of ``floods.FLOODS``:

* ``silent``: COUNT connections that never send a byte;
* ``reconnecting``: COUNT connections kept open: every one the server closes is reopened at
  once, and the oldest sixteenth is closed and reopened every ``_CHURN_TICK_S``;
* ``garbage``: COUNT connections that each send ``_GARBAGE_BYTES`` random bytes, reopened
  when closed;
* ``h2_preface``: COUNT connections that send HTTP/2's client preface and an empty SETTINGS
  frame (what a gRPC client opens with), then nothing, reopened when closed;
* ``health_watch``: COUNT connections that each open a gRPC ``Health/Watch`` stream on the
  server's overall health (which stays open), reopened when closed;
* ``health_names``: COUNT gRPC ``Health/Watch`` streams opened one after the other, each on
  its own connection and on an invented service name of ``HEALTH_NAME_BYTES`` (what the
  server keeps of them adds up; what it only receives does not).

"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import threading
import time

from clusterwire.testing.floods import FLOODS, SilentFlood, raise_descriptor_limit

#: HTTP/2's connection preface and an empty SETTINGS frame.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
#: Length of a ``health_names`` stream's invented service name.
HEALTH_NAME_BYTES = 4 << 20
_GARBAGE_BYTES = 4096
_CHURN_TICK_S = 0.1
#: Seconds the flood may take to open its connections, and each connection: it reports
#: how many it holds once they are open, the time is up, or two rounds held no more than
#: before (the listener closes them as fast, or its backlog is full: a connect waits for
#: SYN retransmits then).
_OPEN_S = 15.0
_CONNECT_S = 0.2


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") \
        + payload


def _hpack_literal(name: str, value: str) -> bytes:
    """A header field literal without indexing, new name, no Huffman (lengths < 127)."""
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


#: The loopback address floods of a server on 127.0.0.1 come from.
_OTHER_LOOPBACK = "127.0.0.2"


def health_watch_greeting(authority: str) -> bytes:
    """The bytes of a gRPC client opening one ``Health/Watch`` stream on the server's
    overall health (service ""), which stays open while the server serves: HTTP/2's
    preface, SETTINGS, an ACK of the server's, HEADERS and the request's DATA."""
    headers = b"".join(_hpack_literal(name, value) for name, value in (
        (":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Watch"),
        (":authority", authority), ("content-type", "application/grpc"), ("te", "trailers")))
    request = b"\x00" + (0).to_bytes(4, "big")  # an uncompressed, empty HealthCheckRequest
    return (H2_PREFACE + _h2_frame(4, 1, 0, b"") + _h2_frame(1, 4, 1, headers)
            + _h2_frame(0, 1, 1, request))


def _connection_flood(kind: str, host: str, port: int, count: int,
                      stop: threading.Event) -> int:
    greeting = {"garbage": os.urandom(_GARBAGE_BYTES), "h2_preface": H2_PREFACE,
                "health_watch": health_watch_greeting(f"{host}:{port}")}.get(kind, b"")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # From another peer address, as an attacker on another host: one on the token holders'
    # own address competes with them for the pending slots (README, Reliability).
    source = (_OTHER_LOOPBACK, 0) if host == "127.0.0.1" else None
    flood = SilentFlood(count, family, socket.SOCK_STREAM, (host, port), greeting,
                        timeout=_CONNECT_S, fill=False, source=source)
    try:
        deadline, most, stalled = time.monotonic() + _OPEN_S, 0, 0
        while len(flood.sockets) < count and time.monotonic() < deadline and stalled < 2:
            flood.reopen()
            stalled = stalled + 1 if len(flood.sockets) <= most else 0
            most = max(most, len(flood.sockets))
        print("READY", len(flood.sockets), flush=True)
        churn = count // 16 if kind == "reconnecting" else 0
        while not stop.wait(_CHURN_TICK_S):
            if kind != "silent":
                flood.reopen(churn)
        return flood.connects
    finally:
        flood.close()


def _health_names_flood(host: str, port: int, count: int, stop: threading.Event) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channels = [grpc.insecure_channel(f"{host}:{port}", options=[
        ("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1)])
        for _ in range(count)]
    calls = []
    try:
        name = "x" * HEALTH_NAME_BYTES
        for index, channel in enumerate(channels):  # one after the other (see FLOODS)
            request = health_pb2.HealthCheckRequest(service=f"{name}{index}")
            calls.append(health_pb2_grpc.HealthStub(channel).Watch(request))
            with contextlib.suppress(grpc.RpcError, StopIteration):
                next(calls[-1])  # its first answer, or its end
        print("READY", len(calls), flush=True)
        stop.wait()
        return len(channels)
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()


def _flood(kind: str, address: str, count: int, stop: threading.Event) -> None:
    try:
        if kind not in FLOODS:
            raise ValueError(f"unknown flood {kind!r}; one of {', '.join(FLOODS)}")
        host, port = address.rsplit(":", 1)
        raise_descriptor_limit(count + 256)
        run = _health_names_flood if kind == "health_names" else functools.partial(
            _connection_flood, kind)
        print("DONE", run(host.strip("[]"), int(port), count, stop), flush=True)
    except Exception as err:  # the parent reads it instead of READY or DONE
        print("FAILED", type(err).__name__, err, flush=True)


def main() -> int:
    for command in sys.stdin:
        if not command.strip():
            continue
        kind, address, count = command.split()
        stop = threading.Event()
        flood = threading.Thread(target=_flood, args=(kind, address, int(count), stop))
        flood.start()
        sys.stdin.readline()  # the end of this flood (or of stdin)
        stop.set()
        flood.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
