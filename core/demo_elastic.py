"""``clusterwire demo --elastic``: parameter-server training while the cluster changes shape.

The job of ``clusterwire demo`` (one ps task, workers pulling weights and pushing gradients
of a linear model), on a cluster whose tasks heartbeat each other
(``clusterwire.membership``): it starts with 2 workers; 2 more join a quarter of the way in
(``LocalCluster.add_tasks``: new processes, and a new membership version that spreads to
the running tasks); one of them is SIGKILLed a third of the way through its steps: the
ps's heartbeats mark it down, and it is taken out of the membership. The workers go
2 -> 4 -> 3, the ones left finish their steps, the loss still falls, and a watcher prints
each membership change as the ps sees it.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from clusterwire import errors
from clusterwire.demo import (
    LOSS_FACTOR,
    ps_init,
    ps_progress,
    ps_pull,
    say_verdict,
    training_failures,
    worker_train,
)
from clusterwire.local_cluster import LocalCluster
from clusterwire.session import Session

#: Workers the ps keeps step counts for (the demo peaks at 4).
_MAX_WORKERS = 8
_HEARTBEAT = {"membership_heartbeat_seconds": 0.25, "membership_timeout_seconds": 1.0}


_OUTPUT = threading.Lock()


def say(out: Any, line: str) -> None:
    """Write ``line`` to ``out`` in one piece: the watcher's thread and the training loop
    both report, and ``print`` writes a line and its newline separately (a line of one
    could end up in the middle of the other's)."""
    with _OUTPUT:
        out.write(line + "\n")
        out.flush()


class MembershipWatch:
    """Polls the ps's status and prints each new membership version (who joined and who
    left) as it happens; remembers the worker counts seen."""

    def __init__(self, session: Session, out: Any):
        self._session, self._out = session, out
        status = session.status()
        self.version = status["membership_version"]
        self._workers = _workers(status)
        self.counts = [len(self._workers)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._check()

    def _check(self) -> None:
        try:
            status = self._session.status(timeout=2)
        except errors.OpError:
            return
        if status["membership_version"] != self.version:
            workers = _workers(status)
            joined, left = sorted(workers - self._workers), sorted(self._workers - workers)
            say(self._out, f"  membership: version {self.version} -> "
                f"{status['membership_version']}"
                + (f"; joined {', '.join(joined)}" if joined else "")
                + (f"; left {', '.join(left)}" if left else "")
                + f"; {len(workers)} workers")
            self.version, self._workers = status["membership_version"], workers
            self.counts.append(len(workers))

    def stop(self) -> None:
        """Stop watching, after one last look (the final version is seen however the
        polls fell)."""
        self._stop.set()
        self._thread.join()
        self._check()


def _workers(status: dict[str, Any]) -> set[str]:
    cluster = status["cluster"]
    return {f"/job:worker/task:{i}" for i in cluster.task_indices("worker")}


def run_elastic_demo(protocol: str = "grpc", steps: int = 60, dim: int = 2048,
                     samples_per_worker: int = 4096, out=sys.stdout) -> int:
    """Train while the workers go 2 -> 4 -> 3 (see the module); print progress, each
    membership change and one verdict line; 0 if the loss fell ``LOSS_FACTOR``x, the
    workers went 2 -> 4 -> 3, every worker left ran its ``steps`` steps and every process
    but the killed one stopped cleanly, else 1."""
    started = time.perf_counter()
    cluster = LocalCluster({"ps": 1, "worker": 2}, protocol=protocol,
                           imports=["clusterwire.demo"], config=_HEARTBEAT)
    with cluster, Session(cluster.target("ps")) as session, \
            ThreadPoolExecutor(_MAX_WORKERS) as pool:
        say(out, f"cluster up in {time.perf_counter() - started:.2f} s ({protocol}), heartbeats "
                 f"every {_HEARTBEAT['membership_heartbeat_seconds']:g} s: "
                 f"{cluster.cluster_spec}")
        watch = MembershipWatch(session, out)
        say(out, f"  membership: starts at version {watch.version}" + (
            " (version 0 is the cluster each task was started with, every port 0; telling "
            "the tasks each other's bound ports made the next)" if watch.version else
            " (the cluster each task was started with)"))
        run = _ElasticRun(cluster, session, pool, steps, dim, samples_per_worker, out)
        while run.training():
            time.sleep(0.02)
            run.step()
        progress, weights = run.finish()
        watch.stop()
    survivors = [i for i in run.runs if i != run.victim]
    stopped = {f"/job:{job}/task:{i}": cluster.process(job, i).poll()
               for job, indices in (("ps", [0]), ("worker", survivors)) for i in indices}
    loss = progress["loss"]
    say(out, f"final loss {loss:.3e} (initial {run.initial_loss:.4f}); {progress['step']} steps "
             f"in {time.perf_counter() - started:.1f} s")
    return _verdict(run.initial_loss, loss, watch.counts, progress["steps_of"], survivors,
                    steps, weights, stopped, out)


class _ElasticRun:
    """The training of ``run_elastic_demo``: each worker's run (a call into its task) and
    the changes of shape the ps's progress triggers, one ``step`` per look at it."""

    victim = 2  # a worker that joined, killed a third of the way through its steps

    def __init__(self, cluster: LocalCluster, session: Session, pool: ThreadPoolExecutor,
                 steps: int, dim: int, samples_per_worker: int, out: Any):
        self._cluster, self._session, self._pool, self._out = cluster, session, pool, out
        self._steps, self._samples = steps, samples_per_worker
        self._rng = np.random.default_rng(0)
        self._true_weights = (self._rng.standard_normal(dim) / np.sqrt(dim)).astype(np.float32)
        session.call(ps_init, dim, _MAX_WORKERS)
        self._shards = [self._shard(), self._shard()]
        self.initial_loss = float(np.mean(self._shards[0][1] ** 2))
        self.runs: dict[int, Future] = {}
        self._shown, self._grown, self._killed = 0, False, False
        for index in (0, 1):
            self._launch(index)

    def _shard(self) -> tuple[np.ndarray, np.ndarray]:
        features = self._rng.standard_normal((self._samples, len(self._true_weights)),
                                             np.float32)
        return features, features @ self._true_weights

    def _launch(self, index: int) -> None:
        task = f"/job:worker/task:{index}"
        self._session.put("features", self._shards[index][0], task=task)
        self._session.put("labels", self._shards[index][1], task=task)
        self.runs[index] = self._pool.submit(
            self._session.call, worker_train, self._cluster.target("worker", index),
            self._steps, 0.4, index, task=task, timeout=600)

    def training(self) -> bool:
        """Whether a worker's run is still going."""
        return any(not run.done() for run in self.runs.values())

    def step(self) -> None:
        """Print the progress every 10 steps; grow the workers to 4 halfway, then kill the
        victim a third of the way through its own steps."""
        out, steps = self._out, self._steps
        progress = self._session.call(ps_progress)
        if progress["step"] >= self._shown + 10:
            self._shown = progress["step"]
            say(out, f"  step {self._shown:4d}  loss {progress['loss']:.3e}  steps per worker "
                     f"{progress['steps_of'][:len(self._shards)]}")
        if not self._grown and progress["step"] >= steps // 2:
            joined = self._cluster.add_tasks("worker", 2)
            say(out, f"  elastic: started {', '.join(f'/job:worker/task:{i}' for i in joined)}"
                     " and told the cluster")
            for index in joined:
                self._shards.append(self._shard())
                self._launch(index)
            self._grown = True
        if self._grown and not self._killed and \
                progress["steps_of"][self.victim] >= steps // 3:
            self._cluster.process("worker", self.victim).kill()
            say(out, f"  elastic: SIGKILLed /job:worker/task:{self.victim} at step "
                     f"{progress['step']}")
            _wait_down(self._session, f"/job:worker/task:{self.victim}")
            say(out, f"  membership: /job:worker/task:{self.victim} is down (no heartbeat for "
                     f"{_HEARTBEAT['membership_timeout_seconds']:g} s)")
            self._cluster.remove_task("worker", self.victim)
            self._killed = True

    def finish(self) -> tuple[dict[str, Any], Any]:
        """The runs' ends (the killed worker's error reported), then the ps's final progress
        and weights."""
        try:
            self.runs[self.victim].result()
        except errors.OpError as err:
            say(self._out, f"  elastic: the killed worker's run ended with {type(err).__name__}")
        for index, run in self.runs.items():
            if index != self.victim:
                run.result()
        return self._session.call(ps_progress), self._session.call(ps_pull)


def _wait_down(session: Session, task: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(p["task"] == task and p["down"] for p in session.status()["peers"]):
        if time.monotonic() > deadline:
            raise errors.DeadlineExceededError(f"{task} was not marked down in {timeout} s.")
        time.sleep(0.05)


def _verdict(initial_loss: float, loss: float, counts: list[int], steps_of: list[int],
             survivors: list[int], steps: int, weights: np.ndarray,
             stopped: dict[str, int | None], out: Any) -> int:
    factor, failures = training_failures(initial_loss, loss, steps, weights, stopped)
    if [c for i, c in enumerate(counts) if i == 0 or c != counts[i - 1]] != [2, 4, 3]:
        failures.append(f"the workers went {' -> '.join(map(str, counts))}, not 2 -> 4 -> 3")
    short = {i: steps_of[i] for i in survivors if steps_of[i] != steps}
    if short:
        failures.append(f"workers ran fewer than {steps} steps: {short}")
    return say_verdict(failures, f"the loss fell {factor:.3g}x (>= {LOSS_FACTOR}x) while the "
                       f"workers went 2 -> 4 -> 3; each of the {len(survivors)} left ran its "
                       f"{steps} steps; all {len(stopped)} processes left stopped cleanly", out)
