"""A ``clusterwire worker`` process picks Arrow's jemalloc pool unless its operator chose a
pool (``ARROW_DEFAULT_MEMORY_POOL``), and jemalloc's 10 s decay unless the operator set
``JE_ARROW_MALLOC_CONF``, before anything imports pyarrow."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clusterwire.data.cli import use_jemalloc_for_arrow

pytestmark = pytest.mark.timeout(60)


@pytest.mark.skipif(sys.platform != "linux", reason="set on Linux only")
def test_the_worker_default_is_jemalloc_and_an_operator_choice_stays():
    environ: dict[str, str] = {}
    use_jemalloc_for_arrow(environ)
    assert environ == {"ARROW_DEFAULT_MEMORY_POOL": "jemalloc",
                       "JE_ARROW_MALLOC_CONF": "dirty_decay_ms:10000,muzzy_decay_ms:10000"}
    chosen = {"ARROW_DEFAULT_MEMORY_POOL": "system"}
    use_jemalloc_for_arrow(chosen)
    assert chosen == {"ARROW_DEFAULT_MEMORY_POOL": "system"}
    tuned = {"JE_ARROW_MALLOC_CONF": "dirty_decay_ms:0"}
    use_jemalloc_for_arrow(tuned)
    assert tuned == {"ARROW_DEFAULT_MEMORY_POOL": "jemalloc",
                     "JE_ARROW_MALLOC_CONF": "dirty_decay_ms:0"}


@pytest.mark.skipif(sys.platform != "linux", reason="set on Linux only")
def test_pyarrow_imported_after_it_uses_jemalloc():
    pytest.importorskip("pyarrow")
    code = ("import os; from clusterwire.data.cli import use_jemalloc_for_arrow; "
            "os.environ.pop('ARROW_DEFAULT_MEMORY_POOL', None); "
            "os.environ.pop('JE_ARROW_MALLOC_CONF', None); use_jemalloc_for_arrow(); "
            "import pyarrow as pa; pa.allocate_buffer(1 << 20); "
            "print(pa.default_memory_pool().backend_name)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "jemalloc"
    # The decay pairs are ones this jemalloc knows: it names any other on stderr.
    assert "Invalid conf" not in done.stderr, done.stderr[-2000:]
