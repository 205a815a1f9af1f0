"""What every resolver shares: errors that are both clusterwire and TF exceptions, optional imports.

TensorFlow's resolvers raise ``ValueError``, ``RuntimeError``, ``KeyError`` or
``ImportError``; code written for TF catches those. clusterwire raises classes
that are also ``clusterwire.errors`` classes, so both ``except ValueError`` and
``except errors.InvalidArgumentError`` work.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from clusterwire import errors
from clusterwire.cluster_resolver import ClusterResolver, format_master_url


class ResolverValueError(errors.InvalidArgumentError, ValueError):
    """Malformed input (environment variable, argument); a ValueError where TF raises one."""


class ResolverRuntimeError(errors.FailedPreconditionError, RuntimeError):
    """The environment does not allow resolving (e.g. not inside a Slurm step)."""


class ResolverKeyError(errors.InvalidArgumentError, KeyError):
    """A task defined twice when merging clusters (TF raises KeyError)."""


class MissingDependencyError(errors.FailedPreconditionError, ImportError):
    """An optional dependency of a resolver is not installed; names the extra to install."""


def import_optional(module: str, extra: str, resolver: str) -> ModuleType:
    """Import ``module``, else MissingDependencyError naming the extra to pip install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependencyError(
            f"{resolver} needs the {module.split('.')[0]!r} package, which is not installed "
            f"({err}). Install it with: pip install 'clusterwire[{extra}]'") from None



class OwnTaskResolver(ClusterResolver):
    """A resolver that knows (or learns from its cluster) which task this process is."""

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """``rpc_layer://address`` of a task (default: this one); ``""`` if none is known.

        The cluster is resolved first (fresh, as in TF), since some resolvers
        learn their own task from it.
        """
        cluster = self.cluster_spec()
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        return format_master_url(cluster.task_address(task_type, task_id),
                                 rpc_layer or self.rpc_layer)
