"""``clusterwire status`` (issue 32): a short human summary by default, ``--json`` for the
whole document, and ``--all`` naming each task that did not answer, at its own address, and
why (not the target's address and a deadline)."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from test_terminal_output import clusterwire

import clusterwire as cw

pytestmark = pytest.mark.timeout(120)


def _closed_port() -> int:
    """A port of 127.0.0.1 nothing listens on (bound, then closed: refused at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_status_prints_a_summary_and_json_on_request():
    server = cw.Server({"worker": ["127.0.0.1:0"]}, job_name="worker", task_index=0)
    try:
        with cw.Session(server.target) as session:
            session.put("x", b"12345678")
            with pytest.raises(cw.errors.NotFoundError):
                session.get("missing")
        summary = clusterwire("status", server.target, "--timeout", "10")
        document = clusterwire("status", server.target, "--json", "--timeout", "10")
    finally:
        server.stop()
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.decode().splitlines()
    assert lines[:2] == ["task        /job:worker/task:0", f"address     {server.target}"]
    # Its start time, by its clock, is in its status: up for the seconds this test took.
    assert re.fullmatch(r"state       serving, up \d+(\.\d+)? s", lines[2]), lines[2]
    assert lines[3].startswith("protocol    grpc (clusterwire ")
    assert lines[4] == "membership  version 0, 1 tasks (worker: 1)"
    # put and get, one failed; this status request is neither counted nor in flight.
    assert lines[5] == "requests    2 requests, 1 failed, 0 in flight"
    assert lines[6].startswith("store       1 tensors, ")
    assert len(lines) == 7
    assert document.returncode == 0, document.stderr
    status = json.loads(document.stdout)
    assert status["target"] == server.target and status["cluster"] == {
        "worker": [server.target.removeprefix("grpc://")]}
    assert len(document.stdout.splitlines()) > 10 * len(lines)


def test_status_all_names_the_task_that_did_not_answer_its_address_and_why():
    """Task 1's port refuses connections. The target forwards within the caller's budget,
    so its UnavailableError naming task 1's address comes back before the deadline."""
    dead = f"127.0.0.1:{_closed_port()}"
    server = cw.Server({"worker": ["127.0.0.1:0", dead]}, job_name="worker", task_index=0)
    try:
        started = time.monotonic()
        result = clusterwire("status", "--all", server.target, "--timeout", "4")
        elapsed = time.monotonic() - started
        document = clusterwire("status", "--all", "--json", server.target, "--timeout", "4")
    finally:
        server.stop()
    assert result.returncode == 1, result.stderr
    live, failed = result.stdout.decode().splitlines()
    assert live.startswith(f"/job:worker/task:0  {server.target}  serving, up ")
    assert "  membership version 0, 2 tasks (worker: 2)  " in live
    assert failed.startswith(f"task /job:worker/task:1 at {dead} did not answer: "
                             f"UnavailableError: Task at {dead} (grpc) is unavailable"), failed
    assert "Connection refused" in failed and server.target.split("//")[1] not in failed
    assert elapsed < 4 + 8, elapsed  # the interpreter's start, then within the deadline
    entry = json.loads(document.stdout)["/job:worker/task:1"]
    assert entry["address"] == dead
    assert entry["error"].startswith(f"UnavailableError: Task at {dead} (grpc)")


def test_status_of_one_silent_task_names_its_address():
    """Task 1 accepts connections and never answers: ``--task`` through the target ends
    with the target's error about task 1's address, within --timeout."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        server = cw.Server({"worker": ["127.0.0.1:0", address]}, job_name="worker",
                           task_index=0)
        try:
            with cw.Session(server.target, in_process=False) as session:
                started = time.monotonic()
                with pytest.raises(cw.errors.OpError) as raised:
                    session.status(task="/job:worker/task:1", timeout=3)
                elapsed = time.monotonic() - started
        finally:
            server.stop()
    assert isinstance(raised.value, (cw.errors.DeadlineExceededError,
                                     cw.errors.UnavailableError)), raised.value
    assert address in raised.value.message, raised.value.message
    assert elapsed < 3 + 1, elapsed
