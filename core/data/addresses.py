"""Dispatcher address lists: ``"HOST1:P1,HOST2:P2"``, a primary and its standbys.

Workers (``--dispatcher-address``, ``WorkerConfig.dispatcher_address``) and clients
(``service="grpc://HOST1:P1,HOST2:P2"``) are given every dispatcher that may serve a
work_dir; ``clusterwire.data.rpc.DispatcherClient`` follows the one that answers.
"""

from __future__ import annotations

from typing import Any

from clusterwire.addressing import split_host_port
from clusterwire.errors import InvalidArgumentError

_FORM = ("Give 'host:port', or the primary's and its standbys' as a comma-separated list "
         "'host1:port1,host2:port2'.")


def dispatcher_addresses(value: Any) -> tuple[str, ...]:
    """The addresses of a dispatcher address or comma-separated list, in order (spaces
    around an entry ignored). InvalidArgumentError naming the value for an empty entry, a
    malformed ``host:port``, port 0 in a list, or a duplicate."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgumentError(f"Dispatcher address {value!r} is not an address. {_FORM}")
    addresses = tuple(part.strip() for part in value.split(","))
    for address in addresses:
        if not address:
            raise InvalidArgumentError(
                f"Dispatcher address list {value!r} has an empty entry. {_FORM}")
        try:
            _, port = split_host_port(address)
        except InvalidArgumentError as err:
            if len(addresses) == 1:
                raise
            raise InvalidArgumentError(
                f"Dispatcher address list {value!r}: {err.message}") from None
        if port == 0 and len(addresses) > 1:
            raise InvalidArgumentError(
                f"Dispatcher address list {value!r} names port 0 ({address!r}): a standby's "
                "or primary's port must be the one it serves at.")
    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
    if duplicates:
        raise InvalidArgumentError(
            f"Dispatcher address list {value!r} names {', '.join(duplicates)} more than once; "
            "list each dispatcher once.")
    return addresses
