"""A tokenless flood of one server's gRPC port, run as its own process by the tests.

``python cw_health_flood.py ADDRESS COUNT [watch | silent [SOURCE_IP]]``: COUNT connections
without the cluster token, for as long as the process lives, each opened again as soon as
the server closes it. ``watch`` (the default): each is a gRPC channel of its own holding one health
``Watch``, opening a new one whenever the server ends it. ``silent``: each is a TCP
connection (from ``SOURCE_IP`` if given: another peer than the test's clients, e.g.
127.0.0.2) that sends HTTP/2's preface and then nothing. Prints every second a JSON line:
watches ended so far by status code, or ``{"connects": N, "closed": M}`` (M of them closed
by the server).

It runs at the lowest CPU priority (nice 19): the tests measure the port's rules, not how a
busy machine shares its cores between the flood and the server (the flood still reconnects
thousands of times a second).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import selectors
import socket
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# A client's HTTP/2 preface and an empty SETTINGS frame.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


async def watches(address: str, count: int) -> None:
    ended: collections.Counter[str] = collections.Counter()

    async def hold(channel: grpc.aio.Channel) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as err:
                ended[err.code().name] += 1
            else:
                ended["OK"] += 1

    # A local subchannel pool each: one connection per channel, as separate clients have.
    channels = [grpc.aio.insecure_channel(address,
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(count)]
    holders = [asyncio.create_task(hold(channel)) for channel in channels]
    while True:
        await asyncio.sleep(1)
        print(json.dumps(ended), flush=True)
    del holders


def silent(address: str, count: int, source: str = "") -> None:
    host, port = address.rsplit(":", 1)
    selector, connects, closed, reported = selectors.DefaultSelector(), 0, 0, time.monotonic()

    def connect() -> None:
        nonlocal connects
        try:
            sock = socket.create_connection((host, int(port)), 5, (source, 0) if source else None)
            sock.sendall(HTTP2_PREFACE)
        except OSError:
            return
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        connects += 1

    for _ in range(count):
        connect()
    while True:
        for key, _ in selector.select(0.1):
            try:
                ended = not key.fileobj.recv(65536)
            except BlockingIOError:
                ended = False
            except OSError:
                ended = True
            if ended:
                selector.unregister(key.fileobj)
                key.fileobj.close()
                closed += 1
        for _ in range(count - len(selector.get_map())):
            connect()
        if time.monotonic() - reported >= 1:
            reported = time.monotonic()
            print(json.dumps({"connects": connects, "closed": closed}), flush=True)


if __name__ == "__main__":
    os.nice(19)
    if sys.argv[3:4] == ["silent"]:
        silent(sys.argv[1], int(sys.argv[2]), *sys.argv[4:5])
    else:
        asyncio.run(watches(sys.argv[1], int(sys.argv[2])))
