"""Cluster resolvers: discover a cluster from its manager (one module per manager).

``ClusterResolver`` (the interface) lives in the core; each manager's
resolver registers through the plugin manager as a ``ResolverSpec`` (see
``clusterwire plugins``). Importing this package imports no optional
dependency: boto3, google-api-python-client and kubernetes load when an
AWS, GCE or Kubernetes resolver is built.
"""

from clusterwire.cluster_resolver import ClusterResolver, format_master_url
from clusterwire.resolvers.aws import AWSClusterResolver
from clusterwire.resolvers.gce import GCEClusterResolver
from clusterwire.resolvers.kubernetes import KubernetesClusterResolver
from clusterwire.resolvers.simple import SimpleClusterResolver
from clusterwire.resolvers.slurm import SlurmClusterResolver
from clusterwire.resolvers.tfconfig import TFConfigClusterResolver
from clusterwire.resolvers.union import UnionClusterResolver, UnionResolver

__all__ = [
    "AWSClusterResolver",
    "ClusterResolver",
    "GCEClusterResolver",
    "KubernetesClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "UnionClusterResolver",
    "UnionResolver",
    "format_master_url",
]
