"""Writable copy-on-write views of memory a transport shares read-only.

A transport that hands over tensor bytes in shared memory (``grpc+local``'s sealed
segments) gives read-only arrays: no side may change the other's data. A framework without
read-only tensors (PyTorch) would have to copy them. Instead, the memory's owner maps the
same bytes privately, copy-on-write: a write lands in pages of this process alone, reading
costs what reading the shared view costs, and nothing is copied up front.

A buffer type offers it with an ``address`` attribute (where its memory starts here) and a
method ``clusterwire_private_map(offset, nbytes)`` returning a writable buffer of those
bytes, mapped privately.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def private_view(array: np.ndarray) -> np.ndarray | None:
    """A writable array equal to read-only ``array``, over a private mapping of its memory;
    None when no buffer under it offers one (or ``array`` is not contiguous): copy then."""
    if not array.flags.c_contiguous or array.nbytes == 0:
        return None
    owner = _owner(array)
    if owner is None:
        return None
    offset = array.__array_interface__["data"][0] - owner.address
    mapped = owner.clusterwire_private_map(offset, array.nbytes)
    return np.frombuffer(mapped, array.dtype).reshape(array.shape)


def _owner(array: np.ndarray) -> Any:
    base: Any = array
    while base is not None:
        if hasattr(type(base), "clusterwire_private_map"):
            return base
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return None
