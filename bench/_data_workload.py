"""Map functions of the data-service benchmark (importable by worker processes, which allow
them through ``@data.function`` once they import this module)."""

from __future__ import annotations

import numpy as np

from clusterwire import data


@data.function
def fill_2k(x):
    """A 2 KiB int64 element filled with x (TF anchor: tf.fill([256], x))."""
    return np.full(256, x, np.int64)


@data.function
def fill_1m(x):
    """A 1 MiB int64 element filled with x (TF anchor: tf.fill([131072], x))."""
    return np.full(131072, x, np.int64)


class LocalFill:
    """The 1 MiB workload as a map-style dataset for a plain ``torch.utils.data.DataLoader``
    (the baseline of the PyTorch rows). Element ``i`` is ``fill_1m(i)`` as a tensor; torch is
    imported on use, since the service's workers import this module too."""

    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        import torch

        return torch.from_numpy(fill_1m(index))
