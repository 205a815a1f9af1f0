"""SlurmClusterResolver and ``clusterwire serve --resolver slurm`` on a real local Slurm.

The module starts munged, slurmctld and two slurmd (emulated nodes 127.0.0.2 and
127.0.0.3, 4 CPUs and 2 fake GPUs each) under a temporary directory, runs real
srun and sbatch jobs against it, and stops every daemon at the end. It is
skipped only when the Slurm/munge programs are absent (CI installs them with
.ci/install-slurm.sh) or when not running as root (slurmd needs root).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from clusterwire import ClusterSpec, Session

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
sys.path.insert(0, os.path.join(TESTS_DIR, "slurm"))
from local_slurm import LocalSlurm, missing_binaries  # noqa: E402

NODES = ["127.0.0.2", "127.0.0.3"]


def _skip_reason() -> str | None:
    missing = missing_binaries()
    if missing:
        return (f"Slurm is not installed (missing {', '.join(missing)}); "
                "install it with: sudo bash .ci/install-slurm.sh")
    if os.geteuid() != 0:
        return "a local Slurm needs root (slurmd runs as root)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


@pytest.fixture(scope="module")
def slurm():
    """A running local Slurm (2 nodes x 4 CPUs x 2 fake GPUs), stopped after the module."""
    # not under pytest's 0700 tmp dirs: munged wants every parent of its socket world-executable
    base = tempfile.mkdtemp(prefix="cw-slurm-")
    try:
        cluster = LocalSlurm(base, nodes=2, cpus=4, gpus=2)
        cluster.start()
        yield cluster
        cluster.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def free_port_base(count: int, hosts=NODES) -> int:
    """A port p with p..p+count-1 free on every host (below the ephemeral range)."""
    for base in range(21000 + os.getpid() % 5000, 32000, 7):
        sockets = []
        try:
            for host in hosts:
                for port in range(base, base + count):
                    sock = socket.socket()
                    sockets.append(sock)
                    sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free port range")


def _task_env() -> dict[str, str]:
    """Tasks import this checkout and run this interpreter's clusterwire."""
    bin_dir = os.path.dirname(sys.executable)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1"}


@pytest.mark.timeout(90)
def test_srun_cyclic_tasks_resolve_the_same_cluster_and_reach_each_other(slurm):
    base = free_port_base(4)
    probe = os.path.join(TESTS_DIR, "slurm", "task_probe.py")
    result = slurm.run(["srun", "-N2", "-n5", "-m", "cyclic", "--gpus-per-node=2",
                        sys.executable, probe, str(base)], env=_task_env(), timeout=80)
    assert result.returncode == 0, result.stderr
    reports = sorted((json.loads(line) for line in result.stdout.splitlines()),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1, 2, 3, 4]
    cluster = reports[0]["cluster"]
    assert sorted(cluster) == ["worker"] and len(cluster["worker"]) == 5
    # cyclic placement: rank 1 runs on the second node, so the layout is not node-major
    assert [r["node"] for r in reports[:2]] == NODES
    for report in reports:
        assert report["cluster"] == cluster  # the same ClusterSpec in every task
        assert report["task"] == ["worker", report["rank"]]  # distinct (job, index)
        # a task's address is on the node it really runs on, at port_base + its local index
        own = cluster["worker"][report["rank"]]
        assert own.split(":")[0] == report["node"]
        assert report["target"] == report["master"] == f"grpc://{own}"
        assert sorted(report["reached"]) == [f"worker:{i}" for i in range(5)]
        assert all(name == f"{job}:{index}"
                   for name, (job, index, _) in report["reached"].items())
    assert len(set(cluster["worker"])) == 5
    # 2 GPUs per node shared by 2+ tasks: at most 1 each, never every GPU to every task
    assert all(r["num_accelerators"] in ({}, {"GPU": 1}) for r in reports)


@pytest.mark.timeout(60)
def test_gpus_are_split_between_the_tasks_of_a_node(slurm):
    base = free_port_base(2)
    probe = os.path.join(TESTS_DIR, "slurm", "task_probe.py")
    result = slurm.run(["srun", "-N2", "-n4", "--ntasks-per-node=2", "--gpus-per-node=2",
                        sys.executable, probe, str(base)], env=_task_env(), timeout=50)
    assert result.returncode == 0, result.stderr
    reports = sorted((json.loads(line) for line in result.stdout.splitlines()),
                     key=lambda r: r["rank"])
    assert [r["cuda_visible_devices"] for r in reports] == ["0", "1", "0", "1"]
    assert all(r["num_accelerators"] == {"GPU": 1} for r in reports)
    # every server reports the one GPU its task was given
    assert {tuple(v) for r in reports for v in r["reached"].values()} == {
        ("worker", i, 1) for i in range(4)}


@pytest.mark.timeout(60)
def test_outside_a_step_or_with_wrong_jobs_the_error_says_why(slurm, tmp_path):
    out = tmp_path / "batch.out"
    batch = slurm.run(["sbatch", "--wait", "-n1", f"--output={out}", "--wrap",
                       f"{sys.executable} -m clusterwire resolve --resolver slurm"],
                      env=_task_env(), timeout=50)
    assert batch.returncode != 0  # the batch script itself is not a step
    assert "SLURM_STEP_NODELIST not found in environment" in out.read_text()
    result = slurm.run(["srun", "-n2", sys.executable, "-m", "clusterwire", "resolve",
                        "--resolver", "slurm", "--jobs", "ps=1,worker=2"],
                       env=_task_env(), timeout=50)
    assert result.returncode != 0
    assert "Requested 3 tasks but only 2 were assigned" in result.stderr


@pytest.mark.timeout(60)
def test_resolve_command_prints_the_cluster_of_each_task(slurm, tmp_path):
    result = slurm.run(["srun", "-N2", "-n2", f"--output={tmp_path}/task-%t.out", sys.executable,
                        "-m", "clusterwire", "resolve", "--resolver", "slurm", "--jobs",
                        "chief=1,worker=1", "--resolver-arg", "port_base=2222"],
                       env=_task_env(), timeout=50)
    assert result.returncode == 0, result.stderr
    reports = [json.loads((tmp_path / f"task-{rank}.out").read_text()) for rank in (0, 1)]
    assert [(r["task_type"], r["task_id"], r["master"]) for r in reports] == [
        ("chief", 0, "grpc://127.0.0.2:2222"), ("worker", 0, "grpc://127.0.0.3:2222")]
    assert all(r["cluster"] == {"chief": ["127.0.0.2:2222"], "worker": ["127.0.0.3:2222"]}
               for r in reports)


def _read_ready(stream, count: int) -> list[str]:
    targets = []
    for line in stream:
        if line.startswith("CLUSTERWIRE_READY "):
            targets.append(line.split()[1])
            if len(targets) == count:
                return targets
    raise AssertionError(f"srun ended after {len(targets)} of {count} tasks were ready")


@pytest.mark.timeout(90)
def test_serve_resolver_slurm_tasks_reach_each_other_and_stop_on_sigterm(slurm):
    base = free_port_base(2)
    command = ["srun", "-J", "cw-serve", "-N2", "-n4", "--ntasks-per-node=2", sys.executable,
               "-m", "clusterwire", "serve", "--resolver", "slurm", "--jobs", "ps=1,worker=3",
               "--resolver-arg", f"port_base={base}", "--grace", "1", "--quiet"]
    srun = subprocess.Popen(command, env={**slurm.env, **_task_env()}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        targets = _read_ready(srun.stdout, 4)
        expected = ClusterSpec({"ps": [f"127.0.0.2:{base}"],
                                "worker": [f"127.0.0.2:{base + 1}", f"127.0.0.3:{base}",
                                           f"127.0.0.3:{base + 1}"]})
        seen = set()
        for target in targets:
            with Session(target, timeout=20) as session:
                own = session.status()
                assert own["cluster"] == expected
                seen.add((own["job"], own["task_index"]))
                # each server forwards to every other task: the servers reach each other
                for job in expected.jobs:
                    for index in expected.task_indices(job):
                        other = session.status(task=f"/job:{job}/task:{index}")
                        assert (other["job"], other["task_index"]) == (job, index)
        assert seen == {("ps", 0), ("worker", 0), ("worker", 1), ("worker", 2)}
        # SIGTERM to every task of the step (srun's own SIGTERM would SIGKILL them at once)
        signalled = slurm.run(["scancel", "--signal=TERM", "--name=cw-serve"], timeout=20)
        assert signalled.returncode == 0, signalled.stderr
        _, err = srun.communicate(timeout=30)
        assert srun.returncode == 0, err
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.communicate()


@pytest.mark.timeout(100)
def test_sbatch_parameter_server_example_exits_0(slurm, tmp_path):
    example = os.path.join(REPO, "examples", "slurm", "ps_demo.sbatch")
    out = tmp_path / "demo.out"
    env = {**_task_env(), "CLUSTERWIRE_PORT_BASE": str(free_port_base(2)),
           "CLUSTERWIRE_DEMO_STEPS": "20"}
    result = slurm.run(["sbatch", "--wait", "-N2", "-n3", f"--output={out}", example],
                       env=env, timeout=90, cwd=str(tmp_path))
    text = out.read_text() if out.exists() else ""
    assert result.returncode == 0, f"{result.stderr}\n{text}"
    assert re.search(r"final loss \S+ \(initial", text), text
    assert re.search(r"^verdict: OK: the loss fell \S+x \(needed 100x\), 40/40 steps$", text,
                     re.MULTILINE), text
    assert "Slurm reports their step as CANCELLED: the expected end" in text


@pytest.mark.timeout(60)
def test_a_port_in_use_points_at_port_base(slurm):
    base = free_port_base(1)
    with socket.socket() as taken:
        taken.bind((NODES[0], base))
        taken.listen()
        result = subprocess.run(
            ["srun", "-N1", "-n1", f"--nodelist={NODES[0]}", sys.executable, "-m",
             "clusterwire", "serve", "--resolver", "slurm", "--jobs", "w=1", "--resolver-arg",
             f"port_base={base}", "--quiet"],
            env={**slurm.env, **_task_env()}, capture_output=True, text=True, timeout=45)
    assert result.returncode != 0
    assert f"Could not bind {NODES[0]}:{base}" in result.stderr, result.stderr
    assert "--resolver-arg port_base=N" in result.stderr and "CLUSTERWIRE_PORT_BASE" in (
        result.stderr)


@pytest.mark.timeout(120)
def test_a_second_srun_step_joins_the_running_cluster(slurm):
    """A job that grows: a second step of the same job joins the first step's running
    cluster as /job:worker/task:2 (``serve --resolver slurm --join``), and every task learns
    of it."""
    base = free_port_base(3)
    config = json.dumps({"membership_heartbeat_seconds": 0.3})
    serve = [sys.executable, "-m", "clusterwire", "serve", "--resolver", "slurm", "--config",
             config, "--allow-membership-changes", "--grace", "1", "--quiet"]
    env = {**slurm.env, **_task_env()}
    steps = [subprocess.Popen(
        ["srun", "-J", "cw-grow", "-N1", "-n2", *serve, "--jobs", "worker=2",
         "--resolver-arg", f"port_base={base}"], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)]
    try:
        first = _read_ready(steps[0].stdout, 2)
        listed = slurm.run(["squeue", "-h", "-n", "cw-grow", "-o", "%i"], timeout=20)
        [job_id] = listed.stdout.split()
        # The second step runs in the same job (its allocation, shared with the first step).
        steps.append(subprocess.Popen(
            ["srun", f"--jobid={job_id}", "--overlap", "-n1", *serve, "--jobs", "worker=1",
             "--resolver-arg", f"port_base={base + 2}", "--join", first[0]], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        [joined] = _read_ready(steps[1].stdout, 1)
        for target in first:
            with Session(target, timeout=20) as session:
                deadline = time.monotonic() + 20
                while len(session.status()["cluster"].task_indices("worker")) != 3:
                    assert time.monotonic() < deadline, "the cluster did not grow to 3 workers"
                    time.sleep(0.05)
                assert session.status()["cluster"].task_address("worker", 2) == \
                    joined.split("://")[1]
                session.put("grown", np.arange(3), task="/job:worker/task:2")
        with Session(joined, timeout=20) as session:
            np.testing.assert_array_equal(session.get("grown"), np.arange(3))
            assert session.status(task="/job:worker/task:0")["job"] == "worker"
        signalled = slurm.run(["scancel", "--signal=TERM", "--name=cw-grow"], timeout=20)
        assert signalled.returncode == 0, signalled.stderr
        for step in steps:
            _, err = step.communicate(timeout=30)
            assert step.returncode == 0, err
    finally:
        for step in steps:
            if step.poll() is None:
                step.kill()
                step.communicate()
