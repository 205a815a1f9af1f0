"""TLS on the fast lane (``lane``): a lane connection of a listener or channel with TLS runs
inside TLS, with the certificates its gRPC port uses.

The listener presents its certificate chain and asks for a client certificate signed by its
``root_certificates`` when ``require_client_auth`` is set (mutual TLS), as its gRPC port
does; the channel checks the listener against its ``root_certificates`` (when None: the
file ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH`` names, as gRPC reads it, else the system's) and
the host of the address it dialled (an IP address against the certificate's IP SANs), as
gRPC does, and presents its own certificate when it has one. TLS 1.2 at least; no session
tickets (a lane connection lives long and is not resumed).

The TLS runs over memory buffers (``ssl.MemoryBIO``), the socket's bytes moved by
``TlsStream``: the lane keeps its own socket timeouts (the kernel receive timeout that
bounds each wait, the handshake deadline), and the listener can send CLOSING from another
thread while the connection's thread waits for a call (one SSL object is never used by two
threads at once: ``TlsStream`` holds a lock around it, never across a wait for bytes).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import ssl
import threading
import time
from collections.abc import Sequence

from clusterwire import errors
from clusterwire.security import TlsConfig

_RAW_BYTES = 64 << 10  # a receive of encrypted bytes: several whole TLS records
_JOIN_BYTES = 64 << 10  # a message up to this long is encrypted as one piece (fewer records)


class TlsStream:
    """A lane connection inside TLS, used as its socket: ``recv_into``, ``sendmsg``,
    ``sendall`` and ``send`` carry plaintext; timeouts, ``shutdown`` and ``close`` are the
    socket's (a receive timeout raises as the socket's does, with the TLS state intact)."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                 hostname: str | None):
        self.sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                     server_hostname=hostname)
        self._raw = memoryview(bytearray(_RAW_BYTES))  # the reading thread's only
        self._lock = threading.Lock()

    def handshake(self, deadline: float) -> None:
        """The TLS handshake, done by ``deadline`` (a ``time.monotonic`` time) or
        TimeoutError; ssl.SSLError when the peer's certificate or bytes are refused,
        ConnectionError when it closed."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the TLS handshake took past its deadline")
            self.sock.settimeout(remaining)
            try:
                with self._lock:
                    self._tls.do_handshake()
                    self._flush(0)
                return
            except ssl.SSLWantReadError:
                with self._lock:
                    self._flush(0)
            except ssl.SSLError:
                with self._lock, contextlib.suppress(OSError):  # the alert, if it fits
                    self._flush(socket.MSG_DONTWAIT)
                raise
            count = self.sock.recv_into(self._raw)
            if not count:
                raise ConnectionResetError("the peer closed during the TLS handshake")
            with self._lock:
                self._incoming.write(self._raw[:count])

    def recv_into(self, view: memoryview) -> int:
        """Plaintext into ``view``: the byte count, 0 at the connection's end."""
        while True:
            with self._lock:
                # With nothing received, skip the read (it would raise) and wait for bytes.
                if self._incoming.pending or self._tls.pending():
                    try:
                        return self._read(view)
                    except ssl.SSLWantReadError:
                        pass  # part of a record
                    except ssl.SSLZeroReturnError:
                        return 0
                    except ssl.SSLError as err:
                        raise ConnectionResetError(f"TLS: {err}") from None
            count = self.sock.recv_into(self._raw)  # the socket's timeouts raise here
            if not count:
                return 0
            with self._lock:
                self._incoming.write(self._raw[:count])

    def _read(self, view: memoryview) -> int:
        """What the TLS object holds, up to ``view``'s size (SSLWantReadError: nothing):
        every record already received, so that a message and the one after it arrive in
        one receive, as over plain TCP."""
        count = self._tls.read(view.nbytes, view)
        while count < view.nbytes and (self._tls.pending() or self._incoming.pending):
            try:
                count += self._tls.read(view.nbytes - count, view[count:])
            except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):
                break
        if self._outgoing.pending:  # a post-handshake answer (a key update)
            self._flush(0)
        return count

    def sendmsg(self, views: Sequence[memoryview]) -> int:
        """Send all of ``views`` (encrypted); their length. Partial writes of the encrypted
        bytes are resumed within the socket's send timeout (BlockingIOError after it: the
        connection is then unusable)."""
        total = sum(view.nbytes for view in views)
        if not total:
            return 0
        pieces = [b"".join(views)] if total <= _JOIN_BYTES and len(views) > 1 else views
        with self._lock:
            for piece in pieces:
                if len(piece):
                    self._tls.write(piece)
            self._flush(0)
        return total

    def sendall(self, data: bytes) -> None:
        self.sendmsg([memoryview(data)])

    def send(self, data: bytes, flags: int = 0) -> int:
        """Encrypt ``data`` and send what the socket takes with ``flags`` (for a message
        that may be dropped, as CLOSING with MSG_DONTWAIT)."""
        with self._lock:
            self._tls.write(data)
            return self.sock.send(self._outgoing.read(), flags)

    def _flush(self, flags: int) -> None:
        pending = self._outgoing.read()
        if pending:
            self.sock.sendall(pending, flags)

    def setsockopt(self, level: int, option: int, value: int | bytes) -> None:
        self.sock.setsockopt(level, option, value)

    def settimeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()


def accept(sock: socket.socket, context: ssl.SSLContext, deadline: float) -> TlsStream:
    """The listener's side of a new lane connection (``server_context``), its TLS
    handshake done by ``deadline`` (else TimeoutError; ssl.SSLError: refused)."""
    stream = TlsStream(sock, context, True, None)
    stream.handshake(deadline)
    return stream


def dial(sock: socket.socket, context: ssl.SSLContext, host: str, deadline: float
         ) -> TlsStream:
    """The channel's side of a new lane connection to ``host`` (``client_context``), its
    TLS handshake done by ``deadline`` (else TimeoutError; ssl.SSLCertVerificationError:
    not the listener's certificate)."""
    stream = TlsStream(sock, context, False, host)
    stream.handshake(deadline)
    return stream


@functools.lru_cache(maxsize=16)
def server_context(tls: TlsConfig) -> ssl.SSLContext:
    """The listener's TLS context (its certificate; client certificates checked with mutual
    TLS). InvalidArgumentError naming the fix when the PEM material does not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.num_tickets = 0
    if not (tls.certificate_chain and tls.private_key):
        raise errors.InvalidArgumentError(
            "A TLS server needs tls_cert_file and tls_key_file.")
    _load_chain(context, tls.certificate_chain, tls.private_key)
    if tls.require_client_auth:
        context.verify_mode = ssl.CERT_REQUIRED
        _load_roots(context, tls.root_certificates)
    return context


def client_context(tls: TlsConfig) -> ssl.SSLContext:
    """The channel's TLS context (the listener checked against the roots and the host
    name; its own certificate for mutual TLS)."""
    return _client_context(tls, os.environ.get("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"))


@functools.lru_cache(maxsize=16)
def _client_context(tls: TlsConfig, roots_file: str | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # hostname and certificate checked
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.root_certificates:
        _load_roots(context, tls.root_certificates)
    elif roots_file:
        try:
            context.load_verify_locations(cafile=roots_file)
        except (ssl.SSLError, OSError) as err:
            raise errors.InvalidArgumentError(
                f"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH={roots_file!r} does not load for the fast "
                f"lane: {err}. Point it at a PEM file of CA certificates, or set "
                "tls_ca_file.") from None
    else:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if tls.certificate_chain and tls.private_key:
        _load_chain(context, tls.certificate_chain, tls.private_key)
    return context


def _load_roots(context: ssl.SSLContext, pem: bytes | None) -> None:
    try:
        context.load_verify_locations(cadata=(pem or b"").decode("ascii"))
    except (ssl.SSLError, ValueError, UnicodeDecodeError) as err:
        raise errors.InvalidArgumentError(
            f"The TLS CA certificates (tls_ca_file) do not load for the fast lane: {err}. "
            "Give a PEM file of CA certificates.") from None


def _load_chain(context: ssl.SSLContext, chain: bytes, key: bytes) -> None:
    """``load_cert_chain`` of PEM bytes (it takes only paths): through memory files, so
    the key is never written to a disk."""
    with contextlib.ExitStack() as stack:
        paths = []
        for pem in (chain, key):
            descriptor = os.memfd_create("clusterwire-lane-tls", os.MFD_CLOEXEC)
            stack.callback(os.close, descriptor)
            with open(descriptor, "wb", closefd=False) as handle:
                handle.write(pem)
            paths.append(f"/proc/self/fd/{descriptor}")
        try:
            context.load_cert_chain(*paths)
        except (ssl.SSLError, OSError) as err:
            raise errors.InvalidArgumentError(
                f"The TLS certificate and key (tls_cert_file, tls_key_file) do not load "
                f"for the fast lane: {err}. Give a PEM certificate chain and its key.") \
                from None
