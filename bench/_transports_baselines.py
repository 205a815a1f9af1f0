"""Bare pyzmq and bare ucxx baselines for bench_transports.py (no clusterwire).

Each server runs in its own process::

    python bench/_transports_baselines.py --role pyzmq|ucxx --blob-bytes N

prints one ``READY <token>`` line on stdout (anything else on stdout, such as a
UCX warning, is to be ignored by the reader) and serves one client until its
stdin closes (so it also exits if the benchmark dies) or it gets SIGTERM. The
blob it serves is ``_baselines.blob(N)``, so clients check it byte for byte.

* pyzmq: a ROUTER socket echoes every message (DEALER clients, any number of
  them: the 8-byte round trip and the 1 KiB calls/s of 8 client threads), and
  a PAIR socket answers each message with the blob, sent ``copy=False``; the
  client receives it ``copy=False`` (a zmq frame, no copy in Python). Token:
  ``<router endpoint> <pair endpoint>``.
* ucxx: the low-level API (``ucxx._lib.libucxx``) with blocking progress
  (``progress_worker_event``: progress, arm, epoll), as the research in
  shared/research/transports.md measured it. Worker addresses are exchanged out
  of band (token: the server's worker address in hex; the client sends its own
  over UCX), endpoint error handling is off (it disables shared memory, and
  grpc+verbs turns it off too). UCX_TLS and friends come from the environment.
  Requests are 8-byte tagged messages: ``P`` + 7 bytes is echoed (8 bytes
  back), ``B`` is answered with the blob, received by the client into a
  preallocated array (or, as a second variant, into a fresh one).
* channel (``--protocol P``): a clusterwire transport's own listener with an
  echo handler, and no Session or cluster service around it, so a run can
  tell the transport's share of a round trip from the core's. Token: the
  listener's contact address.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _baselines import blob, exit_with_parent  # noqa: E402

HOST = "127.0.0.1"
# UCX tags of the bare ucxx protocol.
T_ADDR_LEN, T_ADDR, T_REQUEST, T_REPLY, T_BLOB = 0xA0, 0xA1, 0x1, 0x2, 0x3
#: What every UCX process of the benchmark gets (bare ucxx and grpc+verbs alike).
UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TCP_RX_SEG_SIZE": "512k",
           "UCX_TCP_TX_SEG_SIZE": "512k", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def _ready(token: str) -> None:
    sys.stdout.write(f"READY {token}\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- pyzmq


def _serve_pyzmq(payload: bytes) -> None:
    import zmq

    context = zmq.Context(io_threads=1)
    router = context.socket(zmq.ROUTER)
    pair = context.socket(zmq.PAIR)
    for sock in (router, pair):
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://{HOST}:*")
    _ready(f"{router.getsockopt_string(zmq.LAST_ENDPOINT)} "
           f"{pair.getsockopt_string(zmq.LAST_ENDPOINT)}")
    data = np.frombuffer(payload, np.uint8)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(pair, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            if sock is router:
                router.send_multipart(router.recv_multipart())
            else:
                pair.recv()
                pair.send(data, copy=False)


class PyzmqClient:
    """DEALER for round trips, PAIR for the blob; one thread at a time."""

    def __init__(self, token: str, context=None):
        import zmq

        self._zmq = zmq
        self.context = context or zmq.Context(io_threads=1)
        self._own = context is None
        router, pair = token.split()
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(router)
        self._pair_endpoint = pair
        self.pair = None

    def echo(self, payload: bytes):
        self.dealer.send(payload)
        return self.dealer.recv()

    def fetch_blob(self) -> memoryview:
        """The blob as a view of the received zmq frame (no copy)."""
        if self.pair is None:
            self.pair = self.context.socket(self._zmq.PAIR)
            self.pair.setsockopt(self._zmq.LINGER, 0)
            self.pair.connect(self._pair_endpoint)
        self.pair.send(b"B")
        return self.pair.recv(copy=False).buffer

    def close(self) -> None:
        self.dealer.close(linger=0)
        if self.pair is not None:
            self.pair.close(linger=0)
        if self._own:
            self.context.term()


# ----------------------------------------------------------------------------- ucxx


def _ucxx():
    for key, value in UCX_ENV.items():
        os.environ.setdefault(key, value)
    import ucxx  # noqa: F401  (loads libucx, sets ucxx's UCX defaults)
    import ucxx._lib.libucxx as libucxx
    from ucxx._lib.arr import Array

    return libucxx, Array


class _UcxWorker:
    """A context and worker in blocking progress mode, driven by the calling thread."""

    def __init__(self):
        self.u, self.Array = _ucxx()
        u = self.u
        self.context = u.UCXContext(feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
        self.worker = u.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()

    def wait(self, *requests) -> None:
        worker = self.worker
        while not all(r.completed for r in requests):
            worker.progress_worker_event()  # progress; if idle, arm and epoll_wait
        for request in requests:
            request.check_error()

    def endpoint(self, address: bytes):
        u = self.u
        return u.UCXEndpoint.create_from_worker_address(
            self.worker, u.UCXAddress.create_from_buffer(address), False)


def _serve_ucxx(payload: bytes) -> None:
    ucx = _UcxWorker()
    u, Array = ucx.u, ucx.Array
    _ready(ucx.worker.address.tobytes().hex())
    length = np.zeros(1, np.uint64)
    ucx.wait(ucx.worker.tag_recv(Array(length), u.UCXXTag(T_ADDR_LEN)))
    address = np.zeros(int(length[0]), np.uint8)
    ucx.wait(ucx.worker.tag_recv(Array(address), u.UCXXTag(T_ADDR)))
    endpoint = ucx.endpoint(address.tobytes())
    request = np.zeros(8, np.uint8)
    request_array, data = Array(request), Array(np.frombuffer(payload, np.uint8))
    request_tag, reply_tag, blob_tag = (u.UCXXTag(t) for t in (T_REQUEST, T_REPLY, T_BLOB))
    while True:
        ucx.wait(endpoint.tag_recv(request_array, request_tag))
        if request[0] == ord("P"):
            ucx.wait(endpoint.tag_send(request_array, reply_tag))
        else:
            ucx.wait(endpoint.tag_send(data, blob_tag))


class UcxxClient:
    """Client of the bare ucxx server: ping-pong and blob into a preallocated array."""

    def __init__(self, token: str, nbytes: int):
        self.ucx = ucx = _UcxWorker()
        u, Array = ucx.u, ucx.Array
        self.endpoint = ucx.endpoint(bytes.fromhex(token))
        mine = np.frombuffer(ucx.worker.address.tobytes(), np.uint8).copy()
        ucx.wait(self.endpoint.tag_send(Array(np.array([mine.size], np.uint64)),
                                        u.UCXXTag(T_ADDR_LEN)))
        ucx.wait(self.endpoint.tag_send(Array(mine), u.UCXXTag(T_ADDR)))
        self._ping = np.frombuffer(b"P" + bytes(range(1, 8)), np.uint8).copy()
        self._ping_array = Array(self._ping)
        self._get = Array(np.frombuffer(b"B" + bytes(7), np.uint8).copy())
        self.reply = np.zeros(8, np.uint8)
        self._reply_array = Array(self.reply)
        self.out = np.empty(nbytes, np.uint8)
        self.out[:] = 0  # fault the pages in once, like the raw TCP baseline's buffer
        self._out_array = Array(self.out)
        self._tags = (u.UCXXTag(T_REQUEST), u.UCXXTag(T_REPLY), u.UCXXTag(T_BLOB))

    def ping(self) -> np.ndarray:
        request, reply, _ = self._tags
        received = self.endpoint.tag_recv(self._reply_array, reply)
        sent = self.endpoint.tag_send(self._ping_array, request)
        self.ucx.wait(sent, received)
        return self.reply

    def fetch_blob(self) -> np.ndarray:
        request, _, blob_tag = self._tags
        received = self.endpoint.tag_recv(self._out_array, blob_tag)
        sent = self.endpoint.tag_send(self._get, request)
        self.ucx.wait(sent, received)
        return self.out

    def fetch_blob_fresh(self) -> np.ndarray:
        """The blob into a new array (its pages are faulted in by the receive)."""
        request, _, blob_tag = self._tags
        out = np.empty(self.out.nbytes, np.uint8)
        received = self.endpoint.tag_recv(self.ucx.Array(out), blob_tag)
        sent = self.endpoint.tag_send(self._get, request)
        self.ucx.wait(sent, received)
        return out

    def close(self) -> None:
        # Let the last messages drain; the process exits right after.
        for _ in range(100):
            self.ucx.worker.progress()


# ----------------------------------------------------------------------------- transport only


def _serve_channel(protocol: str) -> None:
    """A clusterwire transport's listener with an echo handler: no Session, no service."""
    from clusterwire.plugins import get_plugin_manager
    from clusterwire.transport import Frame, ListenOptions

    def echo(frame: Frame) -> Frame:
        return Frame(frame.header, list(frame.buffers))

    listener = get_plugin_manager().transport(protocol).listen(
        f"{HOST}:0", echo, ListenOptions())
    listener.start()
    _ready(listener.address)
    threading.Event().wait()


# ----------------------------------------------------------------------------- main


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["pyzmq", "ucxx", "channel"], required=True)
    parser.add_argument("--blob-bytes", type=int, default=0)
    parser.add_argument("--protocol", default="grpc", help="--role channel: the transport")
    args = parser.parse_args(argv)

    exit_with_parent()
    if args.role == "channel":
        _serve_channel(args.protocol)
        return
    payload = blob(args.blob_bytes)
    if args.role == "pyzmq":
        _serve_pyzmq(payload)
    else:
        _serve_ucxx(payload)


if __name__ == "__main__":
    main(sys.argv[1:])
