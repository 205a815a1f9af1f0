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


# The tf.data service snippet and a TF-style server script, verbatim: neither calls
# stop(); the interpreter must still exit at once, without a traceback.
_NO_STOP_SCRIPTS = {
    "data service": (
        "from clusterwire import data\n"
        "dispatcher = data.DispatchServer(port=0)\n"
        "dispatcher_address = dispatcher.target.split('://')[1]\n"
        "worker = data.WorkerServer(port=0, dispatcher_address=dispatcher_address)\n"
        "dataset = data.Dataset.range(10)\n"
        "dataset = dataset.apply(data.distribute(processing_mode='parallel_epochs',\n"
        "                                        service=dispatcher.target))\n"
        "print([int(x) for x in dataset.as_numpy_iterator()])\n",
        "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"),
    "server": (
        "import clusterwire\n"
        "server = clusterwire.Server({'worker': ['127.0.0.1:0']}, job_name='worker',\n"
        "                            task_index=0)\n"
        "with clusterwire.Session(server.target) as session:\n"
        "    session.put('x', 41)\n"
        "    print(session.get('x') + 1)\n",
        "42"),
}


@pytest.mark.parametrize("name", sorted(_NO_STOP_SCRIPTS))
def test_exit_without_stop_is_clean(name):
    script, expected = _NO_STOP_SCRIPTS[name]
    for _ in range(3):  # the hang it guards against struck most runs, not all
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                timeout=30)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected
        assert "Traceback" not in result.stderr, result.stderr
