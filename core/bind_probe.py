"""Why an address could not be bound, in words: gRPC says only "Failed to bind"."""

from __future__ import annotations

import errno
import socket

from clusterwire.addressing import split_host_port


def why_unbindable(address: str) -> str | None:
    """Bind ``address`` (``host:port``) with a plain socket and say why that fails ("port
    2222 is in use by another process or server", "... is not an address of this machine"),
    or None if it binds now (the cause was elsewhere) or cannot be told."""
    try:
        host, port = split_host_port(address)
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (OSError, ValueError):
        return None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(sockaddr)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return f"port {port} is in use by another process or server"
                if err.errno == errno.EADDRNOTAVAIL:
                    return f"{host} is not an address of this machine"
                if err.errno == errno.EACCES:
                    return f"port {port} needs privileges to bind (ports below 1024)"
                return err.strerror
    return None
