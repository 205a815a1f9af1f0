"""LocalCluster at scale: tasks forked from a warmed parent, cluster completion in parallel."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest
from conftest import child_env

from clusterwire import local_cluster
from clusterwire.errors import FailedPreconditionError, NotFoundError, UnavailableError
from clusterwire.local_cluster import COMPLETE_CLUSTER_THREADS, LocalCluster
from clusterwire.session import Session
from clusterwire.task_launcher import TaskLauncher, TaskProcess

pytestmark = pytest.mark.timeout(60)


def running(pids: list[int]) -> list[int]:
    """The processes of ``pids`` that still exist."""
    return [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


class RecordingLauncher(TaskLauncher):
    """A TaskLauncher that remembers its zygote and every task it started."""

    instances: list[RecordingLauncher] = []

    def __init__(self, env):
        super().__init__(env)
        self.processes: list[TaskProcess] = []
        RecordingLauncher.instances.append(self)

    def started(self, reply, timeout):
        process = super().started(reply, timeout)
        self.processes.append(process)
        return process

    def pids(self) -> list[int]:
        return [self._zygote.pid, *(p.pid for p in self.processes)]


@pytest.fixture
def recording(monkeypatch):
    RecordingLauncher.instances = []
    monkeypatch.setattr(local_cluster, "TaskLauncher", RecordingLauncher)
    return RecordingLauncher.instances


def test_more_tasks_than_any_pool_come_up_complete_and_close_without_leftovers():
    jobs = {"ps": 4, "worker": 20}
    assert sum(jobs.values()) > COMPLETE_CLUSTER_THREADS
    with LocalCluster(jobs, imports=["cw_test_functions"], env=child_env()) as cluster:
        processes = [cluster.process(job, i) for job, n in jobs.items() for i in range(n)]
        assert len({p.pid for p in processes}) == len(processes)
        for job, count in jobs.items():
            for index in range(count):
                with Session(cluster.target(job, index), timeout=30) as session:
                    status = session.status()
                assert (status["job"], status["task_index"]) == (job, index)
                assert status["cluster"] == cluster.cluster_spec
        zygote = cluster._launcher._zygote.pid
    assert not running([p.pid for p in processes] + [zygote])
    assert [p.poll() for p in processes] == [0] * len(processes)  # SIGTERM: a clean stop


SCRIPT_MODULE = """
import os

import clusterwire


@clusterwire.remote
def whereabouts(name):
    return [os.getpid(), os.getcwd(), os.environ.get(name)]
"""


def test_tasks_get_the_cluster_env_and_cwd_and_import_from_it(tmp_path, monkeypatch):
    (tmp_path / "cw_scale_script.py").write_text(SCRIPT_MODULE)
    monkeypatch.chdir(tmp_path)
    with LocalCluster({"w": 2}, imports=["cw_scale_script"],
                      env={**child_env(), "CW_SCALE_MARK": "here"}) as cluster:
        for index in range(2):
            with Session(cluster.target("w", index), timeout=30) as session:
                assert session.call("cw_scale_script.whereabouts", "CW_SCALE_MARK") == [
                    cluster.process("w", index).pid, str(tmp_path), "here"]


def test_restart_kills_the_task_and_starts_an_empty_one_on_the_same_address():
    with LocalCluster({"w": 2}, env=child_env()) as cluster:
        old = cluster.process("w", 1)
        with Session(cluster.target("w", 0), timeout=30) as session:
            session.put("x", 1, task="/job:w/task:1")
            cluster.restart("w", 1)
            assert old.poll() == -9 and not running([old.pid])
            new = cluster.process("w", 1)
            assert new.pid != old.pid and new.poll() is None
            with pytest.raises(NotFoundError):
                session.get("x", task="/job:w/task:1")
            session.put("y", 2, task="/job:w/task:1")
            assert session.get("y", task="/job:w/task:1") == 2
        with Session(cluster.target("w", 1), timeout=30) as session:
            assert session.status()["cluster"] == cluster.cluster_spec


def test_a_task_process_answers_like_a_popen():
    with LocalCluster({"w": 2}, env=child_env()) as cluster:
        first, second = cluster.process("w", 0), cluster.process("w", 1)
        with pytest.raises(subprocess.TimeoutExpired):
            first.wait(0.01)
        first.send_signal(signal.SIGKILL)
        assert first.wait(20) == -signal.SIGKILL
        second.terminate()
        assert second.wait(20) == 0  # SIGTERM: serve stops gracefully
        second.kill()  # it has exited: nothing to signal
        assert (first.poll(), second.returncode) == (-signal.SIGKILL, 0)


def test_complete_cluster_reaches_the_tasks_at_once(monkeypatch):
    tasks = 4
    everyone = threading.Barrier(tasks, timeout=20)  # broken unless all calls overlap
    original = Session.complete_cluster

    def complete_cluster(self, cluster, task=None, timeout=None):
        everyone.wait()
        return original(self, cluster, task, timeout)

    monkeypatch.setattr(Session, "complete_cluster", complete_cluster)
    with LocalCluster({"w": tasks}, env=child_env()) as cluster:
        with Session(cluster.target("w", tasks - 1), timeout=30) as session:
            assert session.status()["cluster"] == cluster.cluster_spec


def test_a_failed_complete_cluster_is_raised_and_every_process_is_gone(monkeypatch, recording):
    original = Session.complete_cluster

    def complete_cluster(self, cluster, task=None, timeout=None):
        if self.status()["task_index"] == 5:
            raise FailedPreconditionError("injected refusal")
        return original(self, cluster, task, timeout)

    monkeypatch.setattr(Session, "complete_cluster", complete_cluster)
    with pytest.raises(FailedPreconditionError, match="injected refusal"):
        LocalCluster({"w": 8}, env=child_env())
    (launcher,) = recording
    assert len(launcher.processes) == 8
    assert all(p.poll() is not None for p in launcher.processes)
    assert not running(launcher.pids())
    assert launcher._zygote.poll() is not None


@pytest.mark.parametrize("options, message", [
    ({"config": {"no_such_option": 1}}, "no_such_option"),
    ({"imports": ["cw_no_such_module"]}, "cannot --import 'cw_no_such_module'"),
], ids=["config", "import"])
def test_a_task_that_cannot_start_reports_its_error_and_exit_status_once(options, message,
                                                                         capfd, recording):
    with pytest.raises(UnavailableError) as raised:
        LocalCluster({"w": 2}, env=child_env(), **options)
    text = raised.value.message
    assert text.startswith("Task /job:w/task:0 exited with status 1 before it served; it said:")
    assert text.count("clusterwire serve: ") == 1 and message in text, text
    assert message not in capfd.readouterr().err  # held, not printed once per task
    (launcher,) = recording
    assert not running(launcher.pids())


def test_an_unknown_protocol_fails_before_any_task_starts(recording):
    with pytest.raises(NotFoundError, match="No transport registered for 'nope'"):
        LocalCluster({"w": 2}, env=child_env(), protocol="nope")
    assert recording == []  # no launcher, no task


def test_a_dead_launcher_fails_the_cluster_instead_of_hanging():
    launcher = TaskLauncher(os.environ)
    try:
        launcher._zygote.kill()
        launcher._zygote.wait(20)
        with pytest.raises(UnavailableError, match="task launcher"):
            launcher.spawn(["serve"], timeout=20)
    finally:
        launcher.close()
