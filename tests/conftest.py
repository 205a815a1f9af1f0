"""Shared fixtures: real servers on 127.0.0.1 and real multi-process clusters."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cw_data_procs import WORKER_TOKEN_ENV, ServerProcess

import clusterwire
from clusterwire.local_cluster import LocalCluster
from clusterwire.testing.ports import free_ports  # noqa: F401 (tests import it from here)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# UCX (grpc+verbs) may use only the loopback device in tests; children inherit this.
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def child_env() -> dict[str, str]:
    """Environment for task processes: the tests folder importable (for cw_test_functions)
    and the data service's worker token (WORKER_TOKEN_ENV)."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": TESTS_DIR + (os.pathsep + path if path else ""), **WORKER_TOKEN_ENV}




def end_child(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """End a child told to stop by the end of its stdin: close it, wait up to ``timeout``
    seconds, then kill it; its stdout is closed too."""
    with contextlib.suppress(OSError):
        if process.stdin:
            process.stdin.close()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout)
    if process.stdout:
        process.stdout.close()


def fresh_python(code: str, timeout: float = 60.0) -> str:
    """What ``code`` prints run in a fresh interpreter (where what an import pulls in shows);
    a non-zero exit fails the test with its stderr."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout


@contextlib.contextmanager
def in_process_job(job: str, count: int, **server_args):
    """``count`` in-process Servers of one job on free ports, each told the others' bound
    ports (``complete_cluster``); stopped on exit."""
    servers: list[clusterwire.Server] = []
    try:
        for index in range(count):
            servers.append(clusterwire.Server({job: ["127.0.0.1:0"] * count}, job_name=job,
                                              task_index=index, **server_args))
        spec = clusterwire.ClusterSpec({job: [s.target.split("://")[1] for s in servers]})
        for server in servers:
            with clusterwire.Session(server.target) as session:
                session.complete_cluster(spec)
        yield servers
    finally:
        for server in servers:
            server.stop()


def wait_for(condition, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``condition`` (a server's state, which has no event to wait on) until true; fail
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


@contextlib.contextmanager
def in_process_data_service(workers: int = 2, **worker_options):
    """A data-service dispatcher and ``workers`` workers in this process on 127.0.0.1, all
    registered; yields the dispatcher, stops them all at the end."""
    from clusterwire import data

    dispatcher = data.DispatchServer(data.DispatcherConfig(bind_address="127.0.0.1"))
    address = dispatcher.target.split("://")[1]
    started = []
    try:
        for _ in range(workers):
            started.append(data.WorkerServer(data.WorkerConfig(
                dispatcher_address=address, worker_address="127.0.0.1:%port%",
                **worker_options)))
        wait_for(lambda: dispatcher.num_workers() == workers, what=f"{workers} workers")
        yield dispatcher
    finally:
        for worker in started:
            worker.stop()
        dispatcher.stop()


def read_together(iterables, timeout: float = 60.0) -> list[int]:
    """The elements of all ``iterables`` as ints, read at once on threads of their own (as
    consumers of one job that wait for each other's splits to end); an error or a read not
    ending within ``timeout`` fails the test."""
    with ThreadPoolExecutor(len(iterables)) as pool:
        reads = [pool.submit(lambda it=it: [int(x) for x in it]) for it in iterables]
        return [x for read in reads for x in read.result(timeout)]


def tampered(message, **changes):
    """A copy of protobuf ``message`` with ``changes`` (a peer's tampered request)."""
    copy = type(message)()
    copy.CopyFrom(message)
    for name, value in changes.items():
        setattr(copy, name, value)
    return copy


@pytest.fixture
def processes():
    """Start data-service server processes with ``start(...)``; each is killed at the end."""
    started: list[ServerProcess] = []

    def start(command: str, *args: str, env: dict[str, str] | None = None,
              ready: bool = True) -> ServerProcess:
        started.append(ServerProcess(command, *args, env=env, ready=ready))
        return started[-1]

    yield start
    for process in started:
        process.close()


@pytest.fixture
def local_server():
    """A started single-task server on a free port of localhost."""
    server = clusterwire.Server.create_local_server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster3():
    """A real 3-process cluster: 1 ps + 2 workers, grpc, on 127.0.0.1 (sending tracebacks)."""
    with LocalCluster({"ps": 1, "worker": 2}, imports=["cw_test_functions"],
                      env=child_env(), config={"send_tracebacks": True}) as cluster:
        yield cluster
