"""A tokenless flood of one server's gRPC port, run as its own process by the tests.

``python cw_health_flood.py ADDRESS COUNT``: COUNT connections without the cluster token,
each its own gRPC channel, each holding one health ``Watch`` and opening a new one whenever
the server ends it (reconnecting when the server closed the connection), for as long as the
process lives. Prints every second a JSON line: the watches ended so far, by status code.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


async def main(address: str, count: int) -> None:
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


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
