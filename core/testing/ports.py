"""Free loopback ports, for servers that cannot bind port 0 themselves (etcd, Slurm's
daemons, a cluster spec written before its tasks start)."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free right now (another process may take one before
    the caller binds it: retry on a conflict)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()
