"""Job positions through the framework adapters (issue 31): the per-loader-worker positions
of torchdata StatefulDataLoaders (``merge_loader_states``) and JaxIterator positions
(``merge_states``), saved by N consumers and resumed by a different number, every element
of the epoch once over the run."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import in_process_data_service, read_together
from test_data_torch import CONTEXT, data_service_processes, stateful_loader

from clusterwire import data, errors

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
from clusterwire.data.torch_dataset import ServiceDataset, merge_loader_states  # noqa: E402

pytestmark = pytest.mark.timeout(180)

COUNT = 4000


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11's own call
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker")  # on 2 cores
def test_loader_worker_positions_of_two_ranks_resume_on_three_loader_workers():
    """2 ranks x 2 loader workers (4 consumers of one job: the ranks' loaders seeded alike)
    save at step 5 and stop; 1 rank x 3 loader workers reads the rest, then a whole epoch."""

    def dataset(**options) -> ServiceDataset:
        return ServiceDataset(data.Dataset.range(COUNT), "distributed_epoch",
                              dispatcher.target, job_name="ranks", **options)

    with data_service_processes() as dispatcher:
        loaders, iterators = [], []
        for _ in range(2):
            # One element a read: no loader worker takes splits ahead (an in-order loader
            # waits for each of its workers in turn).
            loaders.append(stateful_loader(dataset(max_outstanding_requests=1),
                                           batch_size=10, num_workers=2,
                                           multiprocessing_context=CONTEXT))
            torch.manual_seed(0)  # the ranks' loader epochs name the same job
            iterators.append(iter(loaders[-1]))
        before = [int(x) for it in iterators for _ in range(5) for x in next(it)]
        states = [loader.state_dict() for loader in loaders]
        for it in iterators:
            next(it), next(it)  # read after the checkpoint: read again after the resume
        del iterators, loaders  # the trainers stop (their loader workers exit)
        merged = merge_loader_states(states, num_workers=3)
        assert len(merged["_snapshot"]["_worker_snapshots"]) == 3
        resumed = dataset()
        loader = stateful_loader(resumed, batch_size=10, num_workers=3,
                                 multiprocessing_context=CONTEXT, in_order=False)
        loader.load_state_dict(merged)
        rest = [int(x) for batch in loader for x in batch]
        # The next epoch is a whole new one (torchdata gave the state to one epoch only).
        assert sorted(int(x) for batch in loader for x in batch) == list(range(COUNT))
        # The merged ServiceDataset state, loaded into the dataset itself, would reach
        # every epoch's loader workers: refused in them.
        resumed.load_state_dict(merge_loader_states(states))
        refused = torch.utils.data.DataLoader(resumed, num_workers=1, timeout=30,
                                              multiprocessing_context=CONTEXT)
        with pytest.raises(errors.FailedPreconditionError, match="every epoch"):
            next(iter(refused))
    assert Counter(before + rest) == Counter(range(COUNT))


def test_jax_iterators_resume_on_another_number():
    jax_iterator = pytest.importorskip("clusterwire.data.jax_iterator")
    with in_process_data_service() as dispatcher:
        dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(COUNT))

        def iterator(state=None):
            return jax_iterator.JaxIterator(dataset_id, "distributed_epoch",
                                            dispatcher.target, job_name="jax",
                                            max_outstanding_requests=1, state=state)

        old = [iterator() for _ in range(3)]
        before = [int(next(it)) for it in old for _ in range(20)]
        merged = data.merge_states([it.state_dict() for it in old])
        for it in old:
            next(it)
            it.close()
        rest = read_together([iterator(merged) for _ in range(2)])
    assert Counter(before + rest) == Counter(range(COUNT))
