"""A token holder that keeps many authenticated connections open, from a process of its own
(tests/test_fair_shares.py).

    python cw_connection_hog.py ADDRESS TOKEN COUNT SOURCE

opens COUNT grpc channels (a connection each) to the task at ADDRESS from SOURCE (an IP
address of this host, through a proxy of this process: gRPC cannot choose a channel's
source address) and keeps each busy: a ``list`` request every ``_PERIOD_S``, sent again on
a new connection when one is closed or refused. For every line read on stdin it prints a
JSON line: ``held`` (channels whose last call succeeded), ``refused`` (calls refused
RESOURCE_EXHAUSTED so far) and ``closed`` (calls that failed otherwise); it exits at end of
input.
"""

from __future__ import annotations

import json
import sys
import threading

from clusterwire import errors
from clusterwire.protos.service_pb2 import Request
from clusterwire.security import Security
from clusterwire.testing.proxy import TrickleProxy
from clusterwire.transport import Frame
from clusterwire.transports.grpc.transport import GrpcTransport

_PERIOD_S = 0.2


def main() -> None:
    address, token, count, source = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), \
        sys.argv[4]
    proxy = TrickleProxy(address, burst=1 << 62, source=source)
    transport = GrpcTransport()
    stop = threading.Event()
    lock = threading.Lock()
    held = [False] * count
    totals = {"refused": 0, "closed": 0}
    request = Frame(Request(method="list").SerializeToString(), [])

    def keep(i: int) -> None:
        channel = transport.connect(proxy.address, Security(token=token))
        try:
            while not stop.is_set():
                try:
                    channel.call(request, timeout=10)
                    outcome = None
                except errors.ResourceExhaustedError:
                    outcome = "refused"
                except errors.OpError:
                    outcome = "closed"
                with lock:
                    held[i] = outcome is None
                    if outcome is not None:
                        totals[outcome] += 1
                if outcome is not None:  # a new channel: no reconnection backoff
                    channel.close()
                    channel = transport.connect(proxy.address, Security(token=token))
                stop.wait(_PERIOD_S)
        finally:
            channel.close()

    keepers = [threading.Thread(target=keep, args=(i,), daemon=True) for i in range(count)]
    for keeper in keepers:
        keeper.start()
    for _line in sys.stdin:
        with lock:
            print(json.dumps({"held": sum(held), **totals}), flush=True)
    stop.set()
    for keeper in keepers:
        keeper.join(15)
    proxy.close()


if __name__ == "__main__":
    main()
