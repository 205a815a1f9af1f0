"""ServiceLimits: the data service's quotas in one table.

``PipelineLimits`` (``clusterwire.data.limits``) bounds what one dataset definition makes a
worker spawn; ``ServiceLimits`` bounds the service's tables: the datasets, jobs and
remembered positions a dispatcher holds, the streams a worker runs and how long an unread
one keeps its room. A ``DispatcherConfig`` and a ``WorkerConfig`` each take one
(``limits=``, a ServiceLimits or a dict of its fields); each server reads the fields that
bound its own tables. Full, a table is shared fairly between the peers that fill it
(``clusterwire.fair_shares``): these are only the numbers.

Each field's metadata says what it bounds (``bounds``), what a peer gets at the limit
(``at_limit``) and which server applies it (``server``); README's Reliability table is
checked against them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from clusterwire.errors import InvalidArgumentError


def _limit(default: int | float, server: str, bounds: str, at_limit: str) -> Any:
    return dataclasses.field(default=default, metadata={
        "server": server, "bounds": bounds, "at_limit": at_limit})


@dataclasses.dataclass(frozen=True)
class ServiceLimits:
    """The data service's quotas; every field a positive number (the ``_s`` ones seconds).

    ``max_datasets``, ``max_dataset_bytes``, ``max_jobs``: the dispatcher's tables (full,
    the oldest entry of the peer holding the most is displaced, never one of a peer holding
    less). ``max_handouts``, ``max_merges``: what a distributed_epoch job remembers for
    resuming and merging positions. ``consumer_heartbeat_rate``: the consumer heartbeats a
    second the dispatcher asks for (it lengthens their interval past it).
    ``max_open_streams``, ``max_streams_per_consumer``: a worker's unfinished streams.
    ``idle_stream_s``, ``idle_split_stream_s``, ``idle_cache_s``: how long an unread
    stream or cached job keeps its room.
    ``stream_buffer_bytes``, ``stream_buffer_elements``: what one stream buffers.
    ``max_cached_jobs``, ``max_cache_trainers``: a worker's cross-trainer caches.
    ``removed_jobs_kept``: jobs a worker remembers the dispatcher removed. The defaults
    bound a dispatcher's or worker's memory to a few GiB whatever its clients send.
    """

    max_datasets: int = _limit(
        1024, "dispatcher", "registered datasets",
        "a full table displaces by the fair-share rule (the peer holding the most gives up "
        "its oldest unused dataset first; its users are told why); ResourceExhaustedError "
        "naming the limit once the peer holds its share")
    max_dataset_bytes: int = _limit(
        4 << 30, "dispatcher", "the registered datasets' payload bytes, in all",
        "as max_datasets; one dataset larger than it: ResourceExhaustedError")
    max_jobs: int = _limit(
        4096, "dispatcher", "jobs, and round-robin resume waves",
        "as max_datasets, unread jobs first (their consumers are told why at their next "
        "heartbeat or split request)")
    max_handouts: int = _limit(
        100_000, "dispatcher", "split hand-outs a distributed_epoch job keeps per consumer",
        "a position saved before the last max_handouts hand-outs cannot be resumed "
        "(FailedPreconditionError)")
    max_merges: int = _limit(
        1024, "dispatcher", "merges of positions a distributed_epoch job remembers",
        "a new consumer passing an older job position is refused "
        "(FailedPreconditionError)")
    consumer_heartbeat_rate: int = _limit(
        1000, "dispatcher", "consumer heartbeats a second the dispatcher asks for, in all",
        "past it (more consumers than it times their heartbeat interval) every consumer is "
        "told to heartbeat every consumers / consumer_heartbeat_rate seconds (at most a "
        "tenth of the dispatcher's consumer timeout): a new or lost worker reaches it that "
        "much later (nothing is refused)")
    max_open_streams: int = _limit(
        64, "worker", "unfinished streams a worker runs at once",
        "as max_datasets, released or idle streams first; refused with "
        "ResourceExhaustedError 'over its stream limits' (readers ask again with backoff)")
    max_streams_per_consumer: int = _limit(
        16, "worker", "unfinished streams of one consumer on a worker",
        "ResourceExhaustedError 'over its stream limits'")
    idle_stream_s: float = _limit(
        600.0, "worker", "seconds a stream nobody reads stays open",
        "an anonymous job's reader goes on where it was; a named job's shared stream is "
        "refused (FailedPreconditionError: start a new iteration)")
    idle_split_stream_s: float = _limit(
        30.0, "worker", "seconds an unread split's stream keeps its room in a full worker",
        "its consumer, coming back, opens it again at the offset it reached")
    idle_cache_s: float = _limit(
        10.0, "worker", "seconds an unread cached job keeps its cross-trainer cache slot",
        "its trainers start a new cache window when they come back")
    stream_buffer_bytes: int = _limit(
        16 << 20, "worker",
        "bytes one stream holds ahead of its readers, with the batches kept for their "
        "retries (plus the element that filled it)",
        "the stream's producer waits for its readers (nothing is refused)")
    stream_buffer_elements: int = _limit(
        8192, "worker", "elements one stream holds ahead of its readers",
        "as stream_buffer_bytes")
    max_cached_jobs: int = _limit(
        16, "worker",
        "jobs a worker caches at once (cross-trainer caches; fewer when its memory's share "
        "for caches holds fewer)",
        "as max_open_streams, caches unread for idle_cache_s first")
    max_cache_trainers: int = _limit(
        1024, "worker", "trainer ids one cross-trainer cache serves",
        "trainers behind the cached window are forgotten first; else ResourceExhaustedError")
    removed_jobs_kept: int = _limit(
        16_384, "worker", "jobs the dispatcher removed that a worker remembers",
        "the worker refuses the streams of the last removed_jobs_kept removed jobs "
        "(NotFoundError) and forgets older ones")

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            whole = field.type == "int"
            kinds = (int,) if whole else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
                raise InvalidArgumentError(
                    f"Data-service limit {field.name} = {value!r} must be a positive "
                    f"{'int' if whole else 'number of seconds'} (default "
                    f"{field.default!r}). Give e.g. {field.name}={field.default!r}.")


def limit_names(server: str | None = None) -> list[str]:
    """The ServiceLimits fields (those ``server``, "dispatcher" or "worker", applies), in
    table order."""
    return [field.name for field in dataclasses.fields(ServiceLimits)
            if server in (None, field.metadata["server"])]


def as_service_limits(value: Any) -> ServiceLimits:
    """``value`` (a ServiceLimits, a dict of its fields, or None) as ServiceLimits."""
    if value is None:
        return ServiceLimits()
    if isinstance(value, ServiceLimits):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(limit_names()))
        if unknown:
            raise InvalidArgumentError(
                f"Unknown data-service limit(s) {unknown}: the limits are "
                f"{', '.join(limit_names())}.")
        return ServiceLimits(**value)
    raise InvalidArgumentError(
        f"`limits` must be a ServiceLimits or a dict of its fields, got "
        f"{type(value).__name__}: give e.g. limits={{'max_jobs': 1000}}.")


def parse_limit(text: str, server: str) -> tuple[str, int | float]:
    """One ``NAME=VALUE`` of ``server``'s command line (``--limit``) as (name, value)."""
    name, sep, raw = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in limit_names(server):
        raise InvalidArgumentError(
            f"--limit {text!r}: give NAME=VALUE with NAME one of the {server}'s limits: "
            f"{', '.join(limit_names(server))}.")
    whole = ServiceLimits.__dataclass_fields__[name].type == "int"
    try:
        value: int | float = int(raw, 0) if whole else float(raw)
    except ValueError:
        raise InvalidArgumentError(
            f"--limit {name}={raw!r}: the value must be {'an int' if whole else 'a number'} "
            f"(default {getattr(ServiceLimits, name)!r}).") from None
    return name, value


def limits_help(server: str) -> str:
    """``server``'s limits and their defaults, for ``--help``."""
    return "; ".join(f"{field.name} (default {field.default!r}): {field.metadata['bounds']}"
                     for field in dataclasses.fields(ServiceLimits)
                     if field.metadata["server"] == server)
