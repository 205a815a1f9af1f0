"""A worker whose dispatcher is not there yet: it says what it waits for and why, prints its
ready line only once registered, and says when a signal stopped it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from conftest import child_env, free_ports, wait_for

from clusterwire import data, errors
from clusterwire.data import WorkerServer
from clusterwire.data.cli import READY_PREFIX
from clusterwire.durations import format_duration
from clusterwire.rpc import RequestClient
from clusterwire.transport import Frame


class _WorkerProcess:
    """``clusterwire worker`` with its stdout lines collected as they come."""

    def __init__(self, dispatcher_address: str):
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "clusterwire", "worker", "--port", "0",
             "--dispatcher-address", dispatcher_address, "--heartbeat-interval-ms", "200"],
            stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            env={**os.environ, **child_env()})
        self.stdout: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.stdout.append(line)

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._reader.join(10)
        self.process.stdout.close()
        self._stderr.close()


@pytest.mark.timeout(90)
def test_a_worker_waits_for_its_dispatcher_and_is_ready_only_once_registered(processes):
    port = free_ports(1)[0]
    address = f"127.0.0.1:{port}"
    worker = _WorkerProcess(address)
    try:
        wait_for(lambda: "waiting for its dispatcher" in worker.stderr(), 30,
                 "the worker's waiting line")
        waiting = worker.stderr()
        assert f"waiting for its dispatcher at {address}" in waiting
        assert "Connection refused" in waiting or "cannot connect" in waiting
        assert "e+0" not in waiting and "task" not in waiting.split("waiting for")[1]
        assert not any(line.startswith(READY_PREFIX) for line in worker.stdout)

        dispatcher = processes("dispatcher", "--port", str(port), "--bind-address",
                               "127.0.0.1")
        wait_for(lambda: any(line.startswith(READY_PREFIX) for line in worker.stdout), 30,
                 "the worker's ready line once its dispatcher serves")
        assert len(worker.stdout) == 1
        dataset = data.Dataset.range(6).apply(
            data.distribute(processing_mode="parallel_epochs", service=dispatcher.target))
        assert list(dataset.as_numpy_iterator()) == list(range(6))

        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(30) == 0
        assert "tf.data service worker at grpc://" in worker.stderr()
        assert worker.stderr().rstrip().endswith("stopped")
    finally:
        worker.close()


@pytest.mark.timeout(60)
def test_a_worker_stopped_while_waiting_says_stopped_and_never_ready():
    worker = _WorkerProcess(f"127.0.0.1:{free_ports(1)[0]}")
    try:
        wait_for(lambda: "waiting for its dispatcher" in worker.stderr(), 30,
                 "the worker's waiting line")
        worker.process.send_signal(signal.SIGINT)
        assert worker.process.wait(30) == 0
        worker._reader.join(10)
        assert worker.stdout == []
        assert worker.stderr().rstrip().endswith("stopped")
        assert "Traceback" not in worker.stderr()
    finally:
        worker.close()


@pytest.mark.timeout(30)
def test_worker_server_tells_why_it_is_not_registered_and_stops_waiting_when_stopped():
    address = f"127.0.0.1:{free_ports(1)[0]}"
    worker = WorkerServer(port=0, dispatcher_address=address, start=False)
    try:
        assert not worker.registered and worker.registration_problem is None
        worker.start()  # gives up waiting after 5 s; keeps trying
        assert not worker.registered
        assert address in worker.registration_problem
        assert "dispatcher" in worker.registration_problem
        stopper = threading.Timer(0.5, worker.stop)
        stopper.start()
        began = time.monotonic()
        assert worker.wait_registered(60) is False
        assert time.monotonic() - began < 30  # woken by stop, not by the timeout
        stopper.join()
    finally:
        worker.stop()


def test_durations_read_as_people_write_them():
    assert [format_duration(s) for s in (0.25, 5, 30, 90, 3599.98, 5400, 172_800)] == [
        "0.25 s", "5 s", "30 s", "1.5 min", "1 h", "1.5 h", "2 d"]


@pytest.mark.timeout(30)
def test_the_unreachable_warning_names_the_dispatcher_and_an_hour_as_1_h(caplog):
    client = RequestClient("grpc", timeout=3600.0, peer="tf.data service dispatcher")
    address = f"127.0.0.1:{free_ports(1)[0]}"
    closer = threading.Timer(1.0, client.close)
    closer.start()
    with caplog.at_level(logging.WARNING, logger="clusterwire"), \
            pytest.raises(errors.CancelledError):
        client.send_frame(address, Frame(b"", []), "status")
    closer.join()
    warning = caplog.records[0].getMessage()
    assert f"the tf.data service dispatcher at {address}" in warning
    assert "from now" in warning and "e+03" not in warning
    assert "1 h from now" in warning
