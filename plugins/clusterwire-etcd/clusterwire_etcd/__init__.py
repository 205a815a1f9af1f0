"""clusterwire-etcd: membership from etcd.

``EtcdClusterResolver`` reads a cluster from etcd keys (``<prefix>/<cluster>/<job>/<index>``
-> ``host:port``) and watches them; ``EtcdRegistration`` holds a serving task's key under a
lease, so a dead task's key expires. etcd is spoken to through its v3 JSON gateway with the
standard library.
"""

from __future__ import annotations

from clusterwire.plugins import ResolverSpec, hookimpl
from clusterwire_etcd.registration import EtcdRegistration
from clusterwire_etcd.resolver import EtcdClusterResolver

__all__ = ["EtcdClusterResolver", "EtcdRegistration"]


@hookimpl
def clusterwire_add_resolvers() -> list[ResolverSpec]:
    """Register the "etcd" resolver."""
    return [ResolverSpec("etcd", EtcdClusterResolver,
                         "tasks registered under an etcd key prefix (clusterwire-etcd)")]
