"""The @remote functions bench_transports.py calls; imported by every benchmark task."""

import numpy as np
from _baselines import blob
from _bench_remote import ECHO  # noqa: F401  (registers bench.echo)

from clusterwire import Session, remote

STORE = "bench.transports.store_blob"
RETURN = "bench.transports.return_blob"
_BLOBS: dict[int, np.ndarray] = {}


@remote(name=STORE)
def store_blob(target: str, name: str, nbytes: int) -> None:
    """Store ``blob(nbytes)`` under ``name`` in this task, made here (not received)."""
    with Session(target) as session:
        session.put(name, np.frombuffer(blob(nbytes), np.uint8))


@remote(name=RETURN)
def return_blob(nbytes: int) -> np.ndarray:
    """``blob(nbytes)``, made here once and returned by every call (never stored)."""
    if nbytes not in _BLOBS:
        _BLOBS[nbytes] = np.frombuffer(blob(nbytes), np.uint8)
    return _BLOBS[nbytes]
