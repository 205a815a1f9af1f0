"""The cluster token, checked by libzmq's ZAP hook before a connection may send anything.

Every connection uses ZeroMQ's PLAIN mechanism: the client presents the cluster token
as its password (a placeholder when it has none), and the listener's ZAP handler
admits it only if the token matches (constant-time compare). A refused client never
gets a message through, so no request and no bulk data of it is ever read, and it sees
EVENT_HANDSHAKE_FAILED_AUTH at once. Without a token the handler admits everyone.

TLS is not available: libzmq secures TCP with CURVE keys, not X.509 certificates.
"""

from __future__ import annotations

import os
import threading

import zmq

from clusterwire import errors
from clusterwire.security import Security

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"clusterwire"
USERNAME = b"clusterwire"
#: The password of a client without a token (PLAIN needs one; it never matches a token).
NO_TOKEN = b"-"
_MAX_TOKEN = 255  # PLAIN's longest password


def refuse_tls(security: Security | None) -> None:
    """UnimplementedError when TLS is asked for: never run without it silently."""
    if security is not None and security.tls is not None:
        raise errors.UnimplementedError(
            "The zmq transport cannot speak TLS: libzmq secures TCP with CURVE keys, not "
            "X.509 certificates. Use protocol 'grpc' for TLS, or run zmq inside a VPN or "
            "tunnel; the cluster token (auth_token_file) works with zmq.")


def configure_client(sock: zmq.Socket, security: Security | None) -> None:
    """Present the cluster token (or the placeholder) as the PLAIN password."""
    token = security.token if security is not None and security.token else NO_TOKEN
    if len(token) > _MAX_TOKEN:
        raise errors.InvalidArgumentError(
            f"The zmq transport carries cluster tokens of up to {_MAX_TOKEN} bytes; this one "
            f"has {len(token)}.")
    sock.plain_username = USERNAME
    sock.plain_password = token


class TokenGate:
    """A listener's ZAP handler: a thread answering libzmq's authentication requests.

    Create it before the listener's socket binds (libzmq refuses PLAIN connections
    while no handler is bound); ``close`` it before terminating the context.
    """

    def __init__(self, context: zmq.Context, security: Security):
        self._security = security
        self._sock = context.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="clusterwire-zmq-zap",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def configure_server(sock: zmq.Socket) -> None:
        """Make ``sock`` authenticate every connection through the gate."""
        sock.plain_server = True
        sock.zap_domain = DOMAIN

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        try:
            while self._stop_r not in dict(poller.poll()):
                self._sock.send_multipart(self.answer(self._sock.recv_multipart()))
        finally:
            self._sock.close(linger=0)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply (RFC 27) to one request."""
        version, request_id = (request + [b"", b""])[:2]
        mechanism, credentials = (request[5] if len(request) > 5 else b""), request[6:]
        try:
            if mechanism != b"PLAIN" or len(credentials) != 2:
                raise errors.UnauthenticatedError(f"mechanism {mechanism!r} is not PLAIN")
            self._security.check_token(credentials[1])
        except errors.UnauthenticatedError as err:
            return [version, request_id, b"400", err.message.encode()[:255], b"", b""]
        return [version, request_id, b"200", b"OK", b"", b""]

    def close(self) -> None:
        """Stop the handler thread and close its socket."""
        os.write(self._stop_w, b"\0")
        self._thread.join(10)
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
