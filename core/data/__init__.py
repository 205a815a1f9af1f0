"""clusterwire.data: tf.data service over any clusterwire transport.

``DispatchServer`` coordinates; ``WorkerServer`` processes run dataset
pipelines; a ``Dataset`` read through ``distribute(...)`` gets its elements
from the workers in "parallel_epochs" or "distributed_epoch" mode. The names,
arguments and errors are ``tf.data.experimental.service``'s.

The names below are imported on first use, so importing one submodule (every
``clusterwire`` command imports ``clusterwire.data.cli``) does not load the service.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusterwire.data.client import (
        CrossTrainerCache,
        distribute,
        from_dataset_id,
        register_dataset,
        service_status,
    )
    from clusterwire.data.config import DispatcherConfig, WorkerConfig
    from clusterwire.data.dataset import Dataset, TFRecordDataset
    from clusterwire.data.dispatcher import DispatchServer
    from clusterwire.data.example import (
        FixedLenFeature,
        SparseTensorValue,
        VarLenFeature,
        parse_example,
        parse_single_example,
    )
    from clusterwire.data.limits import PipelineLimits
    from clusterwire.data.local_service import LocalDataService
    from clusterwire.data.modes import ShardingPolicy
    from clusterwire.data.parquet import ParquetReader
    from clusterwire.data.permissions import function
    from clusterwire.data.pipeline import AUTOTUNE
    from clusterwire.data.pipeline import INFINITE as INFINITE_CARDINALITY
    from clusterwire.data.pipeline import UNKNOWN as UNKNOWN_CARDINALITY
    from clusterwire.data.position import merge_states
    from clusterwire.data.provenance import replay
    from clusterwire.data.quotas import ServiceLimits
    from clusterwire.data.tar_shards import TarShardReader
    from clusterwire.data.tfrecord import TFRecordReader, TFRecordWriter
    from clusterwire.data.worker import WorkerServer

# Each public name: (submodule, name there).
_EXPORTS = {
    "AUTOTUNE": ("pipeline", "AUTOTUNE"),
    "INFINITE_CARDINALITY": ("pipeline", "INFINITE"),
    "UNKNOWN_CARDINALITY": ("pipeline", "UNKNOWN"),
    "CrossTrainerCache": ("client", "CrossTrainerCache"),
    "Dataset": ("dataset", "Dataset"),
    "DispatchServer": ("dispatcher", "DispatchServer"),
    "DispatcherConfig": ("config", "DispatcherConfig"),
    "LocalDataService": ("local_service", "LocalDataService"),
    "PipelineLimits": ("limits", "PipelineLimits"),
    "ServiceLimits": ("quotas", "ServiceLimits"),
    "ShardingPolicy": ("modes", "ShardingPolicy"),
    "WorkerConfig": ("config", "WorkerConfig"),
    "WorkerServer": ("worker", "WorkerServer"),
    "distribute": ("client", "distribute"),
    "from_dataset_id": ("client", "from_dataset_id"),
    "function": ("permissions", "function"),
    "merge_states": ("position", "merge_states"),
    "replay": ("provenance", "replay"),
    "register_dataset": ("client", "register_dataset"),
    "service_status": ("client", "service_status"),
    "TFRecordReader": ("tfrecord", "TFRecordReader"),
    "TFRecordWriter": ("tfrecord", "TFRecordWriter"),
    "TFRecordDataset": ("dataset", "TFRecordDataset"),
    "ParquetReader": ("parquet", "ParquetReader"),
    "TarShardReader": ("tar_shards", "TarShardReader"),
    "FixedLenFeature": ("example", "FixedLenFeature"),
    "VarLenFeature": ("example", "VarLenFeature"),
    "SparseTensorValue": ("example", "SparseTensorValue"),
    "parse_example": ("example", "parse_example"),
    "parse_single_example": ("example", "parse_single_example"),
}

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "CrossTrainerCache",
    "Dataset",
    "DispatchServer",
    "DispatcherConfig",
    "LocalDataService",
    "PipelineLimits",
    "ServiceLimits",
    "ShardingPolicy",
    "WorkerConfig",
    "WorkerServer",
    "distribute",
    "from_dataset_id",
    "function",
    "merge_states",
    "replay",
    "register_dataset",
    "service_status",
    "TFRecordReader",
    "TFRecordWriter",
    "TFRecordDataset",
    "ParquetReader",
    "TarShardReader",
    "FixedLenFeature",
    "VarLenFeature",
    "SparseTensorValue",
    "parse_example",
    "parse_single_example",
]


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
