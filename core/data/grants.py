"""Stream grants: the dispatcher's proof, checked by a worker, that it handed out a stream.

A consumer reads elements from workers directly, naming the stream in a ``StreamSpec``. A
worker opens a stream (and spends memory and CPU on it) only when the spec carries the
dispatcher's grant: an HMAC, under a key that only the dispatcher and its registered workers
hold, of the job and dataset and, for a split, of the split's source range, the consumer
it was assigned to and the offset it was handed to it at. A client cannot invent split ids,
read another job's dataset, take a split assigned to another consumer or read a split from
before where it was handed to it (another consumer's elements).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from clusterwire.errors import PermissionDeniedError
from clusterwire.protos.data_service_pb2 import StreamSpec

KEY_BYTES = 32


def new_key() -> bytes:
    """A fresh random grant key."""
    return secrets.token_bytes(KEY_BYTES)


def grant(key: bytes, spec: StreamSpec, consumer_id: str) -> bytes:
    """The grant of ``spec``: a split's is bound to ``consumer_id``, a whole-dataset stream's
    to its job and, for an anonymous job, to the job's one consumer (``spec.owner``)."""
    fields: tuple
    if spec.is_split:
        fields = ("split", spec.job_id, spec.dataset_id, spec.split_id, spec.unit_start,
                  spec.unit_end, consumer_id, spec.handed_at)
    else:
        fields = ("job", spec.job_id, spec.dataset_id) + ((spec.owner,) if spec.owner else ())
    message = "\x00".join(str(f) for f in fields).encode()
    return hmac.new(key, message, hashlib.sha256).digest()


def check(key: bytes, spec: StreamSpec, consumer_id: str) -> None:
    """PermissionDeniedError unless ``spec.grant`` is the dispatcher's grant of the stream."""
    if not hmac.compare_digest(spec.grant, grant(key, spec, consumer_id)):
        what = (f"split {spec.split_id} (units {spec.unit_start}..{spec.unit_end}, from "
                f"offset {spec.handed_at}) for consumer {consumer_id!r}" if spec.is_split
                else "a whole-dataset stream")
        raise PermissionDeniedError(
            f"The dispatcher did not grant {what} of job {spec.job_id} (dataset "
            f"{spec.dataset_id!r}): read through distribute() or from_dataset_id(), which ask "
            "the dispatcher for the streams.")
