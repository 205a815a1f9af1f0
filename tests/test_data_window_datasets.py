"""A window's elements are Datasets wherever its pipeline is rebuilt: the window ops are given
the Dataset class (``dataset_type``) by whoever builds them, never import it (the Dataset
module imports them), and a client cannot send one as an argument."""

from __future__ import annotations

import pickle

import cw_tf_ops_functions as fns
import numpy as np
import pytest

from clusterwire import codec, data, errors
from clusterwire.data import graph
from clusterwire.data.permissions import WorkerPermissions

pytestmark = pytest.mark.timeout(30)

D = data.Dataset


def _rows(elements):
    return [np.asarray(e).tolist() for e in elements]


def test_window_and_group_by_window_rebuilt_on_a_worker_give_datasets():
    window = D.range(7).window(3, 2, 1, True).flat_map(fns.batch_3)
    grouped = D.range(8).group_by_window(key_func=fns.mod_2, reduce_func=fns.batch_10,
                                         window_size=2)
    for dataset, expected in [(window, [[0, 1, 2], [2, 3, 4], [4, 5, 6]]),
                              (grouped, [[0, 2], [1, 3], [4, 6], [5, 7]])]:
        definition, buffers = graph.to_def(dataset.pipeline)
        rebuilt = graph.from_def(definition, buffers, WorkerPermissions())
        assert _rows(rebuilt.run()) == expected == _rows(dataset)
    raw = graph.from_def(*graph.to_def(D.range(4).window(2).pipeline), WorkerPermissions())
    windows = list(raw.run())
    assert all(type(w) is D for w in windows)
    assert [list(map(int, w)) for w in windows] == [[0, 1], [2, 3]]


def test_a_pickled_window_pipeline_still_makes_datasets():
    pipe = pickle.loads(pickle.dumps(D.range(5).window(2).pipeline))
    windows = list(pipe.run())
    assert all(type(w) is D for w in windows)
    assert [list(map(int, w)) for w in windows] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("dataset", [
    D.range(4).window(2),
    D.range(4).group_by_window(key_func=fns.mod_2, reduce_func=fns.batch_10, window_size=2),
], ids=["window", "group_by_window"])
def test_a_dataset_type_sent_as_an_argument_is_malformed(dataset):
    definition, buffers = graph.to_def(dataset.pipeline)
    items = codec.decode(definition.payloads, list(buffers))
    node = definition.ops[0].node
    assert "dataset_type" not in items[node.params]  # never sent
    items[node.params]["dataset_type"] = "builtins:eval"
    header, buffers = codec.encode(items)
    definition.payloads.CopyFrom(header)
    for permissions in (WorkerPermissions(), None):  # a worker, the dispatcher
        with pytest.raises(errors.InvalidArgumentError,
                           match=f"Malformed dataset: '{node.kind}'.*dataset_type"):
            graph.from_def(definition, buffers, permissions)
