"""A token holder's slow uploads, from a process of their own (tests/test_fair_shares.py).

    python cw_upload_flood.py ADDRESS TOKEN COUNT PERIOD STEP BUFFERS [AGAIN [PER [SOURCE]]]

opens COUNT uploads (grpc ``Upload`` calls, PER per connection, default 8) of a put that
declares 4 GiB in BUFFERS buffers, each sending its envelope and then STEP bytes every
PERIOD seconds; with AGAIN (1), an upload that ends is sent again at once, as a new one.
With SOURCE (an IP address of this host, e.g. 127.0.0.2), its connections come from there
(through a proxy of this process: gRPC cannot choose a channel's source address). It prints
``sent N`` once every upload has sent its envelope and first step; then, for every line
read on stdin, ``open N`` (the uploads not ended yet); at end of input each ended upload's
status code and details, one a line (with AGAIN, how many ended: ``ended N times``),
before it exits.
"""

from __future__ import annotations

import sys
import threading

import grpc

from clusterwire.protos.service_pb2 import Request
from clusterwire.testing.proxy import TrickleProxy
from clusterwire.transports._grpc_common.client import TOKEN_METADATA
from clusterwire.transports.grpc import framing

_DECLARED = 4 << 30


def envelope(name: str, buffers: int) -> bytes:
    """The first message of a put of ``name`` declaring 4 GiB in ``buffers`` buffers."""
    header = Request(method="put", name=name).SerializeToString()
    return framing.encode_bulk(header, [_DECLARED // buffers] * buffers)


def main() -> None:
    address, token = sys.argv[1], sys.argv[2].encode()
    count, period, step, buffers = (int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]),
                                    int(sys.argv[6]))
    again = len(sys.argv) > 7 and sys.argv[7] == "1"
    per_connection = int(sys.argv[8]) if len(sys.argv) > 8 else 8
    proxy = TrickleProxy(address, burst=1 << 62, source=sys.argv[9]) if len(sys.argv) > 9 \
        else None
    if proxy is not None:
        address = proxy.address
    stop = threading.Event()  # end of input: what ends from now on is not reported
    started = threading.Semaphore(0)
    lock = threading.Lock()
    ended: list[str] = []  # how uploads that ended before the end of input ended
    reached: set[int] = set()  # uploads (by index) whose first step was taken

    def trickle(i: int):
        yield envelope(f"flood-{i}", buffers)
        yield b"x" * step
        with lock:
            if i not in reached:
                reached.add(i)
                started.release()
        while not stop.wait(period):
            yield b"x" * step

    channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(-(-count // per_connection))]
    methods = [channel.stream_unary("/clusterwire.Transport/Upload") for channel in channels]
    uploads: list[grpc.Future] = [None] * count  # type: ignore[list-item]

    def send(i: int) -> None:
        upload = methods[i // per_connection].future(
            trickle(i), timeout=600, metadata=((TOKEN_METADATA, token),))
        uploads[i] = upload
        upload.add_done_callback(lambda done: on_end(i, done))

    def on_end(i: int, upload: grpc.Future) -> None:
        with lock:
            if stop.is_set():
                return
            error = upload.exception()
            ended.append(f"ended {error.code().name} {error.details()}" if error else "ended OK")
        if again:
            send(i)

    for i in range(count):
        send(i)
    for _ in range(count):
        started.acquire()
    print(f"sent {count}", flush=True)
    for _line in sys.stdin:
        print(f"open {sum(not u.done() for u in uploads)}", flush=True)
    with lock:
        stop.set()
    for upload in uploads:
        upload.cancel()
    if again:
        print(f"ended {len(ended)} times", flush=True)
    else:
        for line in ended:
            print(line, flush=True)
    for channel in channels:
        channel.close()
    if proxy is not None:
        proxy.close()

if __name__ == "__main__":
    main()
