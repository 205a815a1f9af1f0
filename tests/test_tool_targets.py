"""The tools pointed at the wrong kind of server, or without the cluster's credentials
(issue 32): ``status`` and ``top`` say what they found there and the command for it, or that
their credentials were refused, and exit non-zero; with the security flags the servers take
they see the task. Real servers on 127.0.0.1 in this process, the tools as processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import pytest
from conftest import child_env
from test_top import Tmux, wait_for_screen

from clusterwire import data
from clusterwire.server import Server
from clusterwire.testing.certs import Authority

pytestmark = pytest.mark.timeout(180)
TOKEN = "a-cluster-token-of-32-characters"


def clusterwire(*args: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CLUSTERWIRE_")},
           **child_env()}
    return subprocess.run([sys.executable, "-m", "clusterwire", *args], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.fixture(scope="module")
def servers():
    """A dispatcher, one worker registered with it, and a cluster task."""
    dispatcher = data.DispatchServer(data.DispatcherConfig(bind_address="127.0.0.1"))
    worker = data.WorkerServer(data.WorkerConfig(
        dispatcher_address=dispatcher.target.split("://")[1],
        worker_address="127.0.0.1:%port%"))
    task = Server({"worker": ["127.0.0.1:0"]}, job_name="worker", task_index=0)
    task.start()
    try:
        yield {"dispatcher": dispatcher.target.split("://")[1], "worker": worker.address,
               "task": task.target.split("://")[1]}
    finally:
        task.stop()
        worker.stop()
        dispatcher.stop()


def _fails_with(result: subprocess.CompletedProcess, *phrases: str) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout == ""
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr
    assert "Wire format was corrupt" not in result.stderr
    return result.stderr


def test_status_at_a_dispatcher_names_it_and_top_dispatcher(servers):
    address = servers["dispatcher"]
    _fails_with(clusterwire("status", f"grpc://{address}", "--timeout", "10"),
                f"clusterwire status: InvalidArgumentError: grpc://{address} is a tf.data "
                f"service dispatcher: use `clusterwire top --dispatcher {address}`.")


def test_status_at_a_worker_names_it(servers):
    _fails_with(clusterwire("status", f"grpc://{servers['worker']}", "--timeout", "10"),
                "is a tf.data service worker: use `clusterwire top --dispatcher HOST:PORT` "
                "with its dispatcher's address")


def test_top_at_a_dispatcher_names_it(servers):
    address = servers["dispatcher"]
    _fails_with(clusterwire("top", "--once", f"grpc://{address}", "--timeout", "10"),
                f"is a tf.data service dispatcher: use `clusterwire top --dispatcher "
                f"{address}`")


def test_top_dispatcher_at_a_worker_exits_1_without_a_table(servers):
    stderr = _fails_with(
        clusterwire("top", "--once", "--dispatcher", servers["worker"], "--timeout", "10"),
        f"grpc://{servers['worker']} is a tf.data service worker")
    assert "WORKER" not in stderr


def test_top_dispatcher_at_a_task_names_the_task(servers):
    address = servers["task"]
    _fails_with(clusterwire("top", "--once", "--dispatcher", address, "--timeout", "10"),
                f"grpc://{address} is a clusterwire task (/job:worker/task:0): use "
                f"`clusterwire status grpc://{address}` or `clusterwire top grpc://{address}`")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_live_top_dispatcher_at_a_worker_in_a_terminal(servers, tmp_path):
    tmux = Tmux(tmp_path)
    # top starts on Enter, once the pane is set up (its first lines are not cleared).
    command = (f"bash -c 'read go; {sys.executable} -m clusterwire top --dispatcher "
               f"{servers['worker']} --interval 0.3 --timeout 10; echo top exited with "
               "status $?'")
    try:
        tmux("new-session", "-d", "-s", "top", "-x", "200", "-y", "40", command)
        tmux("set-option", "-t", "top", "-w", "remain-on-exit", "on")
        tmux("send-keys", "-t", "top", "Enter")
        screen = wait_for_screen(tmux, lambda s: "top exited with status" in s,
                                 "top to exit", timeout=60)
    finally:
        tmux.kill()
    assert "top exited with status 1" in screen
    assert "is a tf.data service worker" in screen.replace("\n", "")
    assert "JOB" not in screen and "WORKER" not in screen


@contextlib.contextmanager
def _guarded_task(config: dict):
    task = Server({"worker": ["127.0.0.1:0"]}, job_name="worker", task_index=0,
                  config=config)
    task.start()
    try:
        yield task.target
    finally:
        task.stop()


def test_the_tools_take_the_token_and_say_when_it_is_refused(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    wrong = tmp_path / "wrong"
    wrong.write_text("another-token-of-32-characters!!")
    with _guarded_task({"auth_token_file": str(token)}) as target:
        for tool in (("status",), ("top", "--once")):
            for flags in ((), ("--auth-token-file", str(wrong))):
                stderr = _fails_with(
                    clusterwire(*tool, target, "--timeout", "10", *flags),
                    f"clusterwire {tool[0]}: UnauthenticatedError: The task at {target} "
                    f"refused {tool[0]}'s credentials", "Missing or wrong cluster token",
                    "--auth-token-file")
                assert "Is a task serving there?" not in stderr
        status = clusterwire("status", target, "--json", "--auth-token-file", str(token))
        assert status.returncode == 0, status.stderr
        assert '"job": "worker"' in status.stdout
        top = clusterwire("top", "--once", target, "--interval", "0.2", "--timeout", "10",
                          "--auth-token-file", str(token))
        assert top.returncode == 0, top.stderr
        assert "1 of 1 tasks serving" in top.stdout


def test_the_tools_take_the_tls_flags(tmp_path):
    authority = Authority(tmp_path)
    server, client = authority.issue("server"), authority.issue("client")
    with _guarded_task({"tls_cert_file": str(server.cert), "tls_key_file": str(server.key),
                        "tls_ca_file": str(authority.pair.cert),
                        "tls_client_auth": True}) as target:
        without = clusterwire("status", target, "--timeout", "5",
                              "--tls-ca-file", str(authority.pair.cert))
        assert without.returncode == 1 and "client certificate" in without.stderr, (
            without.stderr)
        flags = ("--tls-ca-file", str(authority.pair.cert), "--tls-cert-file",
                 str(client.cert), "--tls-key-file", str(client.key))
        status = clusterwire("status", target, "--timeout", "10", *flags)
        assert status.returncode == 0, status.stderr
        top = clusterwire("top", "--once", target, "--interval", "0.2", "--timeout", "10",
                          *flags)
        assert top.returncode == 0, top.stderr


def test_the_tools_pass_on_a_wrong_protocol_answer_with_the_target(servers):
    address = servers["task"]
    for args in (("status", f"grpc+local://{address}"),
                 ("top", "--once", f"grpc+local://{address}"),
                 ("top", "--once", "--dispatcher", servers["dispatcher"], "--protocol",
                  "grpc+local")):
        stderr = _fails_with(clusterwire(*args, "--timeout", "10"),
                             ": UnimplementedError: The ",
                             ": This server serves grpc, not the protocol of this call: use "
                             "grpc://HOST:PORT as the target.")
        assert "serving there" not in stderr
