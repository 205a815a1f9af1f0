"""A worker's streams in its status and in ``top --dispatcher`` (issue 32): the open ones,
which its limit of ``max_open_streams`` counts, apart from the finished ones it keeps for
a consumer's last read (the STREAMS column showed both, 1,056 against the limit of 64)."""

from __future__ import annotations

import shutil
import sys

import pytest
from conftest import in_process_data_service
from test_top import Tmux, wait_for_screen

from clusterwire import data, top
from clusterwire.metrics import catalog
from clusterwire.metrics.snapshot import total

pytestmark = pytest.mark.timeout(120)

FINISHED = 3


def _streams(dispatcher):
    """Iterators of ``FINISHED`` named jobs read to their end, and one of a job still
    producing (one element read); the caller closes them."""
    done = []
    for index in range(FINISHED):
        iterator = iter(data.Dataset.range(5).apply(data.distribute(
            processing_mode="parallel_epochs", service=dispatcher.target,
            job_name=f"done{index}")))
        assert [int(x) for x in iterator] == list(range(5))
        done.append(iterator)
    running = iter(data.Dataset.range(10**6).apply(data.distribute(
        processing_mode="parallel_epochs", service=dispatcher.target, job_name="running")))
    assert int(next(running)) == 0
    return [*done, running]


def _cells(screen: str, first: str) -> list[str]:
    """The cells of the table row whose first cell starts with ``first`` (rich draws the
    header's borders heavy)."""
    for line in screen.splitlines():
        cells = [cell.strip() for cell in line.replace("┃", "│").split("│")[1:-1]]
        if cells and cells[0].startswith(first):
            return cells
    return []


def test_a_worker_reports_open_and_finished_streams_apart():
    with in_process_data_service(workers=1) as dispatcher:
        iterators = _streams(dispatcher)
        poller = top.DataPoller(dispatcher.target.removeprefix("grpc://"), "grpc", 10)
        try:
            snapshot = poller.poll()
        finally:
            poller.close()
            for iterator in iterators:
                iterator.close()
    [worker] = snapshot.workers
    metrics = worker.status.metrics
    assert total(metrics, catalog.DATA_STREAMS.name) == 1
    assert total(metrics, catalog.DATA_FINISHED_STREAMS.name) == FINISHED
    [row] = top.worker_rows(None, snapshot)
    assert (row.streams, row.finished_streams) == (1, FINISHED)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_top_shows_open_and_finished_streams_in_a_terminal(tmp_path):
    tmux = Tmux(tmp_path)
    with in_process_data_service(workers=1) as dispatcher:
        iterators = _streams(dispatcher)
        address = dispatcher.target.removeprefix("grpc://")
        command = (f"bash -c '{sys.executable} -m clusterwire top --dispatcher {address} "
                   "--interval 0.3 --timeout 5; echo top exited with status $?'")
        try:
            tmux("new-session", "-d", "-s", "top", "-x", "250", "-y", "50", command)
            tmux("set-option", "-t", "top", "-w", "remain-on-exit", "on")
            screen = wait_for_screen(tmux, lambda s: "OPEN STREAMS" in s and len(
                _cells(s, "127.0.0.1:")) == 10, "the worker's row", timeout=30)
            header = _cells(screen, "WORKER")
            row = dict(zip(header, _cells(screen, "127.0.0.1:"), strict=True))
            assert (row["OPEN STREAMS"], row["FINISHED STREAMS"]) == ("1", str(FINISHED)), (
                screen)
            assert "STREAMS" not in header  # no column counting both
            tmux("send-keys", "-t", "top", "C-c")
            screen = wait_for_screen(tmux, lambda s: "top exited with status" in s,
                                     "top to exit on Ctrl-C")
            assert "top exited with status 0" in screen and "Traceback" not in screen
        finally:
            tmux.kill()
            for iterator in iterators:
                iterator.close()
