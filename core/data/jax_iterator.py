"""JAX adapter: a data-service dataset read as ``jax.Array``s, placed on devices ahead of use.

``JaxIterator(dataset, processing_mode, service, ..., sharding=, device=, prefetch=2)`` takes
``distribute``'s arguments and yields the service's elements with their numeric numpy arrays
and numpy scalars as ``jax.Array``s (``to_jax``), for a training loop.

* **Placement**: every numeric leaf of an element is ``jax.device_put`` on ``sharding`` (a
  ``jax.sharding.Sharding``, e.g. a ``NamedSharding`` splitting a batch over a mesh of this
  process's devices) or ``device`` (a ``jax.Device``); by default, uncommitted on jax's
  default device, as ``jnp.asarray`` places.
* **Prefetch**: when the loop asks for an element, the iterator first tops its queue up to
  ``prefetch`` placed elements beyond the one it returns (``flax.jax_utils.prefetch_to_device``'s
  scheme). ``jax.device_put`` returns before a transfer to an accelerator is done, so the
  next elements' transfers overlap the loop's step; the service's reader fetches and decodes
  on threads of its own. The iterator never holds more than ``prefetch`` elements beyond the
  one returned, and a read error is raised after the elements pulled before it.
* **Copies**: on the CPU backend ``jax.device_put`` shares a numpy array's memory when the
  array is 64-byte aligned and keeps its dtype, else copies it once. Elements over
  ``grpc+local`` live in page-aligned sealed shared-memory segments and arrive without a
  copy; over ``grpc``, arrays share when the receive buffer happens to be aligned. Sharing
  read-only memory is safe both ways: nobody writes it (a sealed segment, or a frozen view
  from a server of this process), and jax never writes through (its arrays are immutable,
  and a donated buffer that jax does not own is copied, not reused).
* **dtypes** are jax's: with ``jax_enable_x64`` off (jax's default) 64-bit arrays become
  32-bit ones, as ``jnp.asarray`` makes them (int64 values outside int32 wrap); enable x64 or
  cast in the pipeline. Tuples, lists and dicts keep their structure (dicts as jax pytrees:
  keys sorted); bytes, str, Python numbers and arrays of other dtypes stay as they are.

With ``element_ids=True`` it yields ``(ids, element)``: the provenance id of each element
(a batch: the list of its rows' ids) as Python ints and lists, beside the placed element
(see ``clusterwire.data.provenance``).

An iterator reads one pass (one job, as one iteration of ``distribute``'s dataset); make a
new one per epoch. ``close()`` (or leaving a ``with`` block) releases its job early.
Importing this module imports jax; ``clusterwire.data`` never does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from clusterwire import errors
from clusterwire.data.client import (
    check_adapter_dataset,
    check_distribute_arguments,
    from_dataset_id,
    register_dataset,
)
from clusterwire.data.dataset import Dataset
from clusterwire.data.elements import NUMERIC_KINDS
from clusterwire.data.position import Position
from clusterwire.errors import InvalidArgumentError
from clusterwire.security import Security


def _is_numeric(leaf: Any) -> bool:
    return isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype.kind in NUMERIC_KINDS


def to_jax(element: Any, placement: jax.sharding.Sharding | jax.Device | None = None) -> Any:
    """``element`` with its numeric numpy arrays and numpy scalars as ``jax.Array``s.

    All of them are placed by one ``jax.device_put(..., placement)`` (None: jax's default
    device, uncommitted). Byte-swapped arrays are made native first (jax holds no other).
    The structure is kept as a jax pytree; other leaves stay as they are.
    """
    leaves, structure = jax.tree_util.tree_flatten(element)
    numeric = [index for index, leaf in enumerate(leaves) if _is_numeric(leaf)]
    arrays = [leaves[index] for index in numeric]
    arrays = [array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))
              for array in arrays]
    for index, placed in zip(numeric, jax.device_put(arrays, placement), strict=True):
        leaves[index] = placed
    return jax.tree_util.tree_unflatten(structure, leaves)


def _placement(sharding: Any, device: Any) -> jax.sharding.Sharding | jax.Device | None:
    if sharding is not None and device is not None:
        raise InvalidArgumentError(
            f"JaxIterator got both sharding={sharding!r} and device={device!r}: pass one "
            "(a device is the sharding jax.sharding.SingleDeviceSharding(device)).")
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(f"`sharding` must be a jax.sharding.Sharding, got {sharding!r}")
    if device is not None and not isinstance(device, jax.Device):
        raise TypeError(f"`device` must be a jax.Device (e.g. jax.devices()[0]), got {device!r}")
    return sharding if sharding is not None else device


def _prefetch(value: Any) -> int:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise InvalidArgumentError(
        f"`prefetch` must be an int >= 0 (elements placed ahead of the one returned), got "
        f"{value!r}")


class JaxIterator(Iterator[Any]):
    """An iterator of ``dataset``'s elements read through the tf.data service, as jax arrays.

    ``dataset``: a ``clusterwire.data.Dataset`` (registered with the dispatcher here) or the
    id ``register_dataset`` returned. The positional and ``config`` arguments are
    ``distribute``'s, with its checks and errors. ``sharding`` or ``device``: where elements
    go (default: jax's default device); ``prefetch``: how many elements are placed ahead of
    the one returned; ``element_ids``: yield ``(ids, element)`` pairs (as ``distribute``'s).
    See the module docstring for placement, prefetch and copies.
    """

    def __init__(self, dataset: Dataset | str, processing_mode: Any, service: Any,
                 job_name: str | None = None, consumer_index: int | None = None,
                 num_consumers: int | None = None,
                 max_outstanding_requests: int | None = None,
                 data_transfer_protocol: str | None = None, compression: str | None = "AUTO",
                 target_workers: str = "AUTO", *,
                 config: Mapping[str, Any] | Security | None = None,
                 sharding: jax.sharding.Sharding | None = None,
                 device: jax.Device | None = None, prefetch: int = 2,
                 state: Mapping[str, Any] | None = None, element_ids: bool = False):
        job_name = check_distribute_arguments(
            processing_mode, service, job_name, consumer_index, num_consumers,
            max_outstanding_requests, target_workers, compression)
        self._placement = _placement(sharding, device)
        self._prefetch = _prefetch(prefetch)
        check_adapter_dataset(dataset, "JaxIterator")
        if isinstance(dataset, Dataset):
            dataset = register_dataset(service, dataset, compression, config=config)
        self._reader = iter(from_dataset_id(
            processing_mode, service, dataset, job_name=job_name,
            consumer_index=consumer_index, num_consumers=num_consumers,
            max_outstanding_requests=max_outstanding_requests,
            data_transfer_protocol=data_transfer_protocol, target_workers=target_workers,
            config=config, state=state, element_ids=element_ids))
        self._element_ids = element_ids
        self._source: Iterator[Any] | None = self._reader
        # Placed elements pulled ahead, each beside the reader's position after it (None:
        # this read has no position; _no_position says why).
        self._queue: deque[tuple[Any, Position | None]] = deque()
        self._error: Exception | None = None
        self._no_position: errors.OpError | None = None
        self._position = self._reader_position()  # after the last element returned

    def __iter__(self) -> JaxIterator:
        return self

    def __next__(self) -> Any:
        while self._source is not None and len(self._queue) <= self._prefetch:
            try:
                element = next(self._source)
                placed = ((element[0], to_jax(element[1], self._placement))
                          if self._element_ids else to_jax(element, self._placement))
                self._queue.append((placed, self._reader_position()))
            except StopIteration:
                self._source = None
            except Exception as err:  # raised once the elements pulled before it are taken
                self._error = err
                self._stop_reading()
        if self._queue:
            value, self._position = self._queue.popleft()
            return value
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        raise StopIteration

    def _reader_position(self) -> Position | None:
        if self._no_position is not None:
            return None
        try:
            return self._reader.position()
        except (errors.UnimplementedError, errors.FailedPreconditionError) as err:
            self._no_position = err
            return None

    def state_dict(self) -> dict[str, Any]:
        """The position after the last element returned (elements prefetched beyond it are
        not counted): ``JaxIterator(..., state=...)`` resumes there, every element once, as
        ``distribute``'s iterators do (see ``clusterwire.data.position``)."""
        if self._no_position is not None:
            raise self._no_position
        self._reader.keep_splits()
        return self._position.to_dict()

    def _stop_reading(self) -> None:
        source, self._source = self._source, None
        close = getattr(source, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """Release the job and drop the queued elements; the iterator then ends."""
        self._stop_reading()
        self._queue.clear()
        self._error = None

    def __enter__(self) -> JaxIterator:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
