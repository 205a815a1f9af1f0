"""ReadTimings: a data-service consumer's retry windows, timeouts and idle times in one table.

``ServiceLimits`` (``clusterwire.data.quotas``) bounds the servers' tables; this one says
how long a consumer (``clusterwire.data.reader.JobReader``) waits for workers and the
dispatcher, and how often it asks again. Each field's metadata says what it times
(``times``); README's Reliability list is checked against them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from clusterwire.errors import InvalidArgumentError


def _timing(default: float, times: str) -> Any:
    return dataclasses.field(default=default, metadata={"times": times})


@dataclasses.dataclass(frozen=True)
class ReadTimings:
    """How a consumer times its reads; every field a positive number of seconds."""

    heartbeat_s: float = _timing(
        0.5, "between the consumer's heartbeats to the dispatcher (which list the job's "
        "workers when they changed); longer when the dispatcher says so (its "
        "consumer_heartbeat_rate limit)")
    no_worker_poll_s: float = _timing(
        0.02, "between heartbeats while the job has no worker yet")
    read_wait_s: float = _timing(
        1.0, "a worker holds a read that finds no element ready before answering with none")
    read_timeout_s: float = _timing(
        15.0, "a read from a worker may take before the worker counts as failed")
    retry_s: float = _timing(
        0.05, "the first backoff before a failed or busy worker is asked again")
    retry_max_s: float = _timing(
        2.0, "the backoff doubles up to this")
    busy_s: float = _timing(
        60.0, "a worker refusing a stream over its stream limits is asked again before its "
        "ResourceExhaustedError is raised")
    stalled_s: float = _timing(
        120.0, "a worker may fail every read and probe before its elements are given up "
        "(parallel_epochs), and an orphaned split may find no worker before the iteration "
        "fails (distributed_epoch); twice the dispatcher's default worker timeout, so a "
        "worker restarted in its place is waited for")
    probe_timeout_s: float = _timing(
        2.0, "a probe of a failed worker may take (distributed_epoch)")
    release_timeout_s: float = _timing(
        15.0, "a release of the consumer's streams on a worker may take (the worker's "
        "handlers may share its GIL with a pipeline computing without producing)")
    release_wait_s: float = _timing(
        2.0, "close() waits for the releases; they go on in the background after that")

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < math.inf:
                raise InvalidArgumentError(
                    f"Read timing {field.name} = {value!r} must be a positive, finite number "
                    f"of seconds (default {field.default!r}). Give e.g. "
                    f"{field.name}={field.default!r}.")
        for shorter, longer in (("read_wait_s", "read_timeout_s"), ("retry_s", "retry_max_s")):
            if getattr(self, shorter) > getattr(self, longer):
                raise InvalidArgumentError(
                    f"Read timing {shorter} = {getattr(self, shorter)!r} is longer than "
                    f"{longer} = {getattr(self, longer)!r}: a held read would time out, or the "
                    f"backoff would start past its cap. Give {shorter} <= {longer}.")

    def backoff(self, delay: float) -> float:
        """The backoff after ``delay``: doubled, at most ``retry_max_s``."""
        return min(delay * 2, self.retry_max_s)
