"""The JAX iterator against real servers on 127.0.0.1: a dispatcher and two workers in this
process, read from here and, over grpc+local and on two devices, from a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from collections import Counter

import cw_data_functions as fns
import numpy as np
import pytest
from conftest import in_process_data_service

from clusterwire import data, errors
from clusterwire.plugins import get_plugin_manager

jax = pytest.importorskip(
    "jax", reason="JAX is not installed (pip install 'clusterwire[jax]'; CI installs the CPU "
    "build)")

from clusterwire.data import jax_iterator  # noqa: E402
from clusterwire.data.jax_iterator import JaxIterator, to_jax  # noqa: E402

pytestmark = pytest.mark.timeout(90)
LOCAL = "grpc+local" in get_plugin_manager().protocols()
# A trainer process with two CPU devices: a batch split over both, elements on the second,
# and 1 MiB float32 elements over grpc+local placed without a copy and never written.
TRAINER = """
import sys
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from clusterwire import data
from clusterwire.data import jax_iterator
from clusterwire.data.jax_iterator import JaxIterator

target, local = sys.argv[1], sys.argv[2] == "local"
devices = jax.devices()
assert len(devices) == 2, devices
sharding = NamedSharding(Mesh(np.array(devices), ("batch",)), PartitionSpec("batch"))
rows = np.arange(32, dtype=np.float32).reshape(8, 4)
batches = list(JaxIterator(data.Dataset.from_tensor_slices(rows).batch(4), "distributed_epoch",
                           target, sharding=sharding))
assert sorted(b[0, 0].item() for b in batches) == [0.0, 16.0], batches
for batch in batches:
    assert batch.sharding == sharding and batch.shape == (4, 4)
    shards = sorted(batch.addressable_shards, key=lambda shard: shard.device.id)
    assert [shard.device for shard in shards] == devices
    first = int(batch[0, 0].item()) // 4
    for half, shard in enumerate(shards):
        assert shard.data.shape == (2, 4)
        assert (np.asarray(shard.data) == rows[first + 2 * half:first + 2 * half + 2]).all()
second = list(JaxIterator(data.Dataset.range(6), "distributed_epoch", target,
                          device=devices[1]))
assert sorted(int(x) for x in second) == list(range(6))
assert all(x.devices() == {devices[1]} and x.committed for x in second)
if local:
    received = []
    real = jax_iterator.to_jax

    def recording(element, placement=None):
        received.append((element, element.copy()))
        return real(element, placement)

    jax_iterator.to_jax = recording
    big = np.arange(4 * 262144, dtype=np.float32).reshape(4, 262144)
    got = list(JaxIterator(data.Dataset.from_tensor_slices(big), "distributed_epoch", target,
                           data_transfer_protocol="grpc+local", compression=None))
    assert sorted(x[0].item() for x in got) == [0.0, 262144.0, 524288.0, 786432.0]
    pointers = {x.unsafe_buffer_pointer() for x in got}
    assert len(received) == 4 and all(not array.flags.writeable for array, _ in received)
    assert {array.ctypes.data for array, _ in received} == pointers, "copied"
    bumped = [jax.jit(lambda v: v + 1, donate_argnums=0)(x) for x in got]
    assert sorted(x[0].item() for x in bumped) == [1.0, 262145.0, 524289.0, 786433.0]
    assert all((array == before).all() for array, before in received), "written through"
print("sharded, placed, shared and never written")
"""


@pytest.fixture(scope="module")
def service():
    """A dispatcher and two workers in this process (serving elements over grpc+local too)."""
    transfer = {"data_transfer_protocol": "grpc+local"} if LOCAL else {}
    with in_process_data_service(**transfer) as dispatcher:
        yield dispatcher


@pytest.fixture
def pulls(monkeypatch):
    """What the iterator pulled from the service (``pulled``, in order) and whether it closed
    its source (``closed``); it still reads through the service."""
    seen = types.SimpleNamespace(pulled=[], closed=False)
    real = jax_iterator.from_dataset_id

    class Counting:
        """The service's iterator, counting what is pulled from it."""

        def __init__(self, dataset):
            self.reader = iter(dataset)
            self.position, self.keep_splits = self.reader.position, self.reader.keep_splits

        def __iter__(self):
            return self

        def __next__(self):
            element = next(self.reader)
            seen.pulled.append(int(element))
            return element

        def close(self):
            seen.closed = True
            self.reader.close()

    monkeypatch.setattr(jax_iterator, "from_dataset_id",
                        lambda *args, **kwargs: Counting(real(*args, **kwargs)))
    return seen


def _canonical(dtype):
    return jax.dtypes.canonicalize_dtype(np.dtype(dtype))


def test_elements_arrive_as_jax_arrays_equal_to_the_numpy_values(service):
    slices = (np.arange(6, dtype=np.float32).reshape(3, 2), np.array([1, 2, 3], np.uint8),
              np.array([True, False, True]), np.array([10, 20, 30], np.int64))
    got = list(JaxIterator(data.Dataset.from_tensor_slices(slices), "distributed_epoch",
                           service.target))
    got.sort(key=lambda element: int(element[1]))
    assert len(got) == 3
    for i, element in enumerate(got):
        assert isinstance(element, tuple) and len(element) == 4
        assert all(isinstance(leaf, jax.Array) for leaf in element)
        floats, byte, flag, wide = element
        assert floats.dtype == np.float32 and floats.shape == (2,)
        assert floats.tolist() == slices[0][i].tolist()
        assert byte.dtype == np.uint8 and byte.shape == () and int(byte) == slices[1][i]
        assert flag.dtype == np.bool_ and bool(flag) == slices[2][i]
        assert wide.dtype == _canonical(np.int64) and int(wide) == slices[3][i]


def test_dicts_keep_their_keys_and_non_numbers_stay(service):
    columns = {"x": np.arange(8, dtype=np.float32).reshape(4, 2), "id": np.arange(4),
               "name": np.array(["a", "b", "c", "d"])}
    got = list(JaxIterator(data.Dataset.from_tensor_slices(columns), "parallel_epochs",
                           service.target))
    assert len(got) == 8  # each worker's epoch
    for element in got:
        assert set(element) == {"x", "id", "name"}
        assert isinstance(element["x"], jax.Array) and isinstance(element["id"], jax.Array)
        assert isinstance(element["name"], str)
        index = int(element["id"])
        assert element["x"].tolist() == [2.0 * index, 2.0 * index + 1]
        assert element["name"] == "abcd"[index]
    assert sorted(int(element["id"]) for element in got) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_to_jax_keeps_nested_structure_and_leaves_non_numbers():
    nested = to_jax({"a": (np.int32(1), [np.zeros(2, np.float16), b"raw"]), "b": "text",
                     "c": 3, "d": None, "e": np.array(["w", "v"]),
                     "f": np.arange(3, dtype=">i4")})
    assert isinstance(nested["a"], tuple) and isinstance(nested["a"][1], list)
    assert nested["a"][0].dtype == np.int32 and int(nested["a"][0]) == 1
    assert nested["a"][1][0].dtype == np.float16 and nested["a"][1][0].shape == (2,)
    assert nested["a"][1][1] == b"raw" and nested["b"] == "text" and nested["c"] == 3
    assert nested["d"] is None and nested["e"].tolist() == ["w", "v"]
    assert nested["f"].dtype == np.int32 and nested["f"].tolist() == [0, 1, 2]


def test_placement_default_device_or_sharding(service):
    device = jax.devices()[0]
    dataset = data.Dataset.range(4)
    default = list(JaxIterator(dataset, "distributed_epoch", service.target))
    assert all(x.devices() == {jax.devices()[0]} and not x.committed for x in default)
    on_device = list(JaxIterator(dataset, "distributed_epoch", service.target, device=device))
    assert all(x.devices() == {device} and x.committed for x in on_device)
    sharding = jax.sharding.SingleDeviceSharding(device)
    sharded = list(JaxIterator(dataset, "distributed_epoch", service.target,
                               sharding=sharding))
    assert all(x.sharding == sharding and x.committed for x in sharded)
    for got in (default, on_device, sharded):
        assert sorted(int(x) for x in got) == [0, 1, 2, 3]


@pytest.mark.skipif(not LOCAL, reason="grpc+local is not installed")
def test_a_trainer_process_shards_places_and_shares_without_writing(service):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", TRAINER, service.target, "local"],
                          capture_output=True, text=True, timeout=80, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "sharded, placed, shared and never written"


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
def test_prefetch_places_that_many_elements_ahead_and_no_more(service, pulls, monkeypatch,
                                                              prefetch):
    placed = []
    real = jax_iterator.to_jax

    def placing(element, placement):
        placed.append(int(element))
        return real(element, placement)

    monkeypatch.setattr(jax_iterator, "to_jax", placing)
    count = 12
    iterator = JaxIterator(data.Dataset.range(count), "distributed_epoch", service.target,
                           prefetch=prefetch)
    assert pulls.pulled == []  # nothing is read before the loop asks
    taken = []
    for element in iterator:
        taken.append(int(element))
        assert len(pulls.pulled) == min(len(taken) + prefetch, count)
        assert placed == pulls.pulled  # every pulled element is already placed
        assert taken == pulls.pulled[:len(taken)]
    assert sorted(taken) == list(range(count))
    with pytest.raises(StopIteration):
        next(iterator)


def test_a_read_error_comes_after_every_element_pulled_before_it(service, pulls):
    iterator = JaxIterator(data.Dataset.range(10).map(fns.fail_at_five), "parallel_epochs",
                           service.target, prefetch=3)
    taken = []
    with pytest.raises(errors.RemoteFunctionError, match="element five is cursed"):
        for element in iterator:
            taken.append(int(element))
    assert taken == pulls.pulled  # nothing pulled was lost
    assert all(value < 5 for value in taken)
    with pytest.raises(StopIteration):
        next(iterator)


def test_close_releases_the_job_and_ends_the_iterator(service, pulls):
    with JaxIterator(data.Dataset.range(100).repeat(), "parallel_epochs", service.target,
                     prefetch=2) as iterator:
        assert [next(iterator) is not None for _ in range(3)] == [True] * 3
        assert len(pulls.pulled) == 5 and not pulls.closed
    assert pulls.closed
    with pytest.raises(StopIteration):
        next(iterator)
    assert iter(iterator) is iterator


def test_a_dataset_id_reads_the_registered_dataset(service):
    dataset_id = data.register_dataset(service.target, data.Dataset.range(5))
    got = JaxIterator(dataset_id, "distributed_epoch", service.target, job_name="jax-by-id")
    assert sorted(int(x) for x in got) == list(range(5))


def test_bad_arguments_name_the_value_and_the_fix(service):
    dataset = data.Dataset.range(3)
    for prefetch in (-1, 1.5, True, "2"):
        with pytest.raises(errors.InvalidArgumentError,
                           match=rf"`prefetch` must be an int >= 0 .*got {prefetch!r}"):
            JaxIterator(dataset, "distributed_epoch", service.target, prefetch=prefetch)
    device = jax.devices()[0]
    with pytest.raises(errors.InvalidArgumentError, match="both sharding=.* and device=.*one"):
        JaxIterator(dataset, "distributed_epoch", service.target, device=device,
                    sharding=jax.sharding.SingleDeviceSharding(device))
    with pytest.raises(TypeError, match=r"`sharding` must be a jax\.sharding\.Sharding"):
        JaxIterator(dataset, "distributed_epoch", service.target, sharding=device)
    with pytest.raises(TypeError, match=r"`device` must be a jax\.Device.*got 'cpu'"):
        JaxIterator(dataset, "distributed_epoch", service.target, device="cpu")
    distributed = dataset.apply(data.distribute("distributed_epoch", service.target))
    with pytest.raises(errors.InvalidArgumentError, match=r"before `\.apply\(distribute"):
        JaxIterator(distributed, "distributed_epoch", service.target)
    with pytest.raises(TypeError, match=r"Dataset or a dataset id .* got \[1, 2\]"):
        JaxIterator([1, 2], "distributed_epoch", service.target)
    with pytest.raises(ValueError, match=r"processing mode should be .*Got 'epochs'"):
        JaxIterator(dataset, "epochs", service.target)
    with pytest.raises(ValueError, match="`job_name` must be set"):
        JaxIterator(dataset, "parallel_epochs", service.target, consumer_index=0,
                    num_consumers=2)
    with pytest.raises(errors.NotFoundError):
        JaxIterator("no-such-dataset", "distributed_epoch", service.target)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_a_saved_position_counts_what_was_returned_not_prefetched(service, prefetch):
    """state_dict() is the position after the last element returned: a new iterator from it
    (a restarted trainer) returns the rest, every element once; prefetched ones again."""
    dataset = data.Dataset.range(300)
    iterator = JaxIterator(dataset, "distributed_epoch", service.target, prefetch=prefetch)
    before = [int(next(iterator)) for _ in range(70)]
    state = iterator.state_dict()
    assert state["elements"] == 70
    iterator.close()
    resumed = JaxIterator(dataset, "distributed_epoch", service.target, state=state)
    assert Counter(before + [int(x) for x in resumed]) == Counter(range(300))


def test_reads_without_a_position_say_so_at_state_dict(service):
    with JaxIterator(data.Dataset.range(10), "parallel_epochs", service.target,
                     job_name="shared") as iterator:
        int(next(iterator))
        with pytest.raises(errors.FailedPreconditionError, match="share its worker streams"):
            iterator.state_dict()
