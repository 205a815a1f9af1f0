"""Worker credentials: only workers register with a dispatcher and learn its grant key.

Clients and workers both hold the cluster token (when one is set); a worker also presents
the *worker token*, a second secret, with every heartbeat. The dispatcher registers a
worker, and answers it the grant key (with which stream grants are made), only when that
token matches (compared in constant time). A client cannot act as a worker.

The token comes from the config's ``worker_token_file``, else ``CLUSTERWIRE_WORKER_TOKEN_FILE``,
else ``CLUSTERWIRE_WORKER_TOKEN`` (the secret itself). A dispatcher given none makes a
random one at start (default deny): workers of its own process that have none find it here
(``local_token``), ``LocalDataService`` hands it to the workers it starts, and a remote
worker cannot register until the operator gives both sides the same file.
"""

from __future__ import annotations

import os
import secrets
import threading

from clusterwire.addressing import split_host_port
from clusterwire.errors import InvalidArgumentError, PermissionDeniedError
from clusterwire.security import Security, read_secret, same_secret

ENV_FILE = "CLUSTERWIRE_WORKER_TOKEN_FILE"
ENV = "CLUSTERWIRE_WORKER_TOKEN"
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")

_local: dict[int, tuple[frozenset[str], bytes]] = {}  # port -> (hosts, token)
_local_lock = threading.Lock()


def load(path: str | None, security: Security) -> bytes | None:
    """The configured worker token (None: none configured). InvalidArgumentError when it is
    shorter than 16 bytes or is the cluster token (a client would then be a worker)."""
    token = read_secret(path or os.environ.get(ENV_FILE), os.environ.get(ENV), "worker token")
    if token is not None and security.token is not None and same_secret(token, security.token):
        raise InvalidArgumentError(
            "The worker token is the cluster token: every client would be a worker. Give "
            "the workers a secret of their own (worker_token_file, --worker-token-file or "
            f"{ENV_FILE}).")
    return token


def new_token() -> bytes:
    """A random worker token."""
    return secrets.token_hex(32).encode()


def check(expected: bytes, presented: bytes, address: str) -> None:
    """PermissionDeniedError unless ``presented`` is the worker token."""
    if not same_secret(expected, presented):
        raise PermissionDeniedError(
            f"Worker {address!r} did not present this dispatcher's worker token: only "
            "workers register. Start the dispatcher and its workers with the same "
            f"--worker-token-file (worker_token_file in their configs, or {ENV_FILE}).")


def publish(port: int, host: str, token: bytes) -> None:
    """Make ``token`` the worker token of the dispatcher at ``host:port`` in this process."""
    hosts = frozenset((host, *_LOOPBACK)) if host in _LOOPBACK else frozenset((host,))
    with _local_lock:
        _local[port] = (hosts, token)


def withdraw(port: int, token: bytes) -> None:
    """Forget the dispatcher at ``port`` (if ``token`` is still its token)."""
    with _local_lock:
        if _local.get(port, (None, None))[1] == token:
            del _local[port]


def local_token(dispatcher_address: str) -> bytes:
    """The worker token of the dispatcher at ``dispatcher_address`` if it runs in this
    process with a token it made; else empty (the dispatcher will refuse)."""
    try:
        host, port = split_host_port(dispatcher_address)
    except InvalidArgumentError:
        return b""
    with _local_lock:
        hosts, token = _local.get(port, (frozenset(), b""))
    return token if host in hosts else b""
