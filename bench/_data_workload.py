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
