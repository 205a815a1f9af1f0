"""Vouches: the service's word for the offsets a consumer may hand back in a position.

A worker answering a read of a split's stream (or of an anonymous job's own stream) vouches
for the elements it handed: an HMAC, under the grant key only the dispatcher and its
registered workers hold, of the job, the dataset, the stream, the consumer and the range
``[start, end)`` of the elements in the stream. The dispatcher vouches the same way for the
offset it hands a split out at. A position carries, for each offset in it, a vouch whose range
holds the offset; a resume, a release or a worker's skip of a nonzero offset without one is
refused (``check``). So a consumer hands back only offsets it was handed: it cannot plant an
offset past what it read (the split's next reader would silently miss elements), lower one
below where its split was handed (another consumer's elements again) or replay a vouch of
another job, stream or consumer; and a worker skips at most what the service already produced
for that consumer.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import weakref
from typing import Any

from clusterwire.errors import PermissionDeniedError
from clusterwire.protos.data_service_pb2 import Vouch


def split_stream(split_id: int) -> str:
    """The stream a vouch of split ``split_id`` names."""
    return f"split {split_id}"


def worker_stream(address: str) -> str:
    """The stream a vouch of an anonymous job's stream on worker ``address`` names."""
    return f"worker {address}"


def round_robin_stream(address: str, consumers: int) -> str:
    """The stream a vouch of a round-robin job's stream on worker ``address`` names (read by
    ``consumers`` consumers: a resume's skip may pass their elements of the last round)."""
    return f"worker {address} round-robin of {consumers}"


def _mac(key: bytes, dataset_id: str, stream: str, job_id: int, consumer_id: str,
         start: int, end: int) -> bytes:
    message = "\x00".join(str(f) for f in (
        "elements", job_id, dataset_id, stream, consumer_id, start, end)).encode()
    return hmac.new(key, message, hashlib.sha256).digest()


def vouch(key: bytes, dataset_id: str, stream: str, job_id: int, consumer_id: str,
          start: int, end: int) -> Vouch:
    """The service's word that it handed ``consumer_id`` elements ``[start, end)`` of
    ``stream`` in job ``job_id``."""
    return Vouch(job_id=job_id, consumer_id=consumer_id, start=start, end=end,
                 mac=_mac(key, dataset_id, stream, job_id, consumer_id, start, end))


def check(key: bytes, dataset_id: str, stream: str, offset: int, given: Vouch | None,
          job_id: int | None = None, consumer_id: str | None = None, slack: int = 0) -> None:
    """PermissionDeniedError naming ``offset`` unless ``given`` is the service's word for it:
    of ``stream`` of ``dataset_id``, of job ``job_id`` and consumer ``consumer_id`` (where
    given: a split's; an anonymous job's stream resumes in a new job of the same dataset),
    its range holding ``offset`` (or ending at most ``slack`` elements before it)."""
    where = f"offset {offset} of {stream} (dataset {dataset_id!r})"
    fix = ("pass the position state_dict() returned, unchanged (a position saved before "
           "offsets were vouched for cannot be resumed: start the iteration anew)")
    if given is None or not given.mac:
        raise PermissionDeniedError(
            f"The service did not vouch for {where}: no vouch comes with it. A position "
            f"hands back only offsets the service handed the consumer; {fix}.")
    if job_id is not None and given.job_id != job_id:
        raise PermissionDeniedError(
            f"The vouch for {where} is of job {given.job_id}, not job {job_id}: another "
            f"job's position; {fix}.")
    if consumer_id is not None and given.consumer_id != consumer_id:
        raise PermissionDeniedError(
            f"The vouch for {where} is of consumer {given.consumer_id!r}, not "
            f"{consumer_id!r}: another consumer's position; {fix}.")
    if not given.start <= offset <= given.end + slack:
        raise PermissionDeniedError(
            f"The vouch for {where} covers elements {given.start} to {given.end} only: "
            f"{fix}.")
    expected = _mac(key, dataset_id, stream, given.job_id, given.consumer_id, given.start,
                    given.end)
    if not hmac.compare_digest(given.mac, expected):
        raise PermissionDeniedError(
            f"The vouch for {where} is not the service's (forged, or of another dataset, "
            f"stream or dispatcher): {fix}.")


class Ledger:
    """Where each of a worker's vouched streams stands: the range of the elements its last
    answer handed (a retry, same sequence number, gets the same batch and the same range)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: weakref.WeakKeyDictionary[Any, tuple[int, int, int]] = (
            weakref.WeakKeyDictionary())

    def handed(self, stream: Any, seq: int, count: int) -> tuple[int, int]:
        """The range ``[start, end)`` in ``stream`` of the ``count`` elements answering read
        ``seq`` (the stream's first element stands at ``stream.skip``)."""
        with self._lock:
            last = self._last.get(stream)
            if last is not None and last[0] == seq:
                return last[1], last[2]
            start = stream.skip if last is None else last[2]
            self._last[stream] = (seq, start, start + count)
            return start, start + count
