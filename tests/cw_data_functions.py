"""Module-level dataset functions the data-service tests send to workers by reference.

Each is allowed on workers with ``@data.function``; a worker process imports this module
(``--import cw_data_functions``) to allow them.
"""

from __future__ import annotations

import os
import time

import numpy as np

from clusterwire import data


@data.function
def square(x):
    return x * x


@data.function
def is_even(x):
    return x % 2 == 0


@data.function
def add(x, y):
    return x + y


@data.function
def fill_2k(x):
    """A 2 KiB int64 element holding x."""
    return np.full(256, x, np.int64)


@data.function
def fill_1m(x):
    """1 MiB of x's value (int64): big enough for grpc+local's shared segments."""
    return np.full(1 << 17, x, dtype=np.int64)


@data.function
def slow_identity(x):
    """x, after a short pause (keeps a job running long enough to kill a worker in it)."""
    time.sleep(float(os.environ.get("CW_DATA_SLOW_S", "0.002")))
    return x


@data.function
def count_up(n):
    """A generator of 0..n-1 as int64."""
    for i in range(n):
        yield np.int64(i)


@data.function
def fail_at_five(x):
    if x == 5:
        raise ValueError("element five is cursed")
    return x
