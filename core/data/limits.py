"""PipelineLimits: what a worker lets a client's dataset definition make it spawn or hold.

A dataset definition comes from the network: its ``num_parallel_calls``, ``cycle_length``
and buffer sizes are numbers a client chose. ``apply`` is the one place a worker checks
them, on every pipeline it builds from a definition (and on every Dataset a user function
returns there):

* parallelism (``map``'s and ``interleave``'s ``num_parallel_calls``) above
  ``max_parallel_calls`` is clamped to it, as TF's AUTOTUNE sizes parallelism to the
  machine: parallelism is a hint, the elements and their order are the same;
* ``prefetch``'s buffer above ``max_prefetch`` is clamped (prefetch does not change the
  elements either);
* every pipeline thread (a parallel ``map``'s or ``interleave``'s pool, a ``prefetch``'s
  producer) comes out of one worker-wide ``ThreadBudget`` of ``max_pipeline_threads``: an
  iterator that finds the budget spent runs with the threads left, or none (a sequential
  map or interleave, a prefetch that passes elements through);
* sizes whose value changes the elements (``cycle_length``, ``shuffle``'s buffer, the
  batch and window sizes) are refused above their limit with an InvalidArgumentError
  naming the argument, the value, the limit and the WorkerConfig field that raises it;
* what grows as elements come (a ``cache()`` pass in memory, ``unique()``'s distinct
  elements, the open groups of ``group_by_window`` and ``bucket_by_sequence_length``) fails
  with a ResourceExhaustedError where it would pass ``max_buffer_elements``.

Local iteration (``Dataset.__iter__`` in the client) is not limited: TF's semantics there.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

from clusterwire.errors import InvalidArgumentError


def cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"PipelineLimits `{name}` must be a positive int (or None for the "
                         f"default), got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class PipelineLimits:
    """The limits a worker applies to the pipelines clients send (``WorkerConfig``'s
    ``pipeline_limits``; a dict of these fields is accepted there). None: the default.

    ``max_parallel_calls``: threads of one parallel ``map`` or ``interleave`` (clamped;
    default ``max(4, 2 * cpu_count())``). ``max_pipeline_threads``: the worker's pipeline
    threads in all (default ``max(64, 8 * cpu_count())``). ``max_prefetch``: elements one
    ``prefetch`` holds (clamped; default 1,024). ``max_cycle_length``: Datasets one
    ``interleave`` keeps open (refused above; default 256). ``max_buffer_elements``: elements
    one ``shuffle`` buffer, batch (``batch``, ``padded_batch``, ``rebatch``,
    ``bucket_by_sequence_length``), ``window`` span or ``group_by_window`` window holds
    (refused above; default 1,048,576). ``max_padded_values``: values one padded batch
    (``padded_batch``, ``bucket_by_sequence_length``) may have when its ``padded_shapes`` (or
    bucket boundary) pad it beyond its largest element (refused above; default 2**26).
    """

    max_parallel_calls: int | None = None
    max_pipeline_threads: int | None = None
    max_prefetch: int | None = None
    max_cycle_length: int | None = None
    max_buffer_elements: int | None = None
    max_padded_values: int | None = None

    def __post_init__(self) -> None:
        cpus = cpu_count()
        defaults = {"max_parallel_calls": max(4, 2 * cpus),
                    "max_pipeline_threads": max(64, 8 * cpus), "max_prefetch": 1024,
                    "max_cycle_length": 256, "max_buffer_elements": 1 << 20,
                    "max_padded_values": 1 << 26}
        for name, default in defaults.items():
            value = getattr(self, name)
            object.__setattr__(self, name, default if value is None else _positive(value, name))


def as_limits(value: Any) -> PipelineLimits:
    """``value`` (a PipelineLimits, a dict of its fields, or None) as PipelineLimits."""
    if value is None:
        return PipelineLimits()
    if isinstance(value, PipelineLimits):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {f.name for f in dataclasses.fields(PipelineLimits)}
        if unknown:
            raise TypeError(f"Unknown pipeline_limits field(s) {sorted(unknown)}; the fields "
                            f"are {[f.name for f in dataclasses.fields(PipelineLimits)]}.")
        return PipelineLimits(**value)
    raise TypeError(f"`pipeline_limits` must be a PipelineLimits or a dict of its fields, got "
                    f"{type(value).__name__}")


class ThreadBudget:
    """The worker-wide count of pipeline threads: ``take`` grants what is left of a wish
    (possibly 0, never blocking), ``give`` returns it."""

    def __init__(self, total: int):
        self.total = total
        self._used = 0
        self._lock = threading.Lock()

    def take(self, wanted: int) -> int:
        with self._lock:
            granted = max(0, min(wanted, self.total - self._used))
            self._used += granted
            return granted

    def give(self, count: int) -> None:
        with self._lock:
            self._used -= count

    @property
    def used(self) -> int:
        """Threads granted and not given back."""
        with self._lock:
            return self._used


def refuse_above(value: int, limit: int, what: str, field: str) -> None:
    """InvalidArgumentError if ``value`` (the argument ``what``) exceeds ``limit``."""
    if value > limit:
        raise InvalidArgumentError(
            f"{what} = {value} is above this tf.data service worker's limit of {limit} "
            f"elements (WorkerConfig pipeline_limits {field}): it would hold that many "
            f"elements at once. Give a smaller value, or raise {field} on the workers.")


def refuse_cycle(value: int, limit: int) -> None:
    """InvalidArgumentError if an interleave's ``cycle_length`` exceeds ``limit``."""
    if value > limit:
        raise InvalidArgumentError(
            f"interleave cycle_length = {value} is above this tf.data service worker's limit "
            f"of {limit} open Datasets (WorkerConfig pipeline_limits max_cycle_length). Give "
            "a smaller cycle_length (the order of the elements depends on it, so the worker "
            "does not clamp it), or raise max_cycle_length on the workers.")


#: Element ids a data-service position may skip (``merge_states(..., skip_ids=...)``): the
#: consumers that resume from it hold them as a set, and every later position carries them.
MAX_SKIP_IDS = 65_536
