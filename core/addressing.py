"""Pure functions over task addresses ("host:port") and device strings."""

from __future__ import annotations

import ipaddress
import re

from clusterwire.errors import InvalidArgumentError

_DEVICE_PART = re.compile(r"^(job|replica|task|device):(.*)$")


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_host_port(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` or ``"[v6]:port"`` into ``(host, port)``.

    Raises InvalidArgumentError naming the address and the expected form when
    the host is empty, the port is missing or not in 0..65535.
    """
    if not isinstance(address, str):
        raise InvalidArgumentError(f"Task address {address!r} must be a string 'host:port'.")
    fix = "Use 'host:port' (or '[ipv6]:port'); port 0 picks a free port."
    if address.startswith("["):
        end = address.find("]")
        if end < 0 or not address[end + 1:].startswith(":"):
            raise InvalidArgumentError(f"Malformed IPv6 address {address!r}. {fix}")
        host, port_text = address[1:end], address[end + 2:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise InvalidArgumentError(
                f"Could not parse port from {address!r}: no ':port' part. {fix}")
        if ":" in host:
            raise InvalidArgumentError(
                f"Malformed address {address!r}: an IPv6 host needs brackets. {fix}")
    if not host:
        raise InvalidArgumentError(f"Address {address!r} has an empty host. {fix}")
    if not port_text.isdigit() or int(port_text) > 65535:
        raise InvalidArgumentError(
            f"Address {address!r} has an invalid port {port_text!r}: it must be 0..65535. {fix}")
    return host, int(port_text)


_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def check_dialable(address: str) -> None:
    """InvalidArgumentError unless ``address`` is ``host:port`` with a host that a name
    service could resolve or that is an IP address: a name of letters, digits, ``.``,
    ``-`` and ``_``, an IPv4 address, or ``[ipv6]``. Such an address never becomes
    reachable, so it is refused at once instead of retried until a deadline."""
    host, _ = split_host_port(address)
    if address.startswith("["):
        try:
            ipaddress.IPv6Address(host)
            return
        except ValueError:
            pass
    elif _HOST_NAME.fullmatch(host):
        return
    raise InvalidArgumentError(
        f"Address {address!r} has a host, {host!r}, that no name service resolves: a host "
        "is a name of letters, digits, '.', '-' and '_', an IPv4 address, or '[ipv6]'. Fix "
        "the address in the target or the cluster spec.")


def join_host_port(host: str, port: int) -> str:
    """The inverse of split_host_port (brackets an IPv6 host)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_target(target: str) -> tuple[str, str]:
    """Split ``"protocol://host:port"`` into ``(protocol, "host:port")``.

    A target without a scheme is taken as "grpc", as TensorFlow does.
    """
    if not isinstance(target, str) or not target:
        raise InvalidArgumentError(
            f"Target {target!r} must be a non-empty string such as 'grpc://127.0.0.1:2222'.")
    protocol, sep, address = target.rpartition("://")
    if not sep:
        return "grpc", target
    if "://" in protocol or not protocol:
        raise InvalidArgumentError(
            f"Malformed target {target!r}: expected 'protocol://host:port'.")
    return protocol, address


def parse_device(device: str) -> tuple[str, int]:
    """``"/job:ps/task:0"`` (replica and device parts allowed) -> ``("ps", 0)``."""
    fix = "Use a device string such as '/job:worker/task:0' or '/job:ps/replica:0/task:1'."
    if not isinstance(device, str):
        raise InvalidArgumentError(f"Task {device!r} must be a device string. {fix}")
    parts: dict[str, str] = {}
    for piece in device.strip("/").split("/"):
        match = _DEVICE_PART.match(piece)
        if not match:
            raise InvalidArgumentError(f"Malformed task {device!r}: bad part {piece!r}. {fix}")
        parts[match.group(1)] = match.group(2)
    job, task = parts.get("job"), parts.get("task", "0")
    if not job or not task.isdigit():
        raise InvalidArgumentError(f"Task {device!r} needs a job name and a task index. {fix}")
    return job, int(task)
