"""clusterwire top: rows from fabricated snapshots (exact rates), then the real command on
a real cluster: --once, and the live view in a real terminal (tmux)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import child_env, fresh_python, in_process_data_service, wait_for

from clusterwire import Session, top
from clusterwire.local_cluster import READY_PREFIX, LocalCluster
from clusterwire.protos.data_service_pb2 import DataServiceStatus, JobSummary, WorkerSummary
from clusterwire.protos.service_pb2 import MetricSample, TaskRef, TaskStatus, UnreachablePeer

pytestmark = pytest.mark.timeout(60)


def task_status(ok: int = 0, failed: int = 0, received: int = 0, sent: int = 0,
                in_flight: int = 1, serving: int = 1, store: int = 0,
                peers: tuple[UnreachablePeer, ...] = ()) -> TaskStatus:
    """A TaskStatus with the samples a task's server reports (server label included)."""
    server = {"server": "/job:worker/task:0"}
    samples = [MetricSample(name="clusterwire_store_bytes", labels=server, value=store),
               MetricSample(name="clusterwire_requests_in_flight", labels=server,
                            value=in_flight),
               MetricSample(name="clusterwire_serving", labels=server, value=serving),
               MetricSample(name="clusterwire_received_bytes_total",
                            labels={**server, "transport": "grpc"}, value=received),
               MetricSample(name="clusterwire_sent_bytes_total",
                            labels={**server, "transport": "grpc"}, value=sent)]
    if ok:
        samples.append(MetricSample(name="clusterwire_requests_total", value=ok,
                                    labels={**server, "method": "get", "code": "OK"}))
    if failed:
        samples.append(MetricSample(name="clusterwire_requests_total", value=failed,
                                    labels={**server, "method": "get", "code": "NOT_FOUND"}))
    return TaskStatus(task=TaskRef(job="worker", index=0), metrics=samples,
                      unreachable_peers=peers)


def snap(at: float, status: TaskStatus | None = None, **kwargs) -> top.TaskSnapshot:
    return top.TaskSnapshot("/job:worker/task:0", "127.0.0.1:5000", at, status, **kwargs)


# -- rows from snapshots ----------------------------------------------------------------


def test_rates_are_counter_differences_over_the_measured_time_less_tops_own_request():
    before = snap(10.0, task_status(ok=9, failed=1, received=1000, sent=5000),
                  request_bytes=8, response_bytes=792)
    # 20 requests of the load (2 of them NOT_FOUND) and top's own status request before.
    after = snap(12.5, task_status(ok=28, failed=3, received=1000 + 8 + 2500,
                                   sent=5000 + 792 + 10_000, in_flight=4, store=3 * 1024))
    [row] = top.task_rows([before], [after])
    assert row == top.TaskRow(
        task="/job:worker/task:0", address="127.0.0.1:5000", health="serving",
        requests_per_s=20 / 2.5, errors_per_s=2 / 2.5, received_bytes_per_s=2500 / 2.5,
        sent_bytes_per_s=10_000 / 2.5, in_flight=3, store_bytes=3 * 1024,
        unreachable_peers=(), error="")


def test_an_idle_task_shows_exactly_zero():
    before = snap(1.0, task_status(ok=5, received=40, sent=4000),
                  request_bytes=8, response_bytes=800)
    after = snap(2.0, task_status(ok=6, received=48, sent=4800))
    [row] = top.task_rows([before], [after])
    assert (row.requests_per_s, row.errors_per_s, row.received_bytes_per_s,
            row.sent_bytes_per_s, row.in_flight) == (0.0, 0.0, 0.0, 0.0, 0)


def test_first_frame_unreachable_draining_restarted_and_metrics_off_have_no_rates():
    status = task_status(ok=3, received=30, sent=300)
    [first] = top.task_rows(None, [snap(1.0, status)])
    assert first.health == "serving" and first.requests_per_s is None
    assert first.in_flight == 0 and first.store_bytes == 0

    [gone] = top.task_rows([snap(1.0, status)], [snap(2.0, error="UnavailableError: down")])
    assert gone == top.TaskRow("/job:worker/task:0", "127.0.0.1:5000", "unreachable", None,
                               None, None, None, None, None, (), "UnavailableError: down")

    stopping = snap(2.0, draining=True, error="/job:worker/task:0 is stopping.")
    assert top.task_rows(None, [stopping])[0].health == "draining"
    assert top.task_rows(None, [snap(1.0, task_status(serving=0))])[0].health == "draining"

    # Restarted on its address: counters start again from 0.
    [restarted] = top.task_rows([snap(1.0, status, request_bytes=8, response_bytes=800)],
                                [snap(2.0, task_status(ok=1, received=8, sent=800))])
    assert restarted.health == "serving" and restarted.requests_per_s is None

    # CLUSTERWIRE_METRICS=0 in the task: its shell reports nothing (the store still does).
    off = TaskStatus(metrics=[MetricSample(name="clusterwire_store_bytes", value=7)])
    [row] = top.task_rows([snap(1.0, off)], [snap(2.0, off)])
    assert (row.health, row.requests_per_s, row.in_flight, row.store_bytes) == (
        "serving", None, None, 7)


def test_unreachable_peers_are_named():
    peers = (UnreachablePeer(task=TaskRef(job="ps", index=0), address="127.0.0.1:1"),
             UnreachablePeer(address="127.0.0.1:2"))
    [row] = top.task_rows(None, [snap(1.0, task_status(peers=peers))])
    assert row.unreachable_peers == ("/job:ps/task:0", "127.0.0.1:2")


def test_formats():
    assert [top.format_rate(v) for v in (None, 0.0, 12.345)] == ["-", "0.0", "12.3"]
    assert [top.format_bytes(v) for v in (None, 0, 1023, 1536, 5 * 2**20, 3 * 2**40)] == [
        "-", "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 TiB"]
    assert top.format_bytes(2048, "/s") == "2.0 KiB/s"


def test_table_shows_every_column_and_why_a_task_did_not_answer():
    from rich.console import Console

    rows = top.task_rows(None, [snap(1.0, task_status(store=2048)),
                                top.TaskSnapshot("/job:ps/task:0", "127.0.0.1:6000", 1.0,
                                                 error="UnavailableError: refused")])
    out = io.StringIO()
    Console(file=out, width=200).print(top.task_table(rows, "title"))
    lines = out.getvalue().splitlines()
    assert [c.strip() for c in lines[2].strip("┃").split("┃")] == [
        "TASK", "ADDRESS", "HEALTH", "REQ/S", "ERR/S", "IN/S", "OUT/S", "IN FLIGHT", "STORE",
        "UNREACHABLE PEERS"]
    assert cells(out.getvalue(), "/job:worker/task:0") == [
        "/job:worker/task:0", "127.0.0.1:5000", "serving", "-", "-", "-", "-", "0", "2.0 KiB",
        "-"]
    assert cells(out.getvalue(), "/job:ps/task:0")[2:4] == ["unreachable", "-"]
    assert "/job:ps/task:0: UnavailableError: refused" in out.getvalue()


def test_tables_draw_what_servers_sent_escaped_and_never_as_markup():
    """Names, addresses, modes and errors from a server: control characters escaped, rich
    markup shown as written (``[/pwned]`` alone would raise rich's MarkupError)."""
    from rich.console import Console

    hostile = "\x1b]0;pwned\x07[/pwned]\u202e"
    shown = r"\x1b]0;pwned\x07[/pwned]\u202e"
    peers = (UnreachablePeer(address=f"{hostile}:1"),)
    rows = top.task_rows(None, [
        top.TaskSnapshot(f"/job:{hostile}/task:0", f"{hostile}:1", 1.0,
                         task_status(peers=peers)),
        top.TaskSnapshot("/job:ps/task:0", "127.0.0.1:6000", 1.0, error=f"gone: {hostile}")])
    Server = top.DataServerSnapshot
    dispatcher = data_status("dispatcher", [], jobs=[
        JobSummary(job_id=1, job_name="[/pwned]", processing_mode=hostile),
        JobSummary(job_id=2, job_name="[bold]x", processing_mode="parallel_epochs")])
    snapshot = top.DataSnapshot(Server("d:0", 1.0, dispatcher),
                                (Server(f"{hostile}:2", 1.0, error=hostile),))
    out = io.StringIO()
    console = Console(file=out, width=300, force_terminal=True, color_system=None)
    for table in (top.task_table(rows, f"title {hostile}"),
                  top.worker_table(top.worker_rows(None, snapshot), hostile),
                  top.job_table(top.job_rows(None, snapshot))):
        console.print(table)
    screen = out.getvalue()
    assert all(c.isprintable() or c == "\n" for c in screen), repr(screen)
    assert cells(screen, f"/job:{shown}/task:0")[1::8] == [f"{shown}:1", f"{shown}:1"]
    assert f"/job:ps/task:0: gone: {shown}" in screen and f"title {shown}" in screen
    assert f"{shown}:2: {shown}" in screen
    assert cells(screen, "1")[1:3] == ["[/pwned]", shown] and cells(screen, "2")[1] == "[bold]x"


def test_a_huge_name_is_cut_in_its_cell():
    row = top.JobRow(1, "n" * 10**6, "parallel_epochs", 1, 0, 0, False, None)
    [name] = [cell.plain for cell in top.job_table([row]).columns[1].cells]
    assert name == "n" * top.CELL_CHARS + f"...(+{10**6 - top.CELL_CHARS} characters)"


def data_status(kind: str, samples: list[tuple[str, dict[str, str], float]],
                workers=(), jobs=()) -> DataServiceStatus:
    return DataServiceStatus(kind=kind, metrics=[
        MetricSample(name=name, labels=labels, value=value) for name, labels, value in samples],
        workers=workers, jobs=jobs)


def worker_status(elements: dict[str, float], get_elements: int, get_status: int,
                  cancelled: int = 0, buffered: int = 0, streams: int = 0) -> DataServiceStatus:
    server = {"server": "data-worker"}
    samples = [("clusterwire_serving", server, 1),
               ("clusterwire_data_buffered_elements", server, buffered),
               ("clusterwire_data_streams", server, streams),
               ("clusterwire_requests_total",
                {**server, "method": "get_elements", "code": "OK"}, get_elements),
               ("clusterwire_requests_total",
                {**server, "method": "get_status", "code": "OK"}, get_status)]
    if cancelled:
        samples.append(("clusterwire_requests_total",
                        {**server, "method": "get_elements", "code": "CANCELLED"}, cancelled))
    for job, count in elements.items():
        samples += [("clusterwire_data_elements_total", {**server, "job_id": job}, count),
                    ("clusterwire_data_element_bytes_total", {**server, "job_id": job}, 8 * count)]
    return data_status("worker", samples)


def test_worker_and_job_rows_from_two_snapshots():
    jobs = [JobSummary(job_id=7, job_name="train", processing_mode="distributed_epoch",
                       num_consumers=2, splits_handed=5, splits_completed=3),
            JobSummary(job_id=8, processing_mode="parallel_epochs", num_consumers=1,
                       finished=True)]
    dispatcher = data_status("dispatcher", [], workers=[
        WorkerSummary(address="w1:1", heartbeat_age_seconds=0.25),
        WorkerSummary(address="w2:2", heartbeat_age_seconds=4.5)], jobs=jobs)
    Server = top.DataServerSnapshot
    before = top.DataSnapshot(Server("d:0", 0.5, dispatcher), (
        Server("w1:1", 1.0, worker_status({"7": 100, "8": 50}, get_elements=10, get_status=3)),
        Server("w2:2", 1.0, worker_status({"7": 1000}, get_elements=1, get_status=3))))
    after = top.DataSnapshot(Server("d:0", 2.5, dispatcher), (
        # 22 requests since: 20 get_elements (2 of them cancelled), top's get_status of the
        # snapshot before (left out) and someone else's.
        Server("w1:1", 3.0, worker_status({"7": 500, "8": 150}, get_elements=28,
                                          get_status=5, cancelled=2, buffered=9, streams=2)),
        Server("w2:2", 3.5, error="UnavailableError: gone")))

    assert top.worker_rows(before, after) == [
        top.WorkerRow("w1:1", "serving", 0.25, elements_per_s=500 / 2,
                      element_bytes_per_s=8 * 500 / 2, buffered_elements=9, streams=2,
                      requests_per_s=21 / 2, errors_per_s=2 / 2, error=""),
        top.WorkerRow("w2:2", "unreachable", 4.5, None, None, None, None, None, None,
                      "UnavailableError: gone")]
    # Elements/s of a job: summed over the workers with a rate (w2 did not answer).
    assert top.job_rows(before, after) == [
        top.JobRow(7, "train", "distributed_epoch", 2, 5, 3, False, 400 / 2),
        top.JobRow(8, "", "parallel_epochs", 1, 0, 0, True, 100 / 2)]
    # First frame: no rates; the gauges and the dispatcher's view are there.
    [first, _] = top.worker_rows(None, before)
    assert (first.elements_per_s, first.requests_per_s, first.heartbeat_age_seconds) == (
        None, None, 0.25)
    assert [row.elements_per_s for row in top.job_rows(None, before)] == [None, None]
    # CLUSTERWIRE_METRICS=0 in a worker: it reports no serving gauge, and no rates show.
    off = data_status("worker", [("clusterwire_data_streams", {}, 1)])
    [row] = top.worker_rows(top.DataSnapshot(Server("d:0", 0.5), (Server("w1:1", 1.0, off),)),
                            top.DataSnapshot(Server("d:0", 2.5), (Server("w1:1", 3.0, off),)))
    assert (row.health, row.elements_per_s, row.requests_per_s, row.streams) == (
        "serving", None, None, 1)
    # The dispatcher down: its workers are still asked, the jobs are not known.
    down = top.DataSnapshot(Server("d:0", 2.5, error="UnavailableError: down"), after.workers)
    assert top.worker_rows(before, down)[0].heartbeat_age_seconds is None
    assert top.job_rows(before, down) == []


# -- the command on a real cluster ----------------------------------------------------


def cells(screen: str, task: str) -> list[str] | None:
    """The cells of ``task``'s row of a drawn table, or None if it has none."""
    for line in screen.splitlines():
        parts = [p.strip() for p in line.split("│")]
        if len(parts) > 2 and parts[1] == task:
            return parts[1:-1]
    return None


def cell(screen: str, task: str, column: int) -> str | None:
    row = cells(screen, task)
    return None if row is None else row[column]


def rate(text: str | None) -> float:
    """A rate cell as a number; -1 for "-" or a cell caught half drawn."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return -1.0


def run_top(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterwire", "top", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cluster():
    """1 ps + 2 workers, real processes; a client thread doing gets on worker 0 (a known
    load: the other tasks serve nothing but top)."""
    with LocalCluster({"ps": 1, "worker": 2}, env=child_env()) as started:
        stop, gets = threading.Event(), [0]

        def load() -> None:
            with Session(started.target("worker", 0)) as session:
                session.put("x", np.arange(1000))
                while not stop.is_set():
                    session.get("x")
                    gets[0] += 1

        loader = threading.Thread(target=load)
        loader.start()
        try:
            wait_for(lambda: gets[0] > 0, what="the load to start")
            yield started
        finally:
            stop.set()
            loader.join(10)


def test_once_prints_every_task_with_exact_idle_rates(cluster):
    # A generous deadline: the test measures rates, and a loaded machine answers slowly.
    result = run_top(cluster.target("ps"), "--once", "--interval", "0.3", "--timeout", "10")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"clusterwire top {cluster.target('ps')}: 3 of 3 tasks serving, every 0.3 s" in out
    ps, loaded, idle = (cells(out, t) for t in
                        ("/job:ps/task:0", "/job:worker/task:0", "/job:worker/task:1"))
    assert ps[:2] == ["/job:ps/task:0", cluster.target("ps").removeprefix("grpc://")]
    assert loaded[1] == cluster.target("worker", 0).removeprefix("grpc://")
    # Nothing but top asks the ps and worker 1, and top leaves its own requests out.
    assert ps[2:9] == idle[2:9] == ["serving", "0.0", "0.0", "0 B/s", "0 B/s", "0", "0 B"]
    assert loaded[2] == "serving" and float(loaded[3]) > 10 and loaded[4] == "0.0"
    assert loaded[8] == "7.8 KiB"  # 1000 int64


def test_once_exits_1_when_a_task_does_not_answer(cluster):
    cluster.process("worker", 1).kill()
    started = time.monotonic()
    result = run_top(cluster.target("ps"), "--once", "--interval", "0.2", "--timeout", "0.5")
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - started < 15
    assert cells(result.stdout, "/job:worker/task:1")[2:4] == ["unreachable", "-"]
    assert cells(result.stdout, "/job:ps/task:0")[2] == "serving"
    assert "/job:worker/task:1: UnavailableError: Task at 127.0.0.1:" in result.stdout


@pytest.mark.parametrize("args, message", [
    (("grpc://127.0.0.1:1",), "The task at grpc://127.0.0.1:1 did not answer its status request: "
                              "UnavailableError: Task at 127.0.0.1:1 (grpc) is unavailable "
                              "after 0.5 s"),
    (("--dispatcher", "127.0.0.1:1"), "The dispatcher at 127.0.0.1:1 (grpc) did not answer "
                                      "its status request: UnavailableError:"),
])
def test_a_dead_target_is_one_clear_error_in_bounded_time(args, message):
    result = run_top(*args, "--once", "--timeout", "0.5", timeout=15)
    assert result.returncode == 1
    assert result.stderr.startswith(f"clusterwire top: UnavailableError: {message}"), (
        result.stderr)
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    ((), "give a TARGET (a task's grpc://host:port) or --dispatcher HOST:PORT"),
    (("grpc://127.0.0.1:1", "--dispatcher", "127.0.0.1:2"), "give a TARGET"),
    (("grpc://127.0.0.1:1", "--protocol", "grpc"), "--protocol is for --dispatcher"),
    (("grpc://127.0.0.1:1", "--interval", "0"),
     "InvalidArgumentError: --interval 0.0: must be a number of seconds > 0"),
    (("grpc://127.0.0.1:1", "--timeout", "-1"),
     "InvalidArgumentError: --timeout -1.0: must be a number of seconds > 0"),
])
def test_bad_arguments(args, message):
    result = run_top(*args)
    assert result.returncode in (1, 2) and message in result.stderr
    assert "Traceback" not in result.stderr


def test_rich_is_imported_only_to_draw():
    assert fresh_python("import sys, clusterwire.cli, clusterwire.top; "
                        "print('rich' in sys.modules)") == "False\n"


def test_without_rich_says_how_to_install_it():
    code = ("import sys; sys.modules['rich'] = None\n"
            "from clusterwire.cli import main\n"
            "sys.exit(main(['top', 'grpc://127.0.0.1:1']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2
    assert result.stderr == ("clusterwire top needs rich, which is not installed: "
                             "pip install 'clusterwire[top]'\n")


def test_dispatcher_view_of_a_loaded_data_service():
    from clusterwire import data

    with in_process_data_service(workers=2) as dispatcher:
        address = dispatcher.target.removeprefix("grpc://")
        dataset = data.Dataset.range(10**9).apply(data.distribute(
            processing_mode="parallel_epochs", service=dispatcher.target, job_name="top"))
        stop, read = threading.Event(), [0]

        def consume() -> None:
            for _ in dataset:
                read[0] += 1
                if stop.is_set():
                    break

        consumer = threading.Thread(target=consume)
        consumer.start()
        try:
            wait_for(lambda: read[0] > 0, what="the first element")
            result = run_top("--dispatcher", address, "--once", "--interval", "1",
                             "--timeout", "10")  # the consumer's load slows the answers
            assert result.returncode == 0, result.stderr
            out = result.stdout
            assert f"clusterwire top --dispatcher {address}: 2 workers, 1 jobs, every 1 s" in out
            workers = [cells(out, w.address) for w in
                       data.service_status(address).workers]
            for row in workers:
                # One open stream, none finished.
                assert row[1] == "serving" and row[2].endswith(" s") and row[6:8] == ["1", "0"]
                assert float(row[3]) >= 0 and row[4].endswith("/s") and float(row[8]) >= 0
                assert row[9] == "0.0"
            # One worker may answer no read in an interval (the consumer's buffer is full of
            # the other's batches), the two together do.
            assert sum(float(row[3]) for row in workers) > 0
            assert sum(float(row[8]) for row in workers) > 0
            [job] = [line for line in out.splitlines() if "│ top " in line]
            job_cells = [c.strip() for c in job.split("│")[1:-1]]
            assert job_cells[1:5] == ["top", "parallel_epochs", "running", "1"]
            # Summed over the workers: three numbers printed to 0.1, each off by <= 0.05.
            printed = sum(float(row[3]) for row in workers)
            assert abs(float(job_cells[7]) - printed) <= 0.15
        finally:
            stop.set()
            consumer.join(10)


# -- the live view in a real terminal ---------------------------------------------------


class Tmux:
    """A tmux server of its own, its socket in ``folder``: no one else's sessions are
    touched, and nothing is left behind."""

    def __init__(self, folder):
        self.socket = str(folder / "tmux.socket")

    def __call__(self, *args: str) -> str:
        # os.environ, not the C environment a subprocess would inherit: readline, once
        # loaded in this process, exports COLUMNS=80 there, which rich would draw to.
        return subprocess.run(["tmux", "-S", self.socket, "-f", "/dev/null", *args],
                              capture_output=True, text=True, check=True, timeout=10,
                              env=dict(os.environ)).stdout

    def kill(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True,
                       timeout=10)


def wait_for_screen(tmux: Tmux, condition, what: str, timeout: float = 15.0) -> str:
    """Poll the pane until ``condition(screen)``; fail with the screen after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        screen = tmux("capture-pane", "-p", "-t", "top")
        if condition(screen):
            return screen
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}; the screen:\n{screen}")
        time.sleep(0.05)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_live_view_in_a_terminal(cluster, tmp_path):
    tmux = Tmux(tmp_path)
    log = tmp_path / "pane.log"
    # bash goes on after top handles the Ctrl-C (tmux's own exit status of a pane is not
    # always there: it may mark the pane dead before it reaps the process).
    command = (f"bash -c '{sys.executable} -m clusterwire top {cluster.target('ps')} "
               "--interval 0.3; echo top exited with status $?'")
    try:
        tmux("new-session", "-d", "-s", "top", "-x", "200", "-y", "50", command)
        tmux("set-option", "-t", "top", "-w", "remain-on-exit", "on")
        tmux("pipe-pane", "-t", "top", f"cat >> {log}")
        addresses = {task: cluster.target(job, index).removeprefix("grpc://")
                     for task, job, index in (("/job:ps/task:0", "ps", 0),
                                              ("/job:worker/task:0", "worker", 0),
                                              ("/job:worker/task:1", "worker", 1))}

        def frame(screen: str, health: dict[str, str]) -> bool:
            """Whether ``screen`` shows every task at its address with ``health``; a frame
            is drawn over the last one, so a capture may hold rows of both: poll."""
            rows = {task: cells(screen, task) for task in addresses}
            return all(rows[task] is not None and rows[task][:3] == [task, address, health[task]]
                       for task, address in addresses.items())

        # The first frame has no rates; the next ones do: the loaded task's, and exactly 0
        # for the others.
        serving = dict.fromkeys(addresses, "serving")
        wait_for_screen(tmux, lambda s: frame(s, serving) and cell(
            s, "/job:ps/task:0", 3) == cell(s, "/job:worker/task:1", 3) == "0.0" and (
            rate(cell(s, "/job:worker/task:0", 3)) > 10), "a frame with rates")
        assert tmux("display", "-p", "-t", "top", "#{cursor_flag}").strip() == "0"

        cluster.process("worker", 1).kill()
        # The error line is drawn below the table: a capture may come before it is.
        error = "/job:worker/task:1: UnavailableError: Task at 127.0.0.1:"
        screen = wait_for_screen(tmux, lambda s: frame(
            s, {**serving, "/job:worker/task:1": "unreachable"}) and cells(
            s, "/job:worker/task:1")[3:9] == ["-"] * 6 and error in s,
            "the killed task to turn unreachable, its error below the table")
        assert error in screen

        tmux("send-keys", "-t", "top", "C-c")
        screen = wait_for_screen(tmux, lambda s: "top exited with status" in s,
                                 "top to exit on Ctrl-C")
        assert "top exited with status 0" in screen and "Traceback" not in screen
        # The terminal is restored: the cursor rich hid is shown again.
        wait_for(lambda: b"top exited with status" in log.read_bytes(), what="the pane's log")
        written = log.read_bytes()
        assert written.rfind(b"\x1b[?25h") > written.rfind(b"\x1b[?25l")
    finally:
        tmux.kill()


# -- serve --metrics-port ---------------------------------------------------------------


def test_serve_metrics_port_prints_the_url_and_serves_it():
    from urllib.request import urlopen

    proc = subprocess.Popen(
        [sys.executable, "-m", "clusterwire", "serve", "--cluster",
         '{"worker": ["127.0.0.1:0"]}', "--job-name", "worker", "--task-index", "0",
         "--metrics-port", "0", "--metrics-host", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **child_env()})
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), proc.stderr.read()
        banner = proc.stderr.readline()
        target = line[len(READY_PREFIX):].strip()
        prefix = f"clusterwire: serving /job:worker/task:0 at {target}, metrics at "
        assert banner.startswith(prefix), banner
        url = banner[len(prefix):].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        with urlopen(url, timeout=10) as response:
            assert response.status == 200
            assert 'clusterwire_serving{server="/job:worker/task:0"} 1.0' in response.read(
            ).decode()
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


@pytest.mark.parametrize("args, message", [
    (("--metrics-host", "127.0.0.1"), "--metrics-host without --metrics-port: the endpoint "
                                      "serves only on a port; add --metrics-port N"),
    (("--metrics-port", "0", "--config", '{"metrics_port": 9}'),
     "--config sets metrics_port=9 and --metrics-port 0: give one."),
])
def test_serve_metrics_flag_errors(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "clusterwire", "serve", "--cluster",
         '{"worker": ["127.0.0.1:0"]}', "--job-name", "worker", "--task-index", "0", *args],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert f"clusterwire serve: InvalidArgumentError: {message}" in result.stderr

