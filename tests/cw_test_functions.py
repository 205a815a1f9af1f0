"""@remote functions that the tests' task processes import."""

from __future__ import annotations

import os

import numpy as np

import clusterwire
from clusterwire import errors


@clusterwire.remote
def echo(*args, **kwargs):
    """Return what it was given."""
    return [list(args), kwargs]


@clusterwire.remote
def add(a, b):
    return a + b


@clusterwire.remote
def where_am_i():
    """The pid of the process that ran the call."""
    return os.getpid()


@clusterwire.remote
def scaled(array: np.ndarray, factor: float) -> np.ndarray:
    return array * factor


@clusterwire.remote
def fail_with_value_error(text):
    raise ValueError(f"bad value: {text}")


@clusterwire.remote
def fail_with_not_found():
    raise errors.NotFoundError("nothing here")


@clusterwire.remote
def hang(seconds: float) -> str:
    import threading

    threading.Event().wait(seconds)
    return "done"
