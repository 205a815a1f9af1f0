"""LocalCluster reports what goes wrong once, in the launcher, with the real cause."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import child_env

from clusterwire.errors import InvalidArgumentError, NotFoundError, UnavailableError
from clusterwire.local_cluster import LocalCluster


def test_a_misspelt_protocol_fails_before_any_task_starts():
    started = time.monotonic()
    with pytest.raises(NotFoundError, match="'grcp'. Did you mean 'grpc'"):
        LocalCluster({"ps": 1, "worker": 2}, protocol="grcp")
    assert time.monotonic() - started < 5


def test_a_malformed_plugins_toml_fails_before_any_task_starts(tmp_path):
    config = tmp_path / "plugins.toml"
    config.write_text("[transports\n")
    with pytest.raises(InvalidArgumentError, match="Malformed plugin configuration"):
        LocalCluster({"w": 1}, env={"CLUSTERWIRE_PLUGINS": str(config)})


def test_a_task_that_exits_is_reported_once_with_its_status_and_error(capfd):
    started = time.monotonic()
    with pytest.raises(UnavailableError) as raised:
        LocalCluster({"w": 3}, imports=["no_such_module_for_this_test"])
    assert time.monotonic() - started < 10  # not the 30 s start timeout
    message = raised.value.message
    assert message.startswith("Task /job:w/task:0 exited with status 1 before it served")
    assert message.count("cannot --import 'no_such_module_for_this_test'") == 1
    assert "no_such_module_for_this_test" not in capfd.readouterr().err  # not printed 3x


def test_a_serving_task_s_stderr_is_passed_on(tmp_path, capfd):
    (tmp_path / "noisy_task_module.py").write_text(
        "import sys\nprint('noisy task module imported', file=sys.stderr, flush=True)\n")
    env = child_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    with LocalCluster({"w": 1}, imports=["noisy_task_module"], env=env):
        pass
    assert "noisy task module imported" in capfd.readouterr().err


def test_demo_with_a_misspelt_protocol_says_so_once():
    result = subprocess.run([sys.executable, "-m", "clusterwire", "demo", "--protocol", "grcp"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("clusterwire demo: NotFoundError: No transport registered for "
                               "'grcp'. Did you mean 'grpc'? Installed: grpc, ")
