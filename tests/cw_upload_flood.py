"""A token holder's slow uploads, from a process of their own (tests/test_fair_shares.py).

    python cw_upload_flood.py ADDRESS TOKEN COUNT PERIOD STEP BUFFERS

opens COUNT uploads (grpc ``Upload`` calls, 8 per connection) of a put that declares 4 GiB
in BUFFERS buffers, each sending its envelope and then STEP bytes every PERIOD seconds.
It prints ``sent N`` once every upload has sent its envelope and first step; then, for
every line read on stdin, ``open N`` (the uploads not ended yet), and at end of input each
ended upload's status code and details, one a line, before it exits.
"""

from __future__ import annotations

import sys
import threading

import grpc

from clusterwire.protos.service_pb2 import Request
from clusterwire.transports._grpc_common.client import TOKEN_METADATA
from clusterwire.transports.grpc import framing

_PER_CONNECTION = 8
_DECLARED = 4 << 30


def envelope(name: str, buffers: int) -> bytes:
    """The first message of a put of ``name`` declaring 4 GiB in ``buffers`` buffers."""
    header = Request(method="put", name=name).SerializeToString()
    return framing.encode_bulk(header, [_DECLARED // buffers] * buffers)


def main() -> None:
    address, token = sys.argv[1], sys.argv[2].encode()
    count, period, step, buffers = (int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]),
                                    int(sys.argv[6]))
    stop = threading.Event()
    started = threading.Semaphore(0)

    def trickle(name: str):
        yield envelope(name, buffers)
        yield b"x" * step
        started.release()
        while not stop.wait(period):
            yield b"x" * step

    channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(-(-count // _PER_CONNECTION))]
    uploads = [channels[i // _PER_CONNECTION].stream_unary("/clusterwire.Transport/Upload")
               .future(trickle(f"flood-{i}"), timeout=600, metadata=((TOKEN_METADATA, token),))
               for i in range(count)]
    for _ in range(count):
        started.acquire()
    print(f"sent {count}", flush=True)
    for _line in sys.stdin:
        print(f"open {sum(not u.done() for u in uploads)}", flush=True)
    stop.set()
    for upload in uploads:
        if upload.done() and not upload.cancelled() and upload.exception() is not None:
            error = upload.exception()
            print(f"ended {error.code().name} {error.details()}", flush=True)
        upload.cancel()
    for channel in channels:
        channel.close()


if __name__ == "__main__":
    main()
