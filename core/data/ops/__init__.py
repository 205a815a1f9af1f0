"""tf.data's sources and transformations beyond the linear core of ``pipeline``.

Each is a ``Node``: a frozen dataclass whose fields say how it travels to workers
(``graph.py``): fields made with ``fn_field()`` are user functions (sent by reference and
allowed on workers by default deny, as ``map``'s), the ``inputs`` field holds the
pipelines it reads (zip's datasets, concatenate's second one), a ``guard`` field receives
what a worker does to a Dataset a user function returns (its functions and files checked
as the client's own), a ``dataset_type`` field the Dataset class (for nodes whose elements
are Datasets), and every other field is an argument sent as a value.

``Node`` and ``register`` are in ``base``, which every node module imports; this package
loads the node modules, so importing it makes every kind known to ``graph.from_def``
(``NODES``).
"""

from __future__ import annotations

from clusterwire.data.ops import (  # noqa: F401 - each registers its node kinds
    batching,
    formats,
    global_shuffle,
    nested,
    sources,
    stateful,
)
from clusterwire.data.ops.base import NODES, Guard, Node

__all__ = ["NODES", "Guard", "Node"]
