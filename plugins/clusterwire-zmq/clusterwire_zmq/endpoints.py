"""Task addresses (``host:port``) as zmq TCP endpoints."""

from __future__ import annotations

import ipaddress
import socket

from clusterwire import errors
from clusterwire.addressing import join_host_port, split_host_port


def is_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 literal."""
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def _bind_ip(host: str) -> str:
    """An IP literal for ``host`` (libzmq binds interfaces and IPs, not host names)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as err:
        raise errors.UnavailableError(f"Cannot resolve the host of {host!r}: {err}") from None
    # IPv4 first: a client's connect resolves host names to IPv4 unless IPv6 is on.
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]


def bind_endpoint(address: str) -> tuple[str, str, bool]:
    """``(endpoint, host, ipv6)`` to bind ``address``; port 0 becomes zmq's wildcard port."""
    host, port = split_host_port(address)
    ip = _bind_ip(host)
    ipv6 = is_ipv6(ip)
    shown = f"[{ip}]" if ipv6 else ip
    return f"tcp://{shown}:{port or '*'}", host, ipv6


def connect_endpoint(address: str) -> tuple[str, bool]:
    """``(endpoint, ipv6)`` to connect to ``address``."""
    host, port = split_host_port(address)
    if port == 0:
        raise errors.InvalidArgumentError(
            f"Cannot connect to {address!r}: port 0 is only for listening; use the bound "
            "port the listener reports.")
    return f"tcp://{join_host_port(host, port)}", is_ipv6(host)


def bound_ip(endpoint: str) -> str:
    """The IP of a ``bind_endpoint`` endpoint, as ``getsockname`` shows it."""
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def bound_port(last_endpoint: bytes | str) -> int:
    """The port of a socket's ``LAST_ENDPOINT`` (``tcp://ip:port``)."""
    text = last_endpoint.decode() if isinstance(last_endpoint, bytes) else last_endpoint
    return int(text.rsplit(":", 1)[1])
