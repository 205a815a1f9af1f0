"""Provenance through the framework adapters (issue 31): ``ServiceDataset(...,
element_ids=True)`` yields ``(ids, tensors)`` and ``merge_loader_states(...,
skip_ids=...)`` leaves those elements out of the resumed epoch; ``JaxIterator(...,
element_ids=True)`` yields ``(ids, jax arrays)``. A real in-process service, 2 workers."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from conftest import in_process_data_service

from clusterwire import data
from clusterwire.data import provenance

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
from clusterwire.data.torch_dataset import ServiceDataset, merge_loader_states  # noqa: E402

pytestmark = pytest.mark.timeout(180)

COUNT = 4 * 4096
BATCH = 16


@pytest.fixture(scope="module")
def service():
    with in_process_data_service(workers=2) as dispatcher:
        yield dispatcher


def test_torch_ids_with_batches_and_a_skip_on_resume(service):
    def dataset(**options) -> ServiceDataset:
        return ServiceDataset(data.Dataset.range(COUNT).batch(BATCH), "distributed_epoch",
                              service.target, job_name="torch-ids", element_ids=True,
                              max_outstanding_requests=1, **options)

    ranks = [dataset() for _ in range(2)]
    iterators = [iter(rank) for rank in ranks]
    before = [next(it) for it in iterators for _ in range(20)]
    assert all(isinstance(ids, list) and torch.equal(batch, torch.tensor(ids))
               for ids, batch in before)
    states = [json.loads(json.dumps(rank.state_dict())) for rank in ranks]
    spike = [next(it) for it in iterators for _ in range(3)]  # the steps to drop
    for it in iterators:
        it.close()
    merged = merge_loader_states(states, skip_ids=[ids for ids, _ in spike])
    resumed = dataset()
    resumed.load_state_dict(merged)
    rest = list(resumed)
    skipped = {i for ids, _ in spike for i in ids}
    assert len(skipped) == 6 * BATCH
    assert Counter(i for ids, _ in before + rest for i in ids) == \
        Counter(set(range(COUNT)) - skipped)


def test_jax_ids_beside_placed_elements(service):
    jax_iterator = pytest.importorskip("clusterwire.data.jax_iterator",
                                       reason="JAX is not installed")
    dataset = data.Dataset.range(1000).global_shuffle(seed=2).batch(BATCH)
    with jax_iterator.JaxIterator(dataset, "distributed_epoch", service.target,
                                  element_ids=True) as iterator:
        pairs = list(iterator)
    assert sorted(i for ids, _ in pairs for i in ids) == list(range(1000))
    for ids, batch in pairs:
        assert np.array_equal(np.asarray(batch), np.asarray(ids))
    assert provenance.flatten([ids for ids, _ in pairs[:2]]) == pairs[0][0] + pairs[1][0]
