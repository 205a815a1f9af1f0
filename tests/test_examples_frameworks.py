"""The framework examples train to their verdict: a PyTorch and a JAX model on batches from a
data service of three processes (and a PyTorch model on Parquet files the workers read)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import cw_install_hints as install
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")


@pytest.mark.parametrize("script, library", [("train_torch.py", "torch"),
                                             ("train_torch_parquet.py", "torch"),
                                             ("train_jax.py", "jax")])
def test_example_trains_to_an_ok_verdict(script, library):
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed ({install.BY_LIBRARY[library]})")
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--epochs", "3"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("epoch ")] == [
        "epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert lines[-1].startswith("verdict: OK: loss "), result.stdout
    assert "every sample once in each of 3 epochs, 3 servers stopped cleanly" in lines[-1]
