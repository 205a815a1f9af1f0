"""Waits between a request's attempts: the doubling backoff the runtime's retry loops use,
and the fixed ones in one table. A data consumer's are settable, in
``clusterwire.data.read_timings.ReadTimings``."""

from __future__ import annotations

import dataclasses
import random

# Our own generator: retries must not consume (or race on) the user's seeded global one.
_JITTER = random.Random()


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Waits that start at ``start_s`` and double up to ``max_s`` (seconds)."""

    start_s: float
    max_s: float

    def after(self, delay: float) -> float:
        """The wait after one of ``delay``."""
        return min(delay * 2, self.max_s)


def jittered(delay: float) -> float:
    """``delay`` scaled by a random factor in [0.5, 1.5) (spreads retries out)."""
    return delay * _JITTER.uniform(0.5, 1.5)


#: An address found unreachable (``clusterwire.rpc.RequestClient``): asked again after these,
#: within the request's deadline.
UNREACHABLE = Backoff(0.02, 1.0)
#: A round in which no dispatcher of a primary-and-standbys list answered
#: (``clusterwire.data.rpc.DispatcherClient``): the next round after these (a standby takes
#: over within its lease poll).
DISPATCHER_FAILOVER = Backoff(0.05, 0.5)
#: A streamed gRPC call refused as busy (every thread for streamed calls working; nothing of
#: it read): sent again after these, until its deadline.
STREAM_BUSY = Backoff(0.002, 0.1)
