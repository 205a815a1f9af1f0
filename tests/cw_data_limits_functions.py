"""Dataset functions the pipeline-limits tests send to workers by reference (a worker
process imports this module with ``--import cw_data_limits_functions``)."""

from __future__ import annotations

import numpy as np

from clusterwire import data


@data.function
def three_of(x):
    """A Dataset of x three times."""
    return data.Dataset.from_tensor_slices(np.full(3, x, np.int64))


@data.function
def prefetched_range(x):
    """A Dataset of x*100 .. x*100+49 that asks for a huge prefetch buffer (each one a
    producer thread on a worker, if the worker's thread budget grants it)."""
    return data.Dataset.range(x * 100, x * 100 + 50).prefetch(10**9)


@data.function
def kib(x):
    """1 KiB of x's value (int64)."""
    return np.full(128, x, np.int64)


@data.function
def own_key(x):
    """Each element its own group's key."""
    return x


@data.function
def the_window(key, window):
    """group_by_window's reduce_func: the window as it is."""
    return window


@data.function
def never(x):
    """A filter predicate keeping no element."""
    return False
