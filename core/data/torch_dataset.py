"""PyTorch adapter: a data-service dataset as a ``torch.utils.data.IterableDataset``.

``ServiceDataset(dataset, processing_mode, service, ...)`` takes ``distribute``'s arguments
and yields the service's elements with their numpy arrays and numpy scalars as
``torch.Tensor``s (``to_torch``), for a training loop or a ``DataLoader``.

* **Copies**: a writable array becomes a tensor sharing its memory (``torch.from_numpy``, no
  copy). A read-only one lives in memory the sender still owns, and PyTorch has no read-only
  tensors (a tensor over that memory would crash on a write, or silently change the
  sender's data). In a ``grpc+local`` shared segment it is mapped again privately,
  copy-on-write (``clusterwire.private_views``): no copy up front, and a write changes only
  this process's pages. Others (small elements, a server in the same process) are copied.
* **DataLoader workers**: with ``DataLoader(num_workers=N)`` each loader worker reads as its
  own consumer of one job shared by the N workers, so the loader yields what one consumer
  would (distributed_epoch: every element once over all loader workers; parallel_epochs:
  each service worker's elements once). A ``batch_size`` batches within a loader worker (its
  last batch of an epoch may be short); ``Dataset.batch`` batches in the service. The job's
  name is ``job_name`` (or a name private to this object) and the loader iterator's base
  seed, which its workers share and a new epoch changes. Round-robin reads
  (``num_consumers=C``, ``consumer_index=c``) map loader worker w to consumer ``c * N + w``
  of ``C * N``. Processes sharing a ``job_name`` through loader workers must seed their
  DataLoaders alike (``torch.manual_seed`` or ``generator=``) so their epochs name the same
  jobs. Without loader workers an iteration reads as ``distribute``'s does: a new job each
  time, named ``job_name`` and the iteration's number.
* **distributed_epoch needs** ``DataLoader(..., in_order=False)`` with several loader
  workers: the splits one loader worker holds can leave another with nothing to read until
  they are done, and an in-order DataLoader waits for that other worker's turn, a deadlock.
* **Resuming**: ``state_dict()``/``load_state_dict()`` as torchdata's ``Stateful`` (so a
  ``torchdata.stateful_dataloader.StatefulDataLoader`` saves and restores each loader
  worker's position with its own): a trainer restarted from a checkpoint reads the rest of
  the epoch, every element once, those yielded after the checkpoint once more. Positions
  exist for distributed_epoch reads, for parallel_epochs without loader workers (loader
  workers share a parallel_epochs job's worker streams) and for round-robin reads, whose
  consumers resume from the same round (loader workers are at one round after a multiple
  of ``num_workers`` batches of an in-order loader); see ``clusterwire.data.position``.
  With loader workers, checkpoint an in-order ``StatefulDataLoader`` (its default): torchdata
  cannot snapshot an out-of-order one (it warns, and on resume skips the batches since its
  last snapshot). An in-order loader reading distributed_epoch can wait while another
  loader worker (of its process, or of another rank the trainer's steps wait for) holds
  every split left and has more of them than it reads ahead: at an epoch's end, and
  mid-epoch too when splits are short against the consumers' read-ahead (one run in five
  of examples/elastic_resume_torch.py with 8 batches a split; none in 8 with 64).
  Splits many batches long, or ``in_order=False`` (below, without exact checkpoints),
  avoid that wait.
  **On another world size** (distributed_epoch): ``merge_loader_states(states,
  num_workers=V)`` merges the loader states all the trainer's processes saved at one step
  (each loader worker's position: ``clusterwire.data.merge_states``) into the state of a
  ``StatefulDataLoader`` of V loader workers: each new process's loader ``load_state_dict``s
  it, and every loader worker of every new process (any number of each) resumes as a new
  consumer of the job, for the next epoch only (torchdata's rule). The old loaders' own
  states do not load into loaders of another ``num_workers`` (torchdata's check). Without
  ``num_workers`` it is a ``ServiceDataset`` state, for reading without loader workers;
  loaded into a ``ServiceDataset`` read by loader workers it is refused
  (``FailedPreconditionError``): the DataLoader would hand it to every epoch's workers.
* **fork**: gRPC does not survive a fork of a process that has used it. The dataset is
  registered by the process that reads it, so a DataLoader's parent that only builds the
  ``ServiceDataset`` forks its workers safely. A parent that used the service itself (read
  it, ran a Session or a server) must start its loader workers with
  ``multiprocessing_context="forkserver"`` (or "spawn"); a loader worker forked from a
  process running servers says so.

* **Provenance**: ``ServiceDataset(..., element_ids=True)`` yields ``(ids, element)``, the
  provenance id of each element (a service-side batch: the list of its rows' ids) as Python
  ints and lists beside the tensors (``clusterwire.data.provenance``); a loader
  ``batch_size`` collates them as any ints. ``merge_loader_states(..., skip_ids=ids)``
  leaves the elements of those ids out of the resumed epoch (``merge_states``).

Importing this module imports torch; ``clusterwire.data`` never does.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from clusterwire import in_process
from clusterwire.data import graph, provenance
from clusterwire.data import position as positions
from clusterwire.data.client import (
    check_adapter_dataset,
    check_distribute_arguments,
    from_dataset_id,
    register_dataset,
)
from clusterwire.data.dataset import Dataset
from clusterwire.data.elements import NUMERIC_KINDS
from clusterwire.data.position import merge_states
from clusterwire.errors import FailedPreconditionError, InvalidArgumentError
from clusterwire.private_views import private_view
from clusterwire.security import Security


def to_torch(element: Any) -> Any:
    """``element`` with its numeric numpy arrays and numpy scalars as ``torch.Tensor``s.

    Writable arrays in native byte order are shared without a copy; read-only ones over a
    transport's shared memory become tensors over a private copy-on-write mapping of it
    (``clusterwire.private_views``), other read-only or byte-swapped ones are copied.
    Tuples, lists and dicts keep their structure; bytes, str, Python numbers and arrays of
    other dtypes (strings, dates) stay as they are, as ``DataLoader``'s ``default_collate``
    expects.
    """
    if isinstance(element, np.ndarray):
        if element.dtype.kind not in NUMERIC_KINDS:
            return element
        if not element.dtype.isnative:
            element = element.astype(element.dtype.newbyteorder("="))
        elif not element.flags.writeable:
            private = private_view(element)
            element = element.copy() if private is None else private
        return torch.from_numpy(element)
    if isinstance(element, np.generic) and element.dtype.kind in NUMERIC_KINDS:
        return torch.from_numpy(np.array(element))
    if isinstance(element, (tuple, list)):
        return type(element)(to_torch(item) for item in element)
    if isinstance(element, dict):
        return {key: to_torch(value) for key, value in element.items()}
    return element


class ServiceDataset(IterableDataset):
    """An ``IterableDataset`` reading ``dataset`` through the tf.data service.

    ``dataset``: a ``clusterwire.data.Dataset`` (registered with the dispatcher by the
    process that reads it) or the id ``register_dataset`` returned. The other arguments are
    ``distribute``'s, with its checks and errors; ``element_ids``: yield ``(ids, element)``
    pairs (as ``distribute``'s). See the module docstring for copies and DataLoader
    workers.
    """

    def __init__(self, dataset: Dataset | str, processing_mode: Any, service: Any,
                 job_name: str | None = None, consumer_index: int | None = None,
                 num_consumers: int | None = None,
                 max_outstanding_requests: int | None = None,
                 data_transfer_protocol: str | None = None, compression: str | None = "AUTO",
                 target_workers: str = "AUTO", *,
                 config: Mapping[str, Any] | Security | None = None,
                 element_ids: bool = False):
        super().__init__()
        self._job_name = check_distribute_arguments(
            processing_mode, service, job_name, consumer_index, num_consumers,
            max_outstanding_requests, target_workers, compression)
        check_adapter_dataset(dataset, "ServiceDataset")
        if isinstance(dataset, Dataset):  # registered later, by the reading process:
            graph.to_def(dataset.pipeline)  # what cannot be sent to workers fails here
            if element_ids:
                provenance.check(dataset.pipeline)
        self._dataset, self._compression = dataset, compression
        self._consumer_index, self._num_consumers = consumer_index, num_consumers
        self._read = {"processing_mode": processing_mode, "service": service,
                      "max_outstanding_requests": max_outstanding_requests,
                      "data_transfer_protocol": data_transfer_protocol,
                      "target_workers": target_workers, "config": config,
                      "element_ids": element_ids}
        self._private_name = f"torch-{secrets.token_hex(8)}"
        self._readers: dict[tuple[Any, ...], Dataset] = {}
        self._iterator: Iterator[Any] | None = None  # the running iteration's reader
        self._resume: dict[str, Any] | None = None  # load_state_dict's position
        self._resume_job: str | None = None  # and the job it names (loader workers' jobs)
        # A job position loaded here, outside a loader worker: a DataLoader without
        # persistent workers would hand it to the workers of every epoch.
        self._merged_here = False

    def __getstate__(self) -> dict[str, Any]:
        # A loader worker started by spawn or forkserver makes its own readers.
        return {**self.__dict__, "_readers": {}, "_iterator": None}

    def __iter__(self) -> Iterator[Any]:
        consumer = self._consumer()
        if self._merged_here and get_worker_info() is not None:
            raise FailedPreconditionError(
                "A merged position (merge_loader_states) was loaded into the ServiceDataset "
                "itself, which hands it to the loader workers of every epoch (the next "
                "epochs' workers would join the resumed job and read nothing). Load "
                "merge_loader_states(states, num_workers=N) into the StatefulDataLoader "
                "instead (its load_state_dict): torchdata gives it to the next epoch's "
                "workers only.")
        resuming = self._resume is not None or self._resume_job is not None
        if self._resume_job is not None:
            consumer = (self._resume_job, *consumer[1:])
        reader = self._readers.get(consumer)
        if reader is None or resuming:
            reader = self._readers[consumer] = self._reader(*consumer, state=self._resume)
            self._resume = self._resume_job = None
            self._merged_here = False
        self._iterator = iterator = iter(reader)
        if self._read["element_ids"]:
            for ids, element in iterator:
                yield ids, to_torch(element)
        else:
            for element in iterator:
                yield to_torch(element)

    def state_dict(self) -> dict[str, Any]:
        """The position of this process's iteration (a loader worker's own, inside a
        ``DataLoader`` worker), as torchdata's ``Stateful``: ``load_state_dict`` makes the
        next iteration resume from it, in this process or a restarted one. Elements yielded
        after it are yielded once more by the resumed iteration, no others. See
        ``clusterwire.data.position`` for what it holds and which reads have one."""
        if self._iterator is None:  # a loader worker's first state: its job, nothing read
            job_name = self._resume_job if self._resume_job is not None else self._consumer()[0]
            return {"position": self._resume, "job_name": job_name}
        position = self._iterator.state_dict()
        return {"position": position, "job_name": None}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume the next iteration from a ``state_dict()``. One taken before the iteration
        read anything has no position: a loader worker then joins the job its peers resume
        (the one it was to read), a reader without loader workers starts anew."""
        if not isinstance(state_dict, Mapping) or "position" not in state_dict:
            raise InvalidArgumentError(
                f"ServiceDataset.load_state_dict takes what state_dict() returned, got "
                f"{state_dict!r}.")
        position, job_name = state_dict["position"], state_dict.get("job_name")
        merged = position is not None and isinstance(positions.load(position),
                                                      positions.JobPosition)
        if job_name is not None and not isinstance(job_name, str):
            raise InvalidArgumentError(f"A ServiceDataset state's job_name must be a str, got "
                                       f"{job_name!r}: pass what state_dict() returned.")
        self._resume, self._resume_job, self._iterator = position, job_name, None
        self._merged_here = merged and get_worker_info() is None

    def _reader(self, job_name: str | None, consumer_index: int | None,
                num_consumers: int | None, state: Mapping[str, Any] | None = None
                ) -> Dataset:
        """The service's dataset as this consumer reads it. The dataset is registered here,
        in the process that reads, so that a DataLoader's parent needs no gRPC of its own
        before it forks its workers (see the module docstring)."""
        dataset_id = self._dataset
        if isinstance(dataset_id, Dataset):
            dataset_id = register_dataset(self._read["service"], dataset_id, self._compression,
                                          config=self._read["config"])
        return from_dataset_id(dataset_id=dataset_id, job_name=job_name,
                               consumer_index=consumer_index, num_consumers=num_consumers,
                               state=state, **self._read)

    def _consumer(self) -> tuple[str | None, int | None, int | None]:
        """The job name, consumer index and number of consumers this process reads with."""
        info = get_worker_info()
        if info is None:
            return self._job_name, self._consumer_index, self._num_consumers
        servers = in_process.inherited_servers()
        if servers:
            raise FailedPreconditionError(
                f"DataLoader worker {info.id} was forked from a process running clusterwire "
                f"servers ({', '.join(servers)}), and gRPC cannot run in such a fork. Start "
                "the loader's workers with DataLoader(..., multiprocessing_context='spawn') "
                "(or 'forkserver'), or run the servers in processes of their own.")
        # The DataLoader iterator's base seed: the same in all its workers, new each epoch.
        epoch = info.seed - info.id
        job_name = f"{self._job_name or self._private_name}/loader-{epoch}"
        if self._num_consumers is None:
            return job_name, None, None
        return (job_name, self._consumer_index * info.num_workers + info.id,
                self._num_consumers * info.num_workers)


def merge_loader_states(states: Iterable[Mapping[str, Any]], num_workers: int | None = None,
                        skip_ids: Any = None) -> dict[str, Any]:
    """One state from the states the trainer's processes saved at one step:
    ``StatefulDataLoader.state_dict()``s (with or without loader workers) or
    ``ServiceDataset.state_dict()``s, of one distributed_epoch job (see the module
    docstring). Every new consumer resumes as a new consumer of the job, every element of
    the epoch once over the run. Loader workers that had not started reading hold no
    position and no splits, and are left out.

    ``num_workers`` (the new loader's, at least 1): the state of a ``StatefulDataLoader``
    of that many loader workers, for its ``load_state_dict`` (torchdata gives it to the
    next epoch's workers only); its format is taken from a loader state among ``states``
    saved with loader workers. Without it: a ``ServiceDataset`` state, for reading without
    loader workers. ``skip_ids``: element ids the resumed consumers leave out, as
    ``merge_states``' (e.g. the ids a ``ServiceDataset(..., element_ids=True)`` yielded for
    the steps to drop). InvalidArgumentError for anything else, and as ``merge_states`` for
    positions that do not merge."""
    states = list(states)
    found = []
    for state in states:
        for dataset_state in _dataset_states(state):
            if dataset_state.get("position") is not None:
                found.append(dataset_state["position"])
    merged = {"position": merge_states(found, skip_ids), "job_name": None}
    if num_workers is None:
        return merged
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise InvalidArgumentError(
            f"merge_loader_states' num_workers must be the new loader's number of loader "
            f"workers (at least 1), got {num_workers!r}; without loader workers, leave it "
            "out and load the state into the ServiceDataset.")
    template = next((s for s in states if isinstance(s.get("_snapshot"), Mapping)
                     and s["_snapshot"].get("_worker_snapshots")), None)
    if template is None:
        raise InvalidArgumentError(
            "merge_loader_states(..., num_workers=N) takes torchdata's loader state format "
            "from a StatefulDataLoader state saved with loader workers, and none of these "
            "states is one: pass such states, or load the merged state into a loader "
            "without loader workers.")
    snapshot = template["_snapshot"]
    worker = next(iter(snapshot["_worker_snapshots"].values()))
    fresh = {**worker.get("fetcher_state", {}), "fetcher_ended": False,
             "dataset_iter_state": None}
    # No steps since the snapshot: torchdata would skip that many batches on resume (the
    # positions are the snapshot's; what was yielded after them is read again).
    return {**template, "_steps_since_snapshot": 0, "_snapshot": {
        **snapshot, "_last_yielded_worker_id": num_workers - 1,
        "_main_snapshot": {**snapshot["_main_snapshot"], "_num_workers": num_workers},
        "_worker_snapshots": {f"worker_{i}": {**worker, "worker_id": i,
                                              "dataset_state": merged, "fetcher_state": fresh}
                              for i in range(num_workers)}}}


def _dataset_states(state: Any) -> list[Mapping[str, Any]]:
    """The ServiceDataset states in a loader's state (one per loader worker, or the
    loader's own without workers) or a ServiceDataset's."""
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(
            f"merge_loader_states takes StatefulDataLoader or ServiceDataset state_dict()s, "
            f"got {type(state).__name__}.")
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping):
        workers = snapshot.get("_worker_snapshots") or {}
        states = [worker.get("dataset_state") for worker in workers.values()
                  if isinstance(worker, Mapping)]
    else:
        states = [state.get("dataset_state", state)]
    if not all(isinstance(s, Mapping) and "position" in s for s in states):
        raise InvalidArgumentError(
            "merge_loader_states got a state without a ServiceDataset's position: pass the "
            "state_dict()s of StatefulDataLoaders over a ServiceDataset (or of ServiceDatasets), "
            "unchanged.")
    return states
