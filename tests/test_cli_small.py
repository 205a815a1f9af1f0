"""The command line's small courtesies: --version, a "stopped" line, a port in use said as
such, help without "(default: None)"."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile

import pytest
from conftest import child_env

import clusterwire
from clusterwire import errors
from clusterwire.local_cluster import await_ready

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _clusterwire(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterwire", *args], capture_output=True,
                          text=True, timeout=60)


def test_version_is_the_packages():
    done = _clusterwire("--version")
    assert done.returncode == 0, done.stderr
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert done.stdout.strip() == f"clusterwire {project['version']}"
    assert clusterwire.__version__ == project["version"]


def test_demo_help_shows_each_default_once_and_no_none():
    done = _clusterwire("demo", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    for default in ("(default: grpc)", "(default: 60)", "(default: 2)"):
        assert text.count(default) == 1, default


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [
    ["serve", "--cluster", '{"w": ["127.0.0.1:0"]}'],
    ["dispatcher", "--port", "0", "--bind-address", "127.0.0.1"]])
def test_a_server_stopped_by_a_signal_says_stopped(command):
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen([sys.executable, "-m", "clusterwire", *command],
                                   stdout=subprocess.PIPE, stderr=stderr, text=True,
                                   env={**os.environ, **child_env()})
        try:
            target = await_ready(process, 30)
            assert target is not None
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
            process.stdout.close()
        stderr.seek(0)
        lines = stderr.read().decode().splitlines()
    assert lines[-1].startswith("clusterwire: ") and lines[-1].endswith(f"at {target} stopped")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("protocol", ["grpc", "grpc+local"])
def test_a_port_in_use_is_said_as_such(protocol):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(errors.UnavailableError,
                           match=f"port {port} is in use by another process or server"):
            clusterwire.Server({"w": [f"127.0.0.1:{port}"]}, job_name="w", task_index=0,
                               protocol=protocol)
        done = _clusterwire("worker", "--port", str(port), "--worker-address",
                            "127.0.0.1:%port%", "--dispatcher-address", "127.0.0.1:1")
    assert done.returncode == 1
    assert f"port {port} is in use by another process or server" in done.stderr


def test_an_address_of_another_machine_is_said_as_such():
    with pytest.raises(errors.UnavailableError, match="192.0.2.1 is not an address of this"):
        clusterwire.Server({"w": ["192.0.2.1:0"]}, job_name="w", task_index=0)
