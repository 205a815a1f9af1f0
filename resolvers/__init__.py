"""Cluster resolvers: discover a cluster from its manager (one module per manager)."""
