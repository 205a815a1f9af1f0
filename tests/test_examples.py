"""The examples run as documented."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")


@pytest.mark.parametrize("protocol", ["grpc", "grpc+local"])
def test_quickstart(protocol):
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, "quickstart.py"), protocol],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"{protocol}: got (1024, 1024) float32, scaled sum 2097152" in result.stdout
