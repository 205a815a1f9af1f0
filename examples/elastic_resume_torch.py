"""Resume a PyTorch training run mid-epoch on another world size, after SIGKILLs.

    pip install torch --index-url https://download.pytorch.org/whl/cpu   # the CPU build
    pip install 'clusterwire[torch]'                                      # and torchdata
    python examples/elastic_resume_torch.py [--samples 16384] [--steps-before-kill 8]

What it shows: a fault-tolerant dispatcher (its journal in a temporary work dir) and two
data workers start as processes on 127.0.0.1. Two trainer ranks (``torch.distributed``,
gloo, CPU; a ``DistributedDataParallel`` model) each read through a ``StatefulDataLoader``
of two loader workers over a ``ServiceDataset`` in ``distributed_epoch`` mode: four
consumers of one job, an epoch of distinct numbered samples. After ``--steps-before-kill``
steps they checkpoint: every rank's loader state (a position per loader worker), gathered
with ``all_gather_object``, goes into one checkpoint with the model. They train
``--steps-after-checkpoint`` steps more and are SIGKILLed (each rank with its loader
workers); the dispatcher is SIGKILLed too and restarted on the same address and work dir.
Three ranks of one loader worker each then resume from the checkpoint
(``merge_loader_states(states, num_workers=1)``: the 4 old consumers' positions merged into
one that any number of new consumers share) and train to the end of the epoch. The first
run's loaders are in order, for exact checkpoints, which is why the epoch has at least 16384
samples (``MIN_SPLIT_BATCHES``); the resumed ranks read ahead (``ReadAhead``).

The verdict line checks that every sample of the epoch was trained on exactly once over the
run: those trained up to the checkpoint by the first run, and all of the resumed run's (what
the killed ranks read after the checkpoint does not count: the resumed run reads it again).
The exit status is 1 otherwise. Every process started here is stopped at exit, also on
failure or SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _training import CLASSES, FEATURES, synthetic_task
from torch.nn.parallel import DistributedDataParallel
from torchdata.stateful_dataloader import StatefulDataLoader

from clusterwire import data
from clusterwire.data import worker_auth
from clusterwire.data.cli import await_ready
from clusterwire.data.splits import SPLITS_PER_WORKER
from clusterwire.data.torch_dataset import ServiceDataset, merge_loader_states
from clusterwire.plugins import get_plugin_manager

BATCH = 16
DATA_WORKERS = 2
OLD_RANKS, OLD_LOADER_WORKERS = 2, 2
NEW_RANKS, NEW_LOADER_WORKERS = 3, 1
#: The first run's loaders are in order (their checkpoints exact), and an in-order loader
#: waits for each of its loader workers in turn: none may find every split of the job held
#: by the others. The service cuts an epoch into 8 splits per worker (``SPLITS_PER_WORKER``)
#: and each of the 4 consumers holds up to 4 at once (2 per worker), so no split may end in
#: the first run: a split holds at least MIN_SPLIT_BATCHES, more than a consumer reads ahead
#: of its loader (16 and the loader's prefetch) plus the MAX_FIRST_STEPS it trains.
MIN_SPLIT_BATCHES, MAX_FIRST_STEPS = 64, 32
MIN_SAMPLES = DATA_WORKERS * SPLITS_PER_WORKER * MIN_SPLIT_BATCHES * BATCH
#: The ranks' loaders seed their iterators alike: the job their loader workers share is
#: named by that seed (see ``clusterwire.data.torch_dataset``).
LOADER_SEED = 1234
#: Seconds each phase may take before the run is called failed (a busy machine's margin).
PHASE_S = 180.0
PAST_CHECKPOINT = "past the checkpoint, waiting to be killed"


# ---- a trainer rank (a process of its own) ------------------------------------------------

def join_group(store_port: int, rank: int, world: int) -> None:
    """Join the gloo process group through the run's TCPStore (on 127.0.0.1; gloo's own
    connections on the loopback interface, GLOO_SOCKET_IFNAME)."""
    store = dist.TCPStore("127.0.0.1", store_port)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def service_dataset(args: argparse.Namespace) -> ServiceDataset:
    """The run's dataset, read through the service (each loader worker a consumer)."""
    return ServiceDataset(args.dataset_id, "distributed_epoch", args.target,
                          job_name="elastic", data_transfer_protocol=args.protocol,
                          # One element a read: a consumer holds few more than its loader
                          # asks for, and does not take the rest of a small epoch from
                          # the ranks that start reading later.
                          max_outstanding_requests=1)


def new_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A 2-layer MLP for the synthetic task, and its optimizer."""
    torch.manual_seed(0)  # every rank starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, CLASSES))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, scale: float) -> float:
    """One step on the batch; its loss summed over the samples times ``scale`` (the
    gradients DistributedDataParallel averages over the ranks then are the mean over the
    step's samples); the mean loss of its samples."""
    loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    optimizer.zero_grad()
    (loss * scale).backward()
    optimizer.step()
    return loss.item() / max(1, len(y))


def first_run(args: argparse.Namespace, rank: int) -> int:
    """Train, checkpoint after ``--steps-before-kill`` steps, train on, wait for SIGKILL."""
    join_group(args.store_port, rank, OLD_RANKS)
    model, optimizer = new_model()
    ddp = DistributedDataParallel(model)
    # In order (the default), so that the loader's state is exactly the batches it yielded.
    loader = StatefulDataLoader(service_dataset(args), batch_size=None,
                                num_workers=OLD_LOADER_WORKERS, timeout=PHASE_S,
                                generator=torch.Generator().manual_seed(LOADER_SEED))
    trained: list[int] = []
    last = args.steps_before_kill + args.steps_after_checkpoint
    for step, (ids, x, y) in enumerate(loader, 1):
        loss = train_step(ddp, optimizer, x, y, 1 / len(y))
        if step <= args.steps_before_kill:
            trained += ids.tolist()
        if step == args.steps_before_kill:
            gathered: list[Any] = [None] * OLD_RANKS
            dist.all_gather_object(gathered, {"loader": loader.state_dict(),
                                              "trained": trained})
            if rank == 0:
                save_checkpoint(args.checkpoint, {
                    "loader_states": [g["loader"] for g in gathered],
                    "trained": [i for g in gathered for i in g["trained"]],
                    "model": model.state_dict(), "optimizer": optimizer.state_dict()})
            print(f"rank {rank}: checkpoint at step {step} (loss {loss:.3f})", flush=True)
        if step == last:
            print(f"rank {rank}: step {step}, {PAST_CHECKPOINT}", flush=True)
            sys.stdin.read()  # until the SIGKILL (or the run's end closes our stdin)
            return 1
    print(f"rank {rank}: the epoch ended at step {step}, before step {last}", flush=True)
    return 1


def save_checkpoint(path: str, checkpoint: dict[str, Any]) -> None:
    """Write ``checkpoint`` atomically: a kill never leaves half of one."""
    torch.save(checkpoint, path + ".tmp")
    os.replace(path + ".tmp", path)


def resumed_run(args: argparse.Namespace, rank: int) -> int:
    """Resume from the checkpoint as one of NEW_RANKS ranks and train to the epoch's end."""
    join_group(args.store_port, rank, NEW_RANKS)
    checkpoint = torch.load(args.checkpoint, weights_only=True)
    model, optimizer = new_model()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    ddp = DistributedDataParallel(model)
    loader = StatefulDataLoader(service_dataset(args), batch_size=None,
                                num_workers=NEW_LOADER_WORKERS, timeout=PHASE_S)
    loader.load_state_dict(merge_loader_states(checkpoint["loader_states"],
                                               num_workers=NEW_LOADER_WORKERS))
    batches = ReadAhead(loader)
    none = (torch.empty(0, dtype=torch.int64), torch.empty(0, FEATURES),
            torch.empty(0, dtype=torch.int64))
    trained: list[int] = []
    steps, loss = 0, float("nan")
    while True:
        batch = batches.next()
        # The ranks run out of batches at different steps: a step is taken while any rank
        # has a batch (one with none adds no gradient).
        samples = torch.tensor(0 if batch is None else len(batch[0]))
        with batches.unbounded():
            dist.all_reduce(samples)
        if samples.item() == 0:
            break
        ids, x, y = batch if batch is not None else none
        step_loss = train_step(ddp, optimizer, x, y, NEW_RANKS / samples.item())
        if batch is not None:
            trained += ids.tolist()
            steps, loss = steps + 1, step_loss
    gathered: list[Any] = [None] * NEW_RANKS
    dist.all_gather_object(gathered, trained)
    print(f"rank {rank}: resumed, {steps} batches to the epoch's end (last loss "
          f"{loss:.3f})", flush=True)
    if rank == 0:
        with open(args.result, "w") as file:
            json.dump([i for part in gathered for i in part], file)
    dist.destroy_process_group()
    return 0


class ReadAhead:
    """A loader's batches, read by a thread of its own up to AHEAD batches ahead of the
    training loop, and without that bound while the loop waits for the other ranks
    (``unbounded()``). A distributed_epoch consumer with no split left waits, before its
    epoch ends, for the splits the job's other consumers still hold (a consumer that dies
    gives its splits back): a rank waiting for the others must read its own splits on to
    their end, or the two would wait for each other."""

    AHEAD = 4

    def __init__(self, loader: StatefulDataLoader):
        self._batches: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._waiting = self._ended = False
        self._error: BaseException | None = None
        threading.Thread(target=self._read, args=(loader,), daemon=True,
                         name="read-ahead").start()

    def _read(self, loader: StatefulDataLoader) -> None:
        try:
            for batch in loader:
                with self._cond:
                    self._cond.wait_for(
                        lambda: len(self._batches) < self.AHEAD or self._waiting)
                    self._batches.append(batch)
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - raised again by next()
            self._error = err
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def next(self) -> Any:
        """The next batch; None at the end of the loader's epoch."""
        with self._cond:
            self._cond.wait_for(lambda: self._batches or self._ended)
            if self._batches:
                self._cond.notify_all()
                return self._batches.popleft()
        if self._error is not None:
            raise self._error
        return None

    @contextlib.contextmanager
    def unbounded(self) -> Iterator[None]:
        """Read on without a bound inside the block (a wait for the other ranks)."""
        with self._cond:
            self._waiting = True
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._waiting = False


# ---- the run: servers, ranks, kills, verdict -----------------------------------------------

class Processes:
    """The processes of the run; ``close`` ends every one still running (a rank with its
    process group: its loader workers)."""

    def __init__(self) -> None:
        self._started: list[tuple[subprocess.Popen, bool]] = []

    def start(self, argv: Sequence[str], env: dict[str, str], group: bool = False,
              ends_last: bool = False, **options: Any) -> subprocess.Popen:
        """Start ``argv``; ``group``: in a process group of its own (ended with it);
        ``ends_last``: ended after the others (a dispatcher, after its workers)."""
        process = subprocess.Popen(list(argv), env=env, start_new_session=group, **options)
        self._started.insert(0 if ends_last else len(self._started), (process, group))
        return process

    def kill(self, process: subprocess.Popen) -> None:
        """SIGKILL ``process`` (and its process group, when it has one) and reap it."""
        group = next(g for p, g in self._started if p is process)
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL) if group else process.kill()
        process.wait(30)

    def close(self) -> None:
        for process, _ in reversed(self._started):
            if process.poll() is None:
                self.kill(process)
            for stream in (process.stdin, process.stdout):
                if stream:
                    stream.close()
        self._started = []


class Run:
    """The servers and ranks of one run of the example."""

    def __init__(self, args: argparse.Namespace, workdir: str, processes: Processes):
        self.args, self.workdir, self.processes = args, workdir, processes
        # The workers' token, the same for the dispatcher restarted.
        self.env = {**os.environ, worker_auth.ENV: worker_auth.new_token().decode()}
        self.env.pop(worker_auth.ENV_FILE, None)
        loopback = "lo" if "lo" in {name for _, name in socket.if_nameindex()} else "lo0"
        self.env.setdefault("GLOO_SOCKET_IFNAME", loopback)

    def server(self, command: str, *options: str) -> tuple[subprocess.Popen, str]:
        process = self.processes.start(
            [sys.executable, "-m", "clusterwire", command, "--quiet", *options], self.env,
            ends_last=command == "dispatcher", stdout=subprocess.PIPE, text=True)
        target = await_ready(process, 60)
        if target is None:
            raise RuntimeError(f"`clusterwire {command}` did not start (exit status "
                               f"{process.poll()})")
        return process, target

    def dispatcher(self, port: int) -> tuple[subprocess.Popen, str]:
        return self.server("dispatcher", "--port", str(port), "--bind-address", "127.0.0.1",
                           "--fault-tolerant-mode", "--work-dir",
                           os.path.join(self.workdir, "dispatcher"))

    def ranks(self, phase: str, world: int, target: str, dataset_id: str) -> Ranks:
        """Start ``world`` rank processes of ``phase``."""
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return Ranks(store, [self.processes.start(
            [sys.executable, os.path.abspath(__file__), "--phase", phase,
             "--rank", str(rank), "--store-port", str(store.port), "--target", target,
             "--dataset-id", dataset_id, "--checkpoint", self.checkpoint,
             "--result", self.result, "--protocol", self.args.protocol,
             "--steps-before-kill", str(self.args.steps_before_kill),
             "--steps-after-checkpoint", str(self.args.steps_after_checkpoint)],
            self.env, group=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for rank in range(world)])

    @property
    def checkpoint(self) -> str:
        return os.path.join(self.workdir, "checkpoint.pt")

    @property
    def result(self) -> str:
        return os.path.join(self.workdir, "resumed.json")


class Ranks:
    """The rank processes of one phase (and the TCPStore they meet at, served here), their
    output relayed to ours."""

    def __init__(self, store: dist.TCPStore, processes: list[subprocess.Popen]):
        self.store, self.processes = store, processes
        self._lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
        for rank, process in enumerate(processes):
            threading.Thread(target=self._relay, args=(rank, process), daemon=True).start()

    def _relay(self, rank: int, process: subprocess.Popen) -> None:
        for line in process.stdout:
            print(line, end="", flush=True)
            self._lines.put((rank, line))
        self._lines.put((rank, None))  # it exited

    def await_all(self, wanted: str | None, deadline: float) -> None:
        """Until every rank has printed a line holding ``wanted`` (None: exited with status
        0); RuntimeError if one exits before (or with another status), or at ``deadline``
        (``time.monotonic``)."""
        waiting = set(range(len(self.processes)))
        while waiting:
            try:
                rank, line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                what = f"said {wanted!r}" if wanted else "finished"
                raise RuntimeError(f"ranks {sorted(waiting)} had not {what} within "
                                   f"{PHASE_S:g} s") from None
            if line is None:
                code = self.processes[rank].wait(30)
                if wanted is not None or code != 0:
                    before = f" before saying {wanted!r}" if wanted else ""
                    raise RuntimeError(f"rank {rank} exited with status {code}{before}")
                waiting.discard(rank)
            elif wanted is not None and wanted in line:
                waiting.discard(rank)


def orchestrate(args: argparse.Namespace) -> int:
    features, labels = synthetic_task(args.samples)
    pipeline = data.Dataset.from_tensor_slices(
        (np.arange(args.samples), features, labels)).batch(BATCH)
    processes = Processes()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        with tempfile.TemporaryDirectory(prefix="elastic-resume-") as workdir:
            run = Run(args, workdir, processes)
            dispatcher, target = run.dispatcher(0)
            address = target.split("://", 1)[1]
            port = int(address.rsplit(":", 1)[1])
            transfer = [] if args.protocol == "grpc" else [
                "--data-transfer-protocol", args.protocol]
            for _ in range(DATA_WORKERS):
                run.server("worker", "--dispatcher-address", address, "--port", "0",
                           "--worker-address", "127.0.0.1:%port%",
                           "--heartbeat-interval-ms", "200", *transfer)
            dataset_id = data.register_dataset(target, pipeline)
            print(f"dispatcher {target} (fault-tolerant) and {DATA_WORKERS} workers up; "
                  f"{args.samples} "
                  f"samples in batches of {BATCH}, elements over {args.protocol}", flush=True)

            old = run.ranks("first", OLD_RANKS, target, dataset_id)
            old.await_all(PAST_CHECKPOINT, time.monotonic() + PHASE_S)
            for rank in old.processes:
                processes.kill(rank)
            processes.kill(dispatcher)
            print(f"SIGKILLed {OLD_RANKS} ranks (with their loader workers) and the "
                  "dispatcher", flush=True)
            run.dispatcher(port)
            print(f"dispatcher restarted at {target}; {NEW_RANKS} ranks x "
                  f"{NEW_LOADER_WORKERS} loader worker resume", flush=True)

            run.ranks("resumed", NEW_RANKS, target, dataset_id).await_all(
                None, time.monotonic() + PHASE_S)
            checkpoint = torch.load(run.checkpoint, weights_only=True)
            with open(run.result) as file:
                resumed = json.load(file)
            return verdict(args, checkpoint["trained"], resumed)
    except RuntimeError as err:
        print(f"verdict: FAILED: {err}", flush=True)
        return 1
    finally:
        processes.close()
        signal.signal(signal.SIGTERM, previous)


def verdict(args: argparse.Namespace, before: list[int], after: list[int]) -> int:
    """Print the verdict line: every sample of the epoch trained on once over the run."""
    counts = collections.Counter(before + after)
    missing = [i for i in range(args.samples) if i not in counts]
    twice = sorted(i for i, n in counts.items() if n > 1)
    unknown = sorted(i for i in counts if not 0 <= i < args.samples)
    reread = OLD_RANKS * args.steps_after_checkpoint * BATCH
    if missing or twice or unknown:
        print(f"verdict: FAILED: of {args.samples} samples, {len(missing)} never trained on "
              f"{missing[:10]}, {len(twice)} more than once {twice[:10]}, {len(unknown)} "
              f"not of the epoch {unknown[:10]} ({len(before)} before the checkpoint, "
              f"{len(after)} after the resume)", flush=True)
        return 1
    print(f"verdict: OK: every one of the {args.samples} samples trained on exactly once: "
          f"{len(before)} by {OLD_RANKS} ranks x {OLD_LOADER_WORKERS} loader workers up to "
          f"the checkpoint, {len(after)} by {NEW_RANKS} ranks x {NEW_LOADER_WORKERS} loader "
          f"worker after the SIGKILLs and the dispatcher's restart (the {reread} the killed "
          "ranks trained on after the checkpoint were trained on again)", flush=True)
    return 0


def main() -> int:
    protocols = get_plugin_manager().protocols()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=MIN_SAMPLES,
                        help=f"samples in the epoch (at least {MIN_SAMPLES}, the default)")
    parser.add_argument("--steps-before-kill", type=int, default=8,
                        help="steps the first run trains before its checkpoint (default 8)")
    parser.add_argument("--steps-after-checkpoint", type=int, default=3,
                        help="steps it trains after the checkpoint, before the SIGKILL "
                             "(default 3)")
    parser.add_argument("--protocol", choices=[p for p in ("grpc", "grpc+local")
                                               if p in protocols],
                        default="grpc+local" if "grpc+local" in protocols else "grpc",
                        help="how the workers send elements (default grpc+local where "
                             "available)")
    # A rank of the run (the run starts these processes itself).
    for name in ("--phase", "--target", "--dataset-id", "--checkpoint", "--result"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--rank", "--store-port"):
        parser.add_argument(name, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase is not None:
        torch.set_num_threads(1)  # a model this small: the cores go to the servers
        run = first_run if args.phase == "first" else resumed_run
        return run(args, args.rank)
    if args.samples < MIN_SAMPLES:
        parser.error(f"--samples must be at least {MIN_SAMPLES} ({MIN_SPLIT_BATCHES} batches of "
                     f"{BATCH} in each of the epoch's splits), got {args.samples}")
    first_steps = args.steps_before_kill + args.steps_after_checkpoint
    if min(args.steps_before_kill, args.steps_after_checkpoint) < 1 \
            or first_steps > MAX_FIRST_STEPS:
        parser.error(f"--steps-before-kill and --steps-after-checkpoint must be at least 1 "
                     f"and at most {MAX_FIRST_STEPS} together (the first run must not end a "
                     f"split), got {args.steps_before_kill} and "
                     f"{args.steps_after_checkpoint}")
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
