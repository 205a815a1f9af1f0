"""Processing modes, sharding policies and the argument checks of ``distribute``.

Names, values and error messages are tf.data service's
(``tf.data.experimental.service``), so code written for TF fails the same way.
"""

from __future__ import annotations

import enum
from typing import Any

from clusterwire import errors
from clusterwire.addressing import split_target
from clusterwire.data.addresses import dispatcher_addresses


class ShardingPolicy(enum.IntEnum):
    """How a job's work is divided between workers (TF's values).

    OFF: every worker produces the whole dataset ("parallel_epochs").
    DYNAMIC: the dispatcher hands out splits of the source ("distributed_epoch").
    FILE, DATA, FILE_OR_DATA: static shards, worker i of the configured
    ``worker_addresses`` reads shard i (files, elements, files if the source
    has files else elements). HINT: shard where the pipeline has shard hints;
    clusterwire pipelines have none, so it behaves as OFF with a fixed worker list.
    """

    OFF = 0
    DYNAMIC = 1
    FILE = 2
    DATA = 3
    FILE_OR_DATA = 4
    HINT = 5


STATIC_POLICIES = frozenset(
    {ShardingPolicy.FILE, ShardingPolicy.DATA, ShardingPolicy.FILE_OR_DATA, ShardingPolicy.HINT})

# Compression names as they travel: AUTO (compress when it pays off), forced snappy, none.
COMPRESSION_AUTO, COMPRESSION_SNAPPY, COMPRESSION_OFF = "auto", "snappy", ""
_COMPRESSIONS = {"AUTO": COMPRESSION_AUTO, "SNAPPY": COMPRESSION_SNAPPY, None: COMPRESSION_OFF}
_TARGET_WORKERS = ("AUTO", "ANY", "LOCAL")


def sharding_policy(processing_mode: Any) -> ShardingPolicy:
    """The ShardingPolicy a ``processing_mode`` argument stands for."""
    if isinstance(processing_mode, ShardingPolicy):
        return processing_mode
    if processing_mode == "parallel_epochs":
        return ShardingPolicy.OFF
    if processing_mode == "distributed_epoch":
        return ShardingPolicy.DYNAMIC
    raise ValueError(
        "tf.data service processing mode should be a "
        "`tf.data.experimental.service.ShardingPolicy`, `\"parallel_epochs\"`, or "
        f"`\"distributed_epoch\"`. Got {processing_mode!r}.")


def policy_of(value: int) -> ShardingPolicy:
    """The ShardingPolicy a request names; InvalidArgumentError for a number that is none."""
    try:
        return ShardingPolicy(value)
    except ValueError:
        raise errors.InvalidArgumentError(
            f"Unknown sharding policy {value}: a request names one of "
            f"{', '.join(f'{p.name} ({p.value})' for p in ShardingPolicy)}.") from None


def mode_name(policy: int) -> str:
    """How a user names ``policy``: "parallel_epochs", "distributed_epoch" or its name."""
    names = {ShardingPolicy.OFF: "parallel_epochs", ShardingPolicy.DYNAMIC: "distributed_epoch"}
    return names.get(ShardingPolicy(policy), ShardingPolicy(policy).name)


def compression_name(compression: Any) -> str:
    """The wire name of a ``compression`` argument ("AUTO", "SNAPPY" or None)."""
    if isinstance(compression, str) or compression is None:
        found = _COMPRESSIONS.get(compression)
        if found is not None:
            return found
    raise ValueError(
        f"Invalid `compression` argument: {compression}. Must be one of "
        "['AUTO', None, 'SNAPPY'].")


def parse_service(service: Any) -> tuple[str, str]:
    """``(protocol, "host:port")`` of a ``service`` argument ("[proto://]addr" or a tuple);
    the address may list a primary dispatcher and its standbys, "host1:port1,host2:port2"
    (``clusterwire.data.addresses``)."""
    if isinstance(service, tuple) and len(service) == 2:
        protocol, address = service
    elif isinstance(service, str):
        if not service:
            raise ValueError("`service` must not be empty")
        if service.count("://") > 1:
            raise ValueError(f"Malformed `service` string has multiple '://': {service}")
        protocol, address = split_target(service)
    else:
        raise ValueError(
            "`service` must be a string or a tuple of (protocol, address), but got "
            f"{service!r}")
    if not isinstance(protocol, str) or not isinstance(address, str):
        raise ValueError(f"`service` tuple must hold two strings, got {service!r}")
    dispatcher_addresses(address)
    return protocol, address


def check_job_name(job_name: Any) -> str | None:
    """``job_name`` if valid (None or a non-empty str)."""
    if job_name is None:
        return None
    if not isinstance(job_name, str):
        raise ValueError(
            f"`job_name` must be a string, but `job_name` was of type {type(job_name).__name__}"
            f". job_name={job_name!r}")
    if not job_name:
        raise ValueError("`job_name` must not be empty")
    return job_name


def check_consumers(job_name: str | None, consumer_index: Any, num_consumers: Any) -> int:
    """Validate round-robin arguments; the number of consumers (0 = no round-robin)."""
    if num_consumers is None and consumer_index is None:
        return 0
    if num_consumers is not None and job_name is None:
        raise ValueError(
            "`job_name` must be set when setting `num_consumers`. num_consumers was set to "
            f"{num_consumers}.")
    if consumer_index is None or num_consumers is None:
        raise ValueError(
            "Must either set both `consumer_index` and `num_consumers`, or neither. "
            f"consumer_index={consumer_index}, num_consumers={num_consumers}")
    for name, value in (("consumer_index", consumer_index), ("num_consumers", num_consumers)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"`{name}` must be an int, got {value!r}")
    if num_consumers <= 0 or not 0 <= consumer_index < num_consumers:
        raise ValueError(
            f"`consumer_index` must be in [0, num_consumers) and `num_consumers` > 0; got "
            f"consumer_index={consumer_index}, num_consumers={num_consumers}")
    return num_consumers


def check_target_workers(target_workers: Any) -> str:
    """``target_workers`` upper-cased ("AUTO", "ANY" or "LOCAL")."""
    if isinstance(target_workers, str) and target_workers.upper() in _TARGET_WORKERS:
        return target_workers.upper()
    raise ValueError(
        f"Invalid `target_workers` argument: {target_workers}. Must be one of "
        "['AUTO', 'ANY', 'LOCAL'].")


def check_max_outstanding(value: Any) -> int | None:
    """``max_outstanding_requests``: None or a positive int."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`max_outstanding_requests` must be a positive int, got {value!r}")
    return value
