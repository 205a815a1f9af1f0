"""Map functions of the data-service benchmark (importable by worker processes)."""

from __future__ import annotations

import numpy as np


def fill_2k(x):
    """A 2 KiB int64 element filled with x (TF anchor: tf.fill([256], x))."""
    return np.full(256, x, np.int64)


def fill_1m(x):
    """A 1 MiB int64 element filled with x (TF anchor: tf.fill([131072], x))."""
    return np.full(131072, x, np.int64)
