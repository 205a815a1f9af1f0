"""The README's snippets run as written (a newcomer pastes them first)."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import socket
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def _section(title: str) -> str:
    text = pathlib.Path(README).read_text(encoding="utf-8")
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


def _free_ports(count: int) -> list[int]:
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


@pytest.mark.timeout(90)
def test_the_two_terminal_walkthrough_runs_as_written(tmp_path):
    walkthrough = _blocks("Data service", "sh")[0]
    dispatcher_port, worker_port = _free_ports(2)  # the README's 5050 and 5051 may be taken
    walkthrough = walkthrough.replace("5050", str(dispatcher_port)).replace(
        "5051", str(worker_port))
    lines = [line for line in walkthrough.splitlines() if line and not line.startswith("#")]
    dispatcher = shlex.split(lines[0].rstrip("&"))
    worker = shlex.split(lines[1])
    client = shlex.split(walkthrough[walkthrough.index("python -c"):].split("#")[0])
    assert dispatcher[:2] == ["clusterwire", "dispatcher"] and worker[:2] == [
        "clusterwire", "worker"] and client[:2] == ["python", "-c"]
    cli = [sys.executable, "-m", "clusterwire"]
    servers = [subprocess.Popen(cli + argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for argv in (dispatcher, worker)]
    try:
        result = subprocess.run([sys.executable, "-c", client[2]], capture_output=True,
                                text=True, timeout=60, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[0, 1, 4, 9, 16]"
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.communicate(timeout=20)
        assert [server.returncode for server in servers] == [0, 0]
