"""The @remote functions bench_transports.py calls; imported by every benchmark task."""

import numpy as np
from _baselines import blob
from _bench_remote import ECHO  # noqa: F401  (registers bench.echo)

from clusterwire import Session, remote

STORE = "bench.transports.store_blob"


@remote(name=STORE)
def store_blob(target: str, name: str, nbytes: int) -> None:
    """Store ``blob(nbytes)`` under ``name`` in this task, made here (not received)."""
    with Session(target) as session:
        session.put(name, np.frombuffer(blob(nbytes), np.uint8))
