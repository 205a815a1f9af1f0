"""The dispatcher's answers to consumers' heartbeats: the job's live workers, versioned,
and whether the job finished (issue 33).

Each job's list of live workers has a version, a new one at every change of the list (a
worker registered, gone silent or back, or its ``WorkerInfo`` changed). A consumer's
heartbeat names the version it holds (``ClientHeartbeatRequest.workers_version``) and the
reply carries the list only when that is not the current one: a steady consumer's heartbeat
costs the same with 1,000 workers as with 10. One that names none (0: its first heartbeat,
or a consumer from before versions) gets the list. Every reply is serialized once per
version, finished flag, floor (below) and with or without the list, and the bytes are
shared.

Versions start at a random point in each dispatcher process, so that a version a consumer
holds from a dispatcher before a restart or a standby's takeover names no list of this one.

The reply also sets a floor on the consumer's heartbeat interval
(``heartbeat_interval_ms``): the dispatcher's consumers over its ``consumer_heartbeat_rate``
limit, so that their heartbeats stay near that rate however many they are (0 while they are
few: each heartbeats at its own interval).
"""

from __future__ import annotations

import itertools
import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from clusterwire.data.dispatcher_state import Job, LiveWorkers
from clusterwire.protos.data_service_pb2 import DataResponse, WorkerInfo

#: How often the consumers are counted for the heartbeat interval's floor.
_RECOUNT_S = 1.0
#: The replies kept per version (by finished flag, list or not, interval): more are made
#: anew (the interval changed many times while the list did not).
_REPLIES_KEPT = 8


@dataclass(eq=False)
class WorkerList:
    """A job's live workers as its consumers are told them (``Job.worker_list``)."""

    view: LiveWorkers  # the live workers they were taken from
    version: int
    workers: tuple[WorkerInfo, ...]
    # (job finished, with the list, interval floor) -> the serialized reply
    replies: dict[tuple[bool, bool, int], bytes] = field(default_factory=dict)


class HeartbeatReplies:
    """Makes (and keeps, per job) the replies to consumers' heartbeats: ``rate`` is the
    consumer heartbeats a second to ask for in all, ``max_interval_s`` the longest interval
    to tell a consumer. Call with the dispatcher's lock held."""

    def __init__(self, rate: int, max_interval_s: float) -> None:
        self._versions = itertools.count(secrets.randbits(62) + 1)
        self._rate, self._max_interval_s = rate, max_interval_s
        self._interval_ms, self._counted_at = 0, -math.inf

    def interval_ms(self, jobs: Iterable[Job], now: float) -> int:
        """The floor on consumers' heartbeat intervals at ``now``: the consumers of ``jobs``
        over the rate, in whole tenths of a second rounded down (0 below a tenth: their own
        interval), at most ``max_interval_s``; they are counted at most once a second."""
        if now - self._counted_at >= _RECOUNT_S:
            consumers = sum(len(job.consumers) for job in jobs)
            tenths = min(consumers * 10 // self._rate, int(self._max_interval_s * 10))
            self._interval_ms, self._counted_at = tenths * 100, now
        return self._interval_ms

    def reply(self, job: Job, view: LiveWorkers, workers: dict[str, WorkerInfo],
              known_version: int, interval_ms: int) -> bytes:
        """The serialized reply to a heartbeat of ``job``'s consumer that holds the list of
        ``known_version``: ``view`` is the live workers now, ``workers`` every registered
        worker by address, ``interval_ms`` the floor on its heartbeat interval."""
        listed = self._current(job, view, workers)
        send = known_version != listed.version
        key = (job.info.finished, send, interval_ms)
        reply = listed.replies.get(key)
        if reply is None:
            response = DataResponse()
            heartbeat = response.client_heartbeat
            if send:
                heartbeat.workers.extend(listed.workers)
            heartbeat.job_finished = job.info.finished
            heartbeat.workers_version = listed.version
            heartbeat.heartbeat_interval_ms = interval_ms
            if len(listed.replies) >= _REPLIES_KEPT:
                listed.replies.clear()
            reply = listed.replies[key] = response.SerializeToString()
        return reply

    def _current(self, job: Job, view: LiveWorkers, workers: dict[str, WorkerInfo]
                 ) -> WorkerList:
        """``job``'s list now: the one kept while the live workers are the same view, a new
        version only when what the job lists changed (a static job lists its configured
        workers, in their order, that are live)."""
        listed = job.worker_list
        if listed is not None and listed.view is view:
            return listed
        order = job.info.worker_order
        now = view.workers if not order else tuple(
            workers[a] for a in order if a in view.addresses)
        if listed is None or now != listed.workers:
            listed = job.worker_list = WorkerList(view, next(self._versions), now)
        else:
            listed.view = view
        return listed
