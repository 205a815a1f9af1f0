"""clusterwire.data: tf.data service over any clusterwire transport.

``DispatchServer`` coordinates; ``WorkerServer`` processes run dataset
pipelines; a ``Dataset`` read through ``distribute(...)`` gets its elements
from the workers in "parallel_epochs" or "distributed_epoch" mode. The names,
arguments and errors are ``tf.data.experimental.service``'s.
"""

from clusterwire.data.client import distribute, from_dataset_id, register_dataset
from clusterwire.data.config import DispatcherConfig, WorkerConfig
from clusterwire.data.dataset import Dataset
from clusterwire.data.dispatcher import DispatchServer
from clusterwire.data.modes import ShardingPolicy
from clusterwire.data.permissions import function
from clusterwire.data.pipeline import AUTOTUNE, INFINITE, UNKNOWN
from clusterwire.data.worker import WorkerServer

INFINITE_CARDINALITY = INFINITE
UNKNOWN_CARDINALITY = UNKNOWN

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "Dataset",
    "DispatchServer",
    "DispatcherConfig",
    "ShardingPolicy",
    "WorkerConfig",
    "WorkerServer",
    "distribute",
    "from_dataset_id",
    "function",
    "register_dataset",
]
