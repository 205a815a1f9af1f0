"""Cluster resolvers: discover a cluster from its manager (one module per manager).

``ClusterResolver`` (the interface) lives in the core; each manager's
resolver registers through the plugin manager as a ``ResolverSpec``.
"""

from clusterwire.cluster_resolver import ClusterResolver, format_master_url

__all__ = ["ClusterResolver", "format_master_url"]
