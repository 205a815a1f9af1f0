"""Where a cluster lives in etcd, and the checks on what is read from there.

A task is one key, ``<prefix>/<cluster>/<job>/<index>``, whose value is the task's
``host:port``. Keys and values come from whoever can write to etcd, so both are validated
and bounded before they become a ClusterSpec.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from clusterwire import errors, membership
from clusterwire.addressing import split_host_port

#: The default key prefix; clusters are ``<prefix>/<cluster>/``.
DEFAULT_PREFIX = "/clusterwire"
#: The most tasks a cluster may have in etcd (more is ResourceExhaustedError): the most a
#: membership view may hold.
MAX_TASKS = membership.MAX_TASKS
#: The longest key and value accepted from etcd.
MAX_KEY_BYTES = 512
MAX_VALUE_BYTES = 261  # a 255-character host name, ':' and a 5-digit port

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_JOB = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_INDEX = re.compile(r"^(0|[1-9][0-9]{0,8})$")
_HOST_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_FIX = "Fix or delete the key (etcdctl put/del), or stop the program that writes it."


def cluster_prefix(prefix: str, cluster: str) -> str:
    """``<prefix>/<cluster>/``: every key of ``cluster``; bad names are InvalidArgumentError."""
    if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/"):
        raise errors.InvalidArgumentError(
            f"etcd key prefix {prefix!r} must start with '/' and not end with one, "
            f"e.g. {DEFAULT_PREFIX!r}.")
    if not isinstance(cluster, str) or not _NAME.match(cluster):
        raise errors.InvalidArgumentError(
            f"Cluster name {cluster!r} must be letters, digits, '_', '.' or '-' (no '/').")
    return f"{prefix}/{cluster}/"


def task_key(prefix: str, cluster: str, job: str, index: int) -> str:
    """The key of task ``index`` of ``job``."""
    if not isinstance(job, str) or not _JOB.match(job):
        raise errors.InvalidArgumentError(
            f"Job name {job!r}: use letters, digits and '_', starting with a letter.")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 10**9:
        raise errors.InvalidArgumentError(f"Task index {index!r} must be an int >= 0.")
    return f"{cluster_prefix(prefix, cluster)}{job}/{index}"


def parse_task(key: bytes, value: bytes, prefix: str, where: str) -> tuple[str, int, str]:
    """``(job, index, address)`` of one key read under ``prefix`` (a cluster's prefix).

    InvalidArgumentError names the key, what is wrong and how to fix it.
    """
    if len(key) > MAX_KEY_BYTES:
        raise errors.InvalidArgumentError(
            f"etcd key {key[:60]!r}... at {where} is over {MAX_KEY_BYTES} bytes. {_FIX}")
    try:
        name = key.decode()
        text = value.decode()
    except UnicodeDecodeError:
        raise errors.InvalidArgumentError(
            f"etcd key {key!r} at {where}: key and value must be UTF-8. {_FIX}") from None
    job, sep, index = name[len(prefix):].partition("/")
    if not sep or not _JOB.match(job) or not _INDEX.match(index):
        raise errors.InvalidArgumentError(
            f"etcd key {name!r} at {where} is not {prefix}<job>/<index> (a job of letters, "
            f"digits and '_', an index without leading zeros). {_FIX}")
    if len(value) > MAX_VALUE_BYTES:
        raise errors.InvalidArgumentError(
            f"etcd key {name!r} at {where}: its value is over {MAX_VALUE_BYTES} bytes, not "
            f"a host:port. {_FIX}")
    try:
        validate_address(text)
    except errors.InvalidArgumentError as err:
        raise errors.InvalidArgumentError(f"etcd key {name!r} at {where}: {err} {_FIX}") from None
    return job, int(index), text


def validate_ttl(ttl: Any) -> None:
    """Refuse a lease TTL etcd cannot grant (it grants whole seconds; 1 s expires between
    two keep-alives)."""
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 2:
        raise errors.InvalidArgumentError(
            f"ttl must be a whole number of seconds >= 2 (etcd grants whole seconds), "
            f"got {ttl!r}.")


def validate_address(address: str, port_zero: bool = False) -> None:
    """Refuse anything but ``host:port`` with a host that is an IP address or a DNS name and
    a port in 1..65535 (0 too if ``port_zero``): InvalidArgumentError naming the address."""
    host, port = split_host_port(address)
    if port == 0 and not port_zero:
        raise errors.InvalidArgumentError(
            f"Address {address!r} has port 0, which no peer can dial; register the port the "
            "task is bound to.")
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise errors.InvalidArgumentError(
            f"Address {address!r}: host {host!r} is neither an IP address nor a DNS name.")
