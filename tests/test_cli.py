"""The clusterwire command: serve, status, plugins, demo."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from clusterwire import Session
from clusterwire.local_cluster import READY_PREFIX


def clusterwire(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterwire", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def serving():
    proc = subprocess.Popen(
        [sys.executable, "-m", "clusterwire", "serve", "--cluster",
         '{"worker": ["127.0.0.1:0"]}', "--job-name", "worker", "--task-index", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith(READY_PREFIX), proc.stderr.read()
    yield proc, line[len(READY_PREFIX):].strip()
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=10)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_runs_until_a_signal_then_stops_cleanly(serving, signum):
    proc, target = serving
    with Session(target) as session:
        assert session.status()["job"] == "worker"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "serving /job:worker/task:0 at grpc://127.0.0.1:" in err
    assert "Traceback" not in err


def test_status_prints_json(serving):
    _, target = serving
    result = clusterwire("status", target, "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["job"] == "worker" and status["target"] == target
    assert status["cluster"] == {"worker": [target.removeprefix("grpc://")]}


def test_status_all_prints_every_task_of_the_cluster(serving):
    _, target = serving
    result = clusterwire("status", target, "--all", "--json")
    assert result.returncode == 0, result.stderr
    statuses = json.loads(result.stdout)
    assert list(statuses) == ["/job:worker/task:0"]
    assert statuses["/job:worker/task:0"]["target"] == target


def test_status_of_a_dead_target_fails_in_bounded_time():
    result = clusterwire("status", "grpc://127.0.0.1:1", "--timeout", "1")
    assert result.returncode == 1
    assert "UnavailableError" in result.stderr and "Traceback" not in result.stderr


def test_status_of_a_dead_target_says_so_before_its_deadline():
    result = clusterwire("status", "grpc://127.0.0.1:1", "--timeout", "2")
    assert result.returncode == 1
    first = result.stderr.splitlines()[0]
    assert "the task at 127.0.0.1:1 (grpc) is unreachable" in first
    assert "retrying until the deadline" in first


def test_plugins_lists_grpc_with_module_distribution_and_version():
    result = clusterwire("plugins")
    assert result.returncode == 0
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0] == ["KIND", "NAME", "MODULE", "DISTRIBUTION", "VERSION", "RUNS", "HERE"]
    assert ["transport", "grpc", "clusterwire.transports.grpc", "clusterwire", "0.1.0",
            "yes"] in rows


def test_a_resolver_missing_an_argument_names_the_flag():
    result = clusterwire("resolve", "--resolver", "simple")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "clusterwire resolve: InvalidArgumentError: Resolver 'simple': missing a required "
        "argument: 'cluster_spec'; give --resolver-arg cluster_spec=VALUE (VALUE as JSON or "
        "text).")


def test_help_names_every_command_without_markup():
    result = clusterwire("--help")
    assert result.returncode == 0
    for command in ("serve", "resolve", "status", "plugins", "demo", "dispatcher", "worker"):
        assert f"    {command} " in result.stdout
    assert "``" not in result.stdout
    demo = clusterwire("demo", "--help").stdout
    assert "(default: grpc)" in demo and "(default: 60)" in demo


@pytest.mark.parametrize("args,message", [
    (["--cluster", "{not json"], "invalid --cluster"),
    (["--cluster", "@/no/such/file.json"], "invalid --cluster"),
    (["--cluster", '{"w": ["127.0.0.1:0"]}', "--protocol", "carrier-pigeon"],
     "No transport registered for 'carrier-pigeon'"),
    (["--cluster", '{"w": ["127.0.0.1:0"], "v": ["127.0.0.1:0"]}'], "explicit `job_name`"),
    (["--cluster", '{"w": ["nohost"]}'], "no ':port' part"),
    (["--cluster", '{"w": ["127.0.0.1:0"]}', "--import", "no_such_module_q"], "no_such_module_q"),
])
def test_serve_bad_input_is_one_clear_line(args, message):
    result = clusterwire("serve", *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_trains_and_reports_what_it_measured(tmp_path):
    result = clusterwire("demo", "--steps", "30", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("cluster up in")
    # The upload (2 workers x 6144 x 2048 float32 features + labels) is reported apart ...
    upload = next(line for line in lines if line.startswith("shards uploaded:"))
    assert upload.startswith(f"shards uploaded: {2 * 6144 * 2049 * 4 / 1e6:.1f} MB in ")
    # ... from the training window, reported in steps: each pulls 2048 float32 weights.
    training = next(line for line in lines if line.startswith("training:"))
    assert training.startswith("training: 60 steps in ") and "MB/s" not in training
    assert "pull 8.2 KB of weights" in training
    steps = [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("  step")]
    assert steps == sorted(set(steps)) and steps[0] > 0 and steps[-1] == 60
    assert lines[-1].startswith("verdict: OK: the loss fell ")
    assert "60/60 steps ran, all 3 processes stopped cleanly" in lines[-1]


def test_demo_fails_with_a_verdict_when_the_loss_does_not_fall(tmp_path):
    from clusterwire import demo

    out = io.StringIO()
    status = demo._verdict(1.0, 0.5, 10, 5, 2, np.zeros(3), {"/job:ps/task:0": 0}, out)
    assert status == 1
    assert out.getvalue().startswith("verdict: FAILED: the loss fell 2x, not the 100x expected")
    out = io.StringIO()
    assert demo._verdict(1.0, 1e-3, 9, 5, 2, np.zeros(3), {"/job:ps/task:0": -9}, out) == 1
    assert "9 of 10 steps ran" in out.getvalue()
    assert "did not stop cleanly (exit status): {'/job:ps/task:0': -9}" in out.getvalue()


def test_serve_imports_a_module_of_the_current_directory(tmp_path):
    """The console script (unlike ``python -m``) has no current directory on its path;
    ``--import`` looks there too."""
    (tmp_path / "cw_cwd_module.py").write_text(
        "import clusterwire\n\n@clusterwire.remote\ndef triple(x):\n    return 3 * x\n")
    script = os.path.join(os.path.dirname(sys.executable), "clusterwire")
    proc = subprocess.Popen(
        [script, "serve", "--cluster", '{"w": ["127.0.0.1:0"]}', "--job-name", "w",
         "--task-index", "0", "--import", "cw_cwd_module", "--quiet"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), proc.stderr.read()
        with Session(line[len(READY_PREFIX):].strip()) as session:
            assert session.call("cw_cwd_module.triple", 14) == 42
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    missing = subprocess.run([script, "serve", "--cluster", '{"w": ["127.0.0.1:0"]}',
                              "--import", "cw_no_such_module"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0
    assert "cannot --import 'cw_no_such_module'" in missing.stderr
    assert str(tmp_path) in missing.stderr and "Traceback" not in missing.stderr


def test_a_busy_port_is_one_clear_line_without_grpc_log_lines():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = clusterwire("serve", "--cluster", json.dumps({"w": [f"127.0.0.1:{port}"]}),
                             "--job-name", "w", "--task-index", "0")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"Could not bind 127.0.0.1:{port}" in lines[0], result.stderr


def test_a_remote_function_of_the_running_script_reaches_a_task_that_imports_it(tmp_path):
    """``python myscript.py`` registers ``double`` as ``myscript.double`` (not
    ``__main__.double``), the name a task started with ``--import myscript`` knows."""
    (tmp_path / "cw_my_script.py").write_text(textwrap.dedent('''
        import subprocess, sys
        import clusterwire

        @clusterwire.remote
        def double(x):
            return 2 * x

        if __name__ == "__main__":
            task = subprocess.Popen(
                [sys.executable, "-m", "clusterwire", "serve", "--cluster",
                 '{"w": ["127.0.0.1:0"]}', "--job-name", "w", "--task-index", "0",
                 "--import", "cw_my_script", "--quiet"], stdout=subprocess.PIPE, text=True)
            try:
                target = task.stdout.readline().split("CLUSTERWIRE_READY", 1)[1].strip()
                with clusterwire.Session(target) as session:
                    print("RESULT", session.call(double, 21))
            finally:
                task.kill()
                task.wait()
    '''))
    result = subprocess.run([sys.executable, "cw_my_script.py"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert "RESULT 42" in result.stdout, result.stderr
