"""CPU torch tensors (and jax arrays) are values: sent as numpy arrays, without pickling."""

from __future__ import annotations

import cw_install_hints as install
import numpy as np
import pytest

import clusterwire
from clusterwire import Server, Session, codec
from clusterwire.errors import InvalidArgumentError


def _torch():
    return pytest.importorskip("torch", reason=f"PyTorch is not installed ({install.TORCH})")


@clusterwire.remote(name="tests.framework_values.describe")
def describe(value):
    """The type, dtype and sum the task received."""
    return [type(value).__name__, str(value.dtype), float(value.sum())]


@pytest.fixture(scope="module")
def server():
    with Server({"w": ["127.0.0.1:0"]}) as server:
        yield server


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "wire"])
def test_a_cpu_tensor_arrives_as_the_numpy_array_of_its_values(server, in_process):
    torch = _torch()
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).requires_grad_()
    with Session(server.target, in_process=in_process) as session:
        session.put("t", tensor)
        with torch.no_grad():
            tensor += 100  # the caller changes its tensor after the put ...
        got = session.get("t")
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        assert got.tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()  # ... not
        assert session.call(describe, torch.ones(5, dtype=torch.int64)) == [
            "ndarray", "int64", 5.0]


def test_a_tensor_is_encoded_without_a_copy():
    torch = _torch()
    tensor = torch.arange(8, dtype=torch.int32)
    header, buffers = codec.encode(tensor)
    assert np.shares_memory(np.frombuffer(buffers[0], np.int32), tensor.numpy())
    assert codec.decode(header, buffers).tolist() == list(range(8))


def test_a_tensor_off_the_host_or_of_a_dtype_numpy_lacks_is_refused_with_the_fix(server):
    torch = _torch()
    with Session(server.target) as session:
        with pytest.raises(InvalidArgumentError, match=r"device meta.*tensor\.cpu\(\)"):
            session.put("x", torch.empty(2, device="meta"))
        with pytest.raises(InvalidArgumentError, match=r"bfloat16.*tensor\.float\(\)"):
            session.call(describe, torch.ones(2, dtype=torch.bfloat16))
        assert "x" not in session.list()


def test_other_objects_are_still_refused():
    with pytest.raises(InvalidArgumentError, match="CPU torch tensors and jax arrays"):
        codec.encode(object())


def test_a_cpu_jax_array_arrives_as_the_numpy_array_of_its_values(server):
    jnp = pytest.importorskip("jax.numpy", reason=f"JAX is not installed ({install.JAX})")
    array = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    with Session(server.target, in_process=False) as session:
        session.put("j", array)
        got = session.get("j")
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        assert got.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert session.call(describe, jnp.ones(4, dtype=jnp.int32)) == ["ndarray", "int32", 4.0]
