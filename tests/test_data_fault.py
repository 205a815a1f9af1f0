"""The data service across processes: CLI servers, SIGKILLed workers, dispatcher restarts."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter

import cw_data_functions as fns
import numpy as np
import pytest
from cw_data_procs import ServerProcess

from clusterwire import data, errors
from clusterwire.data import dispatcher as dispatcher_module
from clusterwire.data import reader, splits
from clusterwire.data.journal import JOURNAL_DIR, JOURNAL_FILE

SLOW = {"CW_DATA_SLOW_S": "0.001"}


def worker_args(dispatcher: ServerProcess) -> list[str]:
    return ["--dispatcher-address", dispatcher.address, "--heartbeat-interval-ms", "200",
            "--import", "cw_data_functions"]


@pytest.mark.timeout(60)
def test_cli_servers_run_the_issue_example_and_stop_on_sigterm(processes):
    dispatcher = processes("dispatcher", "--port", "0")
    worker = processes("worker", *worker_args(dispatcher))
    assert dispatcher.target.startswith("grpc://localhost:")
    dataset = data.Dataset.range(10).apply(
        data.distribute(processing_mode="parallel_epochs", service=dispatcher.target))
    assert list(dataset.as_numpy_iterator()) == list(range(10))
    assert worker.terminate() == 0 and dispatcher.terminate() == 0
    assert "Traceback" not in dispatcher.stderr() + worker.stderr()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkilled_worker_loses_and_repeats_nothing(processes, seed):
    rng = random.Random(seed)
    dispatcher = processes("dispatcher", "--port", "0", "--worker-timeout-ms", "1000")
    workers = [processes("worker", *worker_args(dispatcher), env=SLOW) for _ in range(3)]
    count = 600
    ds = data.Dataset.range(count).map(fns.slow_identity).apply(
        data.distribute("distributed_epoch", dispatcher.target))
    kill_after = rng.randint(1, count * 2 // 3)
    victim = rng.choice(workers)
    seen = Counter()
    for index, element in enumerate(ds):
        seen[int(element)] += 1
        if index + 1 == kill_after:
            victim.kill()
    assert victim.process.returncode == -9
    assert seen == Counter(range(count)), (kill_after, seen - Counter(range(count)),
                                           Counter(range(count)) - seen)


@pytest.mark.timeout(90)
def test_dispatcher_sigkill_and_restart_in_fault_tolerant_mode(processes, tmp_path):
    work_dir = str(tmp_path / "work")
    ft = ["--fault-tolerant-mode", "--work-dir", work_dir]
    dispatcher = processes("dispatcher", "--port", "0", *ft)
    for _ in range(2):
        processes("worker", *worker_args(dispatcher), env={"CW_DATA_SLOW_S": "0.003"})
    count = 400
    dataset_id = data.register_dataset(
        dispatcher.target, data.Dataset.range(count).map(fns.slow_identity), dataset_id="kept")
    ds = data.from_dataset_id("distributed_epoch", dispatcher.target, dataset_id)
    seen = Counter()
    for index, element in enumerate(ds):
        seen[int(element)] += 1
        if index + 1 == count // 4:
            dispatcher.kill()
            dispatcher = processes("dispatcher", "--port", str(dispatcher.port), *ft)
    assert seen == Counter(range(count))
    again = data.from_dataset_id("distributed_epoch", dispatcher.target, "kept")
    assert sorted(int(x) for x in again) == list(range(count))


def journal_path(work_dir: str) -> str:
    return os.path.join(work_dir, JOURNAL_DIR, JOURNAL_FILE)


def ft_config(work_dir: str) -> data.DispatcherConfig:
    # The replayed journal names the first run's worker; it times out quickly.
    return data.DispatcherConfig(port=0, work_dir=work_dir, fault_tolerant_mode=True,
                                 worker_timeout_ms=500)


def run_jobs_in_fault_tolerant_mode(work_dir: str) -> None:
    config = ft_config(work_dir)
    with data.DispatchServer(config) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(port=0, dispatcher_address=address):
            data.register_dataset(dispatcher.target, data.Dataset.range(30), dataset_id="ds")
            read = data.from_dataset_id("distributed_epoch", dispatcher.target, "ds")
            assert sorted(int(x) for x in read) == list(range(30))


@pytest.mark.timeout(60)
def test_a_cut_short_journal_tail_is_reported_and_dropped(tmp_path):
    work_dir = str(tmp_path)
    run_jobs_in_fault_tolerant_mode(work_dir)
    size = os.path.getsize(journal_path(work_dir))
    with open(journal_path(work_dir), "ab") as journal:
        length = (100).to_bytes(4, "little")
        journal.write(length + zlib.crc32(length).to_bytes(4, "little") + b"\0" * 4 + b"partial")
    config = ft_config(work_dir)
    with data.DispatchServer(config) as dispatcher:
        report = dispatcher.journal_report
        assert report.truncated_bytes == 19 and "cut short" in report.message
        assert os.path.getsize(journal_path(work_dir)) == size
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(port=0, dispatcher_address=address):
            read = data.from_dataset_id("parallel_epochs", dispatcher.target, "ds")
            assert sorted(int(x) for x in read) == list(range(30))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", [0, 4, 8, 0.5])
def test_a_corrupt_journal_is_refused_not_replayed(tmp_path, where):
    work_dir = str(tmp_path)
    run_jobs_in_fault_tolerant_mode(work_dir)
    size = os.path.getsize(journal_path(work_dir))
    with open(journal_path(work_dir), "r+b") as journal:  # a length, its checksum, a body
        journal.seek(int(size * where) if isinstance(where, float) else where)
        byte = journal.read(1)
        journal.seek(-1, os.SEEK_CUR)
        journal.write(bytes([byte[0] ^ 0xFF]))
    config = ft_config(work_dir)
    with pytest.raises(errors.DataLossError, match="is corrupt at byte"):
        data.DispatchServer(config)
    result = subprocess.run(
        [sys.executable, "-m", "clusterwire", "dispatcher", "--fault-tolerant-mode",
         "--work-dir", work_dir], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "DataLossError" in result.stderr and "Traceback" not in result.stderr


def journal_records(work_dir: str) -> int:
    from clusterwire.data.journal import Journal

    return len(Journal(work_dir).read().entries)


@pytest.mark.timeout(60)
def test_the_journal_is_compacted_and_replays_to_the_same_state(tmp_path, monkeypatch):
    """About a hundred split decisions leave a journal of a few dozen records; a dispatcher
    restarted on it has the same jobs and datasets. (49 splits, cut at 512 elements rather
    than MAX_SPLIT_UNITS' 4096: the same decisions on an eighth of the elements.)"""
    monkeypatch.setattr(dispatcher_module, "_COMPACT_SLACK", 20)
    monkeypatch.setattr(splits, "MAX_SPLIT_UNITS", 512)
    work_dir = str(tmp_path)
    config = ft_config(work_dir)
    with data.DispatchServer(config) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(data.WorkerConfig(dispatcher_address=address,
                                                 heartbeat_interval_ms=100)):
            data.register_dataset(dispatcher.target, data.Dataset.range(25_000),
                                  dataset_id="big")
            read = data.from_dataset_id("distributed_epoch", dispatcher.target, "big")
            assert sum(1 for _ in read) == 25_000
            assert journal_records(work_dir) < 20 + 10
            data.register_dataset(dispatcher.target, data.Dataset.range(30), dataset_id="ds")
            jobs_before = dispatcher.num_jobs()
    with data.DispatchServer(config) as dispatcher:
        assert dispatcher.num_jobs() == jobs_before
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(port=0, dispatcher_address=address):
            read = data.from_dataset_id("distributed_epoch", dispatcher.target, "ds")
            assert sorted(int(x) for x in read) == list(range(30))


@pytest.mark.timeout(60)
def test_unused_datasets_are_collected_with_their_payloads(tmp_path):
    work_dir = str(tmp_path)
    config = data.DispatcherConfig(port=0, work_dir=work_dir, fault_tolerant_mode=True,
                                   job_gc_check_interval_ms=50, job_gc_timeout_ms=1,
                                   dataset_gc_timeout_ms=2000)
    payloads = os.path.join(work_dir, "datasets")
    with data.DispatchServer(config) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(port=0, dispatcher_address=address):
            data.register_dataset(dispatcher.target,
                                  data.Dataset.from_tensor_slices(np.arange(1000)),
                                  dataset_id="slices")
            read = iter(data.from_dataset_id("parallel_epochs", dispatcher.target, "slices"))
            next(read)  # a job reads the dataset now: its payload is kept
            assert len(os.listdir(payloads)) == 1
            assert 1 + sum(1 for _ in read) == 1000
            deadline = time.monotonic() + 20
            while os.listdir(payloads) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert os.listdir(payloads) == []
            with pytest.raises(errors.NotFoundError, match="slices"):
                data.from_dataset_id("parallel_epochs", dispatcher.target, "slices")
    with data.DispatchServer(config) as dispatcher:  # the journal no longer names it
        with pytest.raises(errors.NotFoundError, match="slices"):
            data.from_dataset_id("parallel_epochs", dispatcher.target, "slices")


# ---- stalled workers (SIGSTOP): retried while the dispatcher lists them -----------------------

class Stall:
    """SIGSTOP a server process now; SIGCONT it after ``seconds`` (or at ``resume()``)."""

    def __init__(self, server: ServerProcess, seconds: float | None):
        self._pid = server.process.pid
        os.kill(self._pid, signal.SIGSTOP)
        self.resumes_at = time.monotonic() + (seconds or 0)
        self._timer = threading.Timer(seconds, self.resume) if seconds else None
        if self._timer is not None:
            self._timer.start()

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # killed by the fixture meanwhile
            os.kill(self._pid, signal.SIGCONT)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.resume()


def spy(monkeypatch, name: str, then=None) -> list:
    """Record (first argument, time) of each call of ``JobReader.<name>``; ``then(first
    argument)`` is called before the method (on the reader's thread)."""
    calls: list = []
    original = getattr(reader.JobReader, name)

    def recorded(self, *args):
        calls.append((args[0], time.monotonic()))
        if then is not None:
            then(args[0])
        return original(self, *args)

    monkeypatch.setattr(reader.JobReader, name, recorded)
    return calls


def read_with_stall(ds, victim: ServerProcess, after: int, seconds: float | None
                    ) -> tuple[list[int], Stall]:
    """The elements of ``ds``; ``victim`` stalls for ``seconds`` after ``after`` of them."""
    seen, stall = [], None
    try:
        for element in ds:
            seen.append(int(element))
            if len(seen) == after:
                stall = Stall(victim, seconds)
    finally:
        if stall is not None:
            stall.close()
    return seen, stall


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_distributed_epoch_waits_out_a_stalled_worker_and_uses_it_again(processes, monkeypatch,
                                                                       workers):
    """The issue: one worker stopped for longer than a read's timeout left the consumer
    blocked for good. Its splits now wait for it (or move to the other worker), it is probed
    until it answers, and then reads splits again: every element exactly once.

    The victim is resumed once its reads timed out, and the other worker is held from then
    until the victim reads a split again: splits are left for it however fast the other
    worker reads (with a fixed stall, the other worker could read them all first)."""
    monkeypatch.setattr(reader, "TIMINGS", dataclasses.replace(
        reader.TIMINGS, read_wait_s=0.2, read_timeout_s=2.0))
    dispatcher = processes("dispatcher", "--port", "0")
    servers = [processes("worker", *worker_args(dispatcher), env={"CW_DATA_SLOW_S": "0.0005"})
               for _ in range(workers)]
    victim = f"localhost:{servers[0].port}"
    lock, stalled, held, resumed_at = threading.Lock(), [], [], []

    def orphaned_one(address: str) -> None:
        with lock:
            if address == victim and stalled and not resumed_at:
                held.extend(Stall(server, None) for server in servers[1:])
                resumed_at.append(time.monotonic())
                stalled[0].resume()

    def placed_one(address: str) -> None:
        with lock:
            if address == victim and resumed_at:
                for stall in held:
                    stall.resume()

    orphaned = spy(monkeypatch, "_orphan", orphaned_one)
    placed = spy(monkeypatch, "_read_split", placed_one)
    # With another worker, more than it reads while the victim's reads time out (its 2 slots
    # read at most 2 x 2,000 elements a second, slow_identity sleeping 0.5 ms each).
    count = 20_000 if workers > 1 else 4_000
    ds = data.Dataset.range(count).map(fns.slow_identity).apply(
        data.distribute("distributed_epoch", dispatcher.target))
    seen = []
    try:
        for element in ds:
            seen.append(int(element))
            if len(seen) == 500:
                with lock:
                    stalled.append(Stall(servers[0], None))
    finally:
        with lock:
            for stall in stalled + held:
                stall.close()
    assert Counter(seen) == Counter(range(count))
    assert victim in {address for address, _ in orphaned}  # its reads did time out
    assert any(address == victim and when > resumed_at[0] for address, when in placed)


@pytest.mark.timeout(60)
def test_a_worker_the_dispatcher_stops_listing_loses_its_reads_at_once(processes, monkeypatch):
    """A worker stalled (or cut off) past worker_timeout_ms: once the dispatcher no longer
    lists it, the consumer's reads in flight to it end and its splits move to the other
    worker, without waiting out the read's timeout (its default, 15 s, here)."""
    orphaned = spy(monkeypatch, "_orphan")
    dispatcher = processes("dispatcher", "--port", "0", "--worker-timeout-ms", "1000")
    servers = [processes("worker", *worker_args(dispatcher), env={"CW_DATA_SLOW_S": "0.0005"})
               for _ in range(2)]
    count = 4000
    ds = data.Dataset.range(count).map(fns.slow_identity).apply(
        data.distribute("distributed_epoch", dispatcher.target))
    seen, stall = read_with_stall(ds, servers[0], after=500, seconds=30.0)
    assert Counter(seen) == Counter(range(count))
    stalled_at = stall.resumes_at - 30.0
    moved = [when - stalled_at for address, when in orphaned
             if address == f"localhost:{servers[0].port}"]
    assert moved and max(moved) < reader.TIMINGS.read_timeout_s - 5, moved
    assert time.monotonic() - stalled_at < reader.TIMINGS.read_timeout_s  # the victim still stalled


@pytest.mark.timeout(60)
def test_distributed_epoch_fails_clearly_when_no_worker_serves_an_orphaned_split(
        processes, monkeypatch):
    monkeypatch.setattr(reader, "TIMINGS", dataclasses.replace(
        reader.TIMINGS, read_wait_s=0.2, read_timeout_s=1.0, stalled_s=2.0))
    dispatcher = processes("dispatcher", "--port", "0")
    worker = processes("worker", *worker_args(dispatcher))
    ds = data.Dataset.range(10 ** 6).apply(data.distribute("distributed_epoch",
                                                            dispatcher.target))
    started = time.monotonic()
    with pytest.raises(errors.UnavailableError,
                       match=r"No tf.data service worker could read split .* for 2 s: "
                             rf"worker\(s\) localhost:{worker.port} stopped answering"):
        read_with_stall(ds, worker, after=100, seconds=None)
    assert time.monotonic() - started < 20


@pytest.mark.timeout(60)
def test_parallel_epochs_waits_out_a_stalled_worker_instead_of_truncating(processes,
                                                                         monkeypatch):
    """The issue: the iteration ended normally after 1025 of 200000 elements. A worker the
    dispatcher still lists is read again once it answers: nothing lost, nothing repeated.
    (Before, a worker failing reads for 5 s was given up: here from 1 s + 5 s on.)"""
    monkeypatch.setattr(reader, "TIMINGS", dataclasses.replace(
        reader.TIMINGS, read_wait_s=0.2, read_timeout_s=1.0))
    dispatcher = processes("dispatcher", "--port", "0")
    worker = processes("worker", *worker_args(dispatcher))
    count = 100_000
    ds = data.Dataset.range(count).apply(data.distribute("parallel_epochs", dispatcher.target))
    seen, _ = read_with_stall(ds, worker, after=1000, seconds=8.0)
    assert seen == list(range(count))


@pytest.mark.timeout(60)
def test_parallel_epochs_losing_a_worker_ends_with_data_loss_not_a_normal_end(
        processes, caplog):
    """As in TF, a dead worker's copy is given up and the other workers' elements keep
    coming; but the end says so (DataLossError) and a warning names the worker at once."""
    dispatcher = processes("dispatcher", "--port", "0", "--worker-timeout-ms", "1000")
    victim, survivor = (processes("worker", *worker_args(dispatcher), env=SLOW)
                        for _ in range(2))
    count = 3000
    ds = data.Dataset.range(count).map(fns.slow_identity).apply(
        data.distribute("parallel_epochs", dispatcher.target))
    seen: Counter = Counter()
    with pytest.raises(errors.DataLossError, match=rf"localhost:{victim.port} \(\d+ of its "
                                                   rf"{count} elements dropped\)"):
        for element in ds:
            seen[int(element)] += 1
            if seen[int(element)] == 2 and victim.process.poll() is None:
                victim.kill()  # both workers have delivered some: the victim's copy is partial
    assert set(seen) == set(range(count)) and max(seen.values()) <= 2  # the survivor's copy
    assert sum(seen.values()) < 2 * count
    assert f"worker localhost:{victim.port}" in caplog.text and survivor.process.poll() is None
