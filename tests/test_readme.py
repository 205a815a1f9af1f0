"""The README's snippets run as written (a newcomer pastes them first)."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest
from conftest import free_ports

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def _blocks(title: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", _section(title), re.S)


def _run_python(code: str, tmp_path, timeout: float = 60) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=timeout, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


def test_the_quick_tour_runs_as_written(tmp_path):
    out = _run_python(_blocks("A quick tour", "python")[0], tmp_path).splitlines()
    assert re.fullmatch(r"grpc://127\.0\.0\.1:\d+", out[0])
    assert out[1].startswith("{'job': 'ps', 'task_index': 0,")


def test_the_data_service_snippet_runs_as_written(tmp_path):
    out = _run_python(_blocks("Data service", "python")[0], tmp_path)
    assert out.strip() == str([i * i for i in range(10)])


def _two_terminals(walkthrough: str, ports: dict[str, int], tmp_path) -> str:
    """Run a walkthrough's two terminals with bash (its fixed ports replaced by free ones):
    the first in the background until the second, the client, is done; its output."""
    for fixed, free in ports.items():
        walkthrough = walkthrough.replace(fixed, str(free))
    servers, client = walkthrough.split("# terminal 2", 1)
    # This interpreter's `python` and `clusterwire` come first on the PATH.
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    background = subprocess.Popen(["bash", "-c", servers], env=env, cwd=tmp_path,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
    try:
        result = subprocess.run(["bash", "-c", client], env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()
    finally:
        os.killpg(background.pid, signal.SIGTERM)  # every server: they stop cleanly
        _, errors = background.communicate(timeout=30)
        assert "Traceback" not in errors, errors


@pytest.mark.timeout(90)
def test_the_cluster_walkthrough_runs_as_written(tmp_path):
    ps, worker = free_ports(2)  # the README's 2222 and 2223 may be taken
    out = _two_terminals(_blocks("A quick tour", "sh")[0], {"2222": ps, "2223": worker},
                         tmp_path)
    assert out == "[0 1 2]"


@pytest.mark.timeout(90)
def test_the_data_service_walkthrough_runs_as_written(tmp_path):
    dispatcher, worker = free_ports(2)  # the README's 5050 and 5051 may be taken
    out = _two_terminals(_blocks("Data service", "sh")[0],
                         {"5050": dispatcher, "5051": worker}, tmp_path)
    assert out == "[0, 1, 4, 9, 16]"
