"""The PyTorch adapter against real servers on 127.0.0.1: a dispatcher and two workers, as
processes of their own (the usual topology, and DataLoader's forked workers need it) and in
this process (whose loader workers must be spawned)."""

from __future__ import annotations

import contextlib
import multiprocessing
import subprocess
import sys
import types
import warnings
from collections import Counter
from collections.abc import Iterator

import cw_data_functions as fns
import cw_install_hints as install
import numpy as np
import pytest
from conftest import in_process_data_service, read_together
from cw_data_procs import ServerProcess

from clusterwire import data, errors
from clusterwire.plugins import get_plugin_manager

torch = pytest.importorskip("torch", reason=f"PyTorch is not installed ({install.TORCH})")
from torch.utils.data import DataLoader  # noqa: E402

from clusterwire.data.torch_dataset import ServiceDataset, to_torch  # noqa: E402

pytestmark = pytest.mark.timeout(300)
# How long a DataLoader waits for a batch, its workers' start included: at a load of 30 on
# 2 cores a spawned worker's imports alone took over 30 s.
LOADER_TIMEOUT_S = 120
LOCAL = "grpc+local" in get_plugin_manager().protocols()
# A trainer whose loop runs in this process: pytest's process has used gRPC (other tests), so
# its loader workers start from a fork server (the module docstring's rule). The default fork
# is tested in a trainer process of its own.
CONTEXT = "forkserver"
# A trainer script's fork server imports the script (its __main__), torch with it; pytest's
# would not, and each loader worker would import torch anew (seconds on a loaded machine).
multiprocessing.set_forkserver_preload(["torch"])
TRAINER = """
import sys
from torch.utils.data import DataLoader
from clusterwire import data
from clusterwire.data.torch_dataset import ServiceDataset

dataset = ServiceDataset(data.Dataset.range(300), "distributed_epoch", sys.argv[1])
for epoch in range(3):
    loader = DataLoader(dataset, batch_size=None, num_workers=2, in_order=False, timeout=120)
    got = sorted(int(x) for x in loader)
    assert got == list(range(300)), (epoch, len(got), len(set(got)))
print("every element once in 3 epochs")
"""


@contextlib.contextmanager
def data_service_processes() -> Iterator[ServerProcess]:
    """A dispatcher and two worker processes (serving elements over grpc+local too)."""
    servers = [ServerProcess("dispatcher", "--port", "0", "--bind-address", "127.0.0.1")]
    try:
        transfer = ("--data-transfer-protocol", "grpc+local") if LOCAL else ()
        servers += [ServerProcess("worker", "--dispatcher-address", servers[0].address,
                                  "--port", "0", "--worker-address", "127.0.0.1:%port%",
                                  "--import", "cw_data_functions", *transfer)
                    for _ in range(2)]
        yield servers[0]
    finally:
        for server in servers:
            server.close()


@pytest.fixture(scope="module")
def service():
    """A data service shared by the module's tests."""
    with data_service_processes() as dispatcher:
        yield dispatcher


@pytest.fixture
def fresh_service():
    """A data service of this test alone. The module's shared workers hold the streams
    the earlier tests' stopped loader workers left (80-100 each, finished or not); a test on
    them timed out once in CI waiting for its first batch (not reproduced in 20 runs), so a
    test of exact counts does not share them."""
    with data_service_processes() as dispatcher:
        yield dispatcher


@pytest.fixture
def in_process_service():
    """A dispatcher and two workers in this process."""
    with in_process_data_service() as dispatcher:
        yield dispatcher


def test_elements_arrive_as_tensors_equal_to_the_numpy_values(service):
    slices = (np.arange(6, dtype=np.float32).reshape(3, 2), np.array([1, 2, 3], np.uint8),
              np.array([True, False, True]))
    ds = ServiceDataset(data.Dataset.from_tensor_slices(slices), "distributed_epoch",
                        service.target)
    got = sorted(ds, key=lambda element: int(element[1]))
    assert len(got) == 3
    for i, (floats, byte, flag) in enumerate(got):
        assert floats.dtype == torch.float32 and floats.tolist() == slices[0][i].tolist()
        assert byte.dtype == torch.uint8 and byte.shape == () and int(byte) == slices[1][i]
        assert flag.dtype == torch.bool and bool(flag) == slices[2][i]
    named = ServiceDataset(data.Dataset.from_tensor_slices({"x": np.arange(4.0)}),
                           "parallel_epochs", service.target)
    values = sorted(float(element["x"]) for element in named)
    assert values == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]


def test_to_torch_shares_writable_memory_and_leaves_non_numbers():
    array = np.arange(12, dtype=np.int64).reshape(3, 4)
    tensor = to_torch(array)
    assert tensor.data_ptr() == array.ctypes.data  # no copy
    tensor[0, 0] = 100
    assert array[0, 0] == 100
    assert to_torch(np.float64(2.5)).dtype == torch.float64
    nested = to_torch({"a": (np.int32(1), [np.zeros(2, np.float16)]), "b": b"raw", "c": 3})
    assert nested["a"][0].dtype == torch.int32 and isinstance(nested["a"], tuple)
    assert nested["a"][1][0].dtype == torch.float16 and isinstance(nested["a"][1], list)
    assert nested["b"] == b"raw" and nested["c"] == 3
    words = np.array(["a", "b"])
    assert to_torch(words) is words and to_torch(np.bytes_(b"x")) == b"x"
    swapped = to_torch(np.arange(3, dtype=">i4"))
    assert swapped.dtype == torch.int32 and swapped.tolist() == [0, 1, 2]


def test_read_only_arrays_are_copied_once_never_shared():
    array = np.arange(5.0)
    array.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a non-writable array: never reached
        tensor = to_torch(array)
    assert tensor.data_ptr() != array.ctypes.data
    tensor += 1
    assert array.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_grpc_elements_are_not_copied_and_grpc_local_ones_are(service, monkeypatch):
    from clusterwire.data import torch_dataset

    pointers = []
    original = torch_dataset.to_torch

    def recording(element):
        tensor = original(element)
        pointers.append((element.flags.writeable, element.ctypes.data, tensor.data_ptr()))
        return tensor

    monkeypatch.setattr(torch_dataset, "to_torch", recording)
    ds = data.Dataset.range(8).map(fns.fill_2k)
    over_grpc = ServiceDataset(ds, "distributed_epoch", service.target, compression=None)
    assert sorted(int(t[0]) for t in over_grpc) == list(range(8))
    assert pointers and all(writable and array == tensor for writable, array, tensor in pointers)
    if not LOCAL:
        return
    pointers.clear()
    local = ServiceDataset(ds, "distributed_epoch", service.target,
                           data_transfer_protocol="grpc+local")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensors = list(local)
    assert sorted(int(t[0]) for t in tensors) == list(range(8))
    assert pointers and all(not writable and array != tensor
                            for writable, array, tensor in pointers)
    for tensor in tensors:
        tensor.fill_(-1)  # the copies are the loop's own


def test_shared_segments_become_copy_on_write_tensors_not_copies(service, monkeypatch):
    """1 MiB elements over grpc+local arrive in sealed segments: each tensor maps its
    segment privately (no copy up front); writing it changes neither the segment nor the
    numpy view the reader had."""
    if not LOCAL:
        pytest.skip("grpc+local is not installed")
    from clusterwire.data import torch_dataset

    pairs, mapped = [], []
    original_view, original_to_torch = torch_dataset.private_view, torch_dataset.to_torch
    monkeypatch.setattr(torch_dataset, "private_view",
                        lambda array: mapped.append(original_view(array)) or mapped[-1])

    def recording(element):
        tensor = original_to_torch(element)
        pairs.append((element, tensor))
        return tensor

    monkeypatch.setattr(torch_dataset, "to_torch", recording)
    ds = ServiceDataset(data.Dataset.range(6).map(fns.fill_1m), "distributed_epoch",
                        service.target, data_transfer_protocol="grpc+local", compression=None)
    assert sorted(int(t[0]) for t in ds) == list(range(6))
    assert len(mapped) == 6 and all(view is not None for view in mapped)
    for element, tensor in pairs:
        assert not element.flags.writeable and tensor.data_ptr() != element.ctypes.data
        value = int(element[0])
        tensor.fill_(-1)  # the loop's own pages now
        assert int(element[0]) == int(element[-1]) == value and int(tensor.sum()) == -(1 << 17)


def test_a_trainer_process_forks_its_loader_workers_every_element_once(service, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    done = subprocess.run([sys.executable, str(script), service.target], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "every element once in 3 epochs"


@pytest.mark.parametrize("persistent", [False, True])
def test_loader_workers_share_a_distributed_epoch_every_element_once(service, persistent):
    ds = ServiceDataset(data.Dataset.range(200), "distributed_epoch", service.target)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent,
                        in_order=False, multiprocessing_context=CONTEXT, timeout=LOADER_TIMEOUT_S)
    for _epoch in range(2):
        got = [int(x) for x in loader]
        assert sorted(got) == list(range(200))


def test_loader_workers_share_a_parallel_epochs_job(service):
    ds = ServiceDataset(data.Dataset.range(50), "parallel_epochs", service.target)
    got = [int(x) for x in DataLoader(ds, batch_size=None, num_workers=2,
                                      multiprocessing_context=CONTEXT, timeout=LOADER_TIMEOUT_S)]
    assert sorted(got) == sorted(list(range(50)) * 2)  # each service worker's epoch once


def test_loader_batches_with_default_collate(service):
    ds = ServiceDataset(data.Dataset.from_tensor_slices(
        (np.arange(40, dtype=np.float32).reshape(20, 2), np.arange(20))),
        "distributed_epoch", service.target)
    batches = list(DataLoader(ds, batch_size=4, num_workers=2, in_order=False,
                              multiprocessing_context=CONTEXT, timeout=LOADER_TIMEOUT_S))
    # batches are made per loader worker: each worker's last one may be short
    assert all(1 <= len(labels) <= 4 and features.shape == (len(labels), 2)
               for features, labels in batches)
    assert sum(len(labels) < 4 for _, labels in batches) <= 2
    features = torch.cat([f for f, _ in batches])
    labels = torch.cat([label for _, label in batches])
    assert features.dtype == torch.float32 and labels.dtype == torch.int64
    assert sorted(labels.tolist()) == list(range(20))
    assert all(f.tolist() == [2.0 * label, 2.0 * label + 1] for f, label in
               zip(features, labels.tolist(), strict=True))


def test_round_robin_consumers_map_to_loader_workers(service):
    def trainer(index):
        ds = ServiceDataset(data.Dataset.range(1000).repeat(), "parallel_epochs",
                            service.target, job_name="torch-rr", consumer_index=index,
                            num_consumers=2)
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=CONTEXT,
                            timeout=LOADER_TIMEOUT_S, generator=torch.Generator().manual_seed(7))
        taken = []
        for x in loader:
            taken.append(int(x))
            if len(taken) == 8:
                return taken
        return taken

    # Trainer c's loader worker w reads as consumer 2c + w of 4; the loader alternates workers.
    assert trainer(0) == [0, 1, 0, 1, 4, 5, 4, 5]
    assert trainer(1) == [2, 3, 2, 3, 6, 7, 6, 7]


def test_without_loader_workers_each_iteration_is_a_new_job(service):
    ds = ServiceDataset(data.Dataset.range(10), "distributed_epoch", service.target,
                        job_name="torch-main")
    assert [sorted(int(x) for x in ds) for _ in range(2)] == [list(range(10))] * 2


def test_bad_arguments_name_the_value_and_the_fix(service):
    distributed = data.Dataset.range(3).apply(data.distribute("distributed_epoch",
                                                              service.target))
    with pytest.raises(errors.InvalidArgumentError, match=r"before `\.apply\(distribute"):
        ServiceDataset(distributed, "distributed_epoch", service.target)
    with pytest.raises(TypeError, match=r"Dataset or a dataset id .* got \[1, 2\]"):
        ServiceDataset([1, 2], "distributed_epoch", service.target)
    with pytest.raises(ValueError, match=r"processing mode should be .*Got 'epochs'"):
        ServiceDataset(data.Dataset.range(3), "epochs", service.target)
    with pytest.raises(ValueError, match="`job_name` must be set"):
        ServiceDataset(data.Dataset.range(3), "parallel_epochs", service.target,
                       consumer_index=0, num_consumers=2)


def test_loader_workers_forked_from_a_process_running_servers_say_to_spawn(
        in_process_service, monkeypatch):
    from clusterwire.data import torch_dataset

    ds = ServiceDataset(data.Dataset.range(20), "distributed_epoch", in_process_service.target)
    # As in a loader worker forked from this process (where gRPC may also crash before the
    # check is reached): the fork's in_process.inherited_servers() lists the servers.
    monkeypatch.setattr(torch_dataset, "get_worker_info", lambda: types.SimpleNamespace(
        id=1, num_workers=2, seed=8))
    monkeypatch.setattr(torch_dataset.in_process, "inherited_servers",
                        lambda: [in_process_service.target])
    with pytest.raises(errors.FailedPreconditionError,
                       match=r"worker 1 was forked from a process running clusterwire servers "
                             r"\(grpc://127\.0\.0\.1:\d+.*multiprocessing_context='spawn'"):
        next(iter(ds))
    monkeypatch.undo()
    spawned = DataLoader(ds, batch_size=None, num_workers=2, in_order=False,
                         multiprocessing_context="spawn", timeout=LOADER_TIMEOUT_S)
    assert sorted(int(x) for x in spawned) == list(range(20))


def test_elements_from_a_server_of_this_process_are_copied(in_process_service):
    ds = ServiceDataset(data.Dataset.range(4).map(fns.fill_2k), "distributed_epoch",
                        in_process_service.target, data_transfer_protocol=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensors = list(ds)
    assert sorted(int(t[0]) for t in tensors) == list(range(4))
    for tensor in tensors:
        tensor.fill_(-1)
    assert sorted(int(t[0]) for t in ds) == list(range(4))


# ---- saved positions (torchdata's Stateful protocol) ----------------------------------------

def stateful_loader(dataset, **kwargs):
    module = pytest.importorskip("torchdata.stateful_dataloader",
                                 reason="torchdata is not installed (CI installs it)")
    if kwargs.get("num_workers"):
        kwargs["timeout"] = LOADER_TIMEOUT_S
    return module.StatefulDataLoader(dataset, **kwargs)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11's own call
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loader_resumes_every_element_once(fresh_service, workers):
    """The loader's state_dict() holds each loader worker's position; a new loader (as in a
    restarted trainer) resumes from it: every element once, the ones after it once more.
    In order: torchdata cannot snapshot an out-of-order loader (on resume it skips the steps
    since its last snapshot, which in_order=False leaves behind)."""
    def loader():
        ds = ServiceDataset(data.Dataset.range(400), "distributed_epoch", fresh_service.target)
        options = {"multiprocessing_context": CONTEXT} if workers else {}
        return stateful_loader(ds, batch_size=10, num_workers=workers, **options)

    first = loader()
    batches = iter(first)
    before = [int(x) for _ in range(7) for x in next(batches)]
    state = first.state_dict()
    after = [int(x) for _ in range(3) for x in next(batches)]
    del batches, first  # the trainer stops (its loader workers exit)
    again = loader()
    again.load_state_dict(state)
    rest = [int(x) for batch in again for x in batch]
    assert Counter(before + rest) == Counter(range(400))
    assert not Counter(after) - Counter(rest)


def test_a_service_dataset_saves_and_loads_its_position(service):
    ds = ServiceDataset(data.Dataset.range(100), "distributed_epoch", service.target)
    assert ds.state_dict() == {"position": None, "job_name": None}  # nothing read: anew
    iterator = iter(ds)
    before = [int(next(iterator)) for _ in range(30)]
    state = ds.state_dict()
    assert state["position"]["elements"] == 30
    iterator.close()
    ds.load_state_dict(state)
    assert Counter(before + [int(x) for x in ds]) == Counter(range(100))
    with pytest.raises(errors.InvalidArgumentError, match="takes what state_dict"):
        ds.load_state_dict({"step": 3})
    with pytest.raises(errors.InvalidArgumentError, match="'handed'"):
        ds.load_state_dict({"position": {**state["position"], "handed": "x"}})


def test_a_consumer_saved_before_it_read_joins_the_job_its_peers_resume(service):
    """As a loader worker whose first batch was not yet taken when the loader's state was
    saved: it has no position, only its job, and resumes as a new consumer of that job."""
    def consumer():
        return ServiceDataset(data.Dataset.range(300), "distributed_epoch", service.target,
                              job_name="peers")

    reading, idle = consumer(), consumer()
    iterator = iter(reading)
    before = [int(next(iterator)) for _ in range(40)]
    states = [reading.state_dict(), idle.state_dict()]
    assert states[1] == {"position": None, "job_name": "peers"}
    iterator.close()
    resumed = [consumer(), consumer()]
    for ds, state in zip(resumed, states, strict=True):
        ds.load_state_dict(state)
    assert Counter(before + read_together(resumed)) == Counter(range(300))
