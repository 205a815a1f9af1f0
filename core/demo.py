"""``clusterwire demo``: parameter-server training on a local multi-process cluster.

One ps task holds the weights of a linear model; each worker task holds a
shard of the data in its tensor store, pulls the weights from the ps,
computes the gradient of the squared loss with numpy and pushes it back.
Everything crosses real processes and the chosen protocol.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from clusterwire.errors import UnavailableError
from clusterwire.functions import remote
from clusterwire.local_cluster import LocalCluster
from clusterwire.session import Session

PS = "/job:ps/task:0"
#: The loss must fall by at least this factor for the demo to pass.
LOSS_FACTOR = 100
_lock = threading.Lock()
_state: dict[str, Any] = {}


@remote
def ps_init(dim: int, workers: int) -> None:
    """Reset the parameter server: zero weights, no steps, nothing moved."""
    with _lock:
        _state.update(weights=np.zeros(dim, np.float32), step=0, loss=float("nan"),
                      steps_of=[0] * workers, moved=0)


@remote
def ps_pull() -> np.ndarray:
    """The current weights (counted as moved)."""
    with _lock:
        _state["moved"] += _state["weights"].nbytes
        return _state["weights"]


@remote
def ps_push(gradient: np.ndarray, loss: float, learning_rate: float, worker: int) -> int:
    """Apply one worker's gradient (counted as moved); returns the global step."""
    with _lock:
        _state["weights"] = _state["weights"] - learning_rate * gradient
        _state["step"] += 1
        _state["steps_of"][worker] += 1
        _state["loss"] = loss
        _state["moved"] += gradient.nbytes
        return _state["step"]


@remote
def ps_progress() -> dict[str, Any]:
    """Global step, last loss, each worker's steps and the bytes pulled and pushed."""
    with _lock:
        return {"step": _state["step"], "loss": _state["loss"],
                "steps_of": list(_state["steps_of"]), "moved": _state["moved"]}


@remote
def worker_train(own_target: str, steps: int, learning_rate: float, worker: int) -> np.ndarray:
    """Run ``steps`` pull/compute/push rounds on this worker's shard; each one's seconds."""
    times = np.empty(steps)
    with Session(own_target) as session:
        features, labels = session.get("features"), session.get("labels")
        for step in range(steps):
            started = time.perf_counter()
            weights = session.call(ps_pull, task=PS)
            error = features @ weights - labels
            gradient = features.T @ error / len(labels)
            session.call(ps_push, gradient, float(np.mean(error ** 2)), learning_rate, worker,
                         task=PS)
            times[step] = time.perf_counter() - started
    return times


def run_demo(protocol: str = "grpc", steps: int = 60, workers: int = 2, dim: int = 2048,
             samples_per_worker: int = 6144, chaos: bool = False, out=sys.stdout) -> int:
    """Train on a local cluster of 1 ps + ``workers`` workers, ``steps`` steps each; print
    progress and one verdict line; 0 if the loss fell ``LOSS_FACTOR``x, every step ran and
    every process stopped cleanly, else 1.

    With ``chaos``, the last worker is SIGKILLed a third of the way through and restarted
    on the same port; its shard is sent again and it trains its remaining steps, while the
    ps keeps its state.
    """
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    true_weights = (rng.standard_normal(dim) / np.sqrt(dim)).astype(np.float32)
    shards = []
    for _ in range(workers):
        features = rng.standard_normal((samples_per_worker, dim), np.float32)
        shards.append((features, features @ true_weights))
    initial_loss = float(np.mean(shards[-1][1] ** 2))
    cluster = LocalCluster({"ps": 1, "worker": workers}, protocol=protocol,
                           imports=["clusterwire.demo"])
    with cluster:
        print(f"cluster up in {time.perf_counter() - started:.2f} s ({protocol}): "
              f"{cluster.cluster_spec}", file=out, flush=True)
        with Session(cluster.target("ps")) as session:
            session.call(ps_init, dim, workers)
            t0 = time.perf_counter()
            uploaded = sum(_send_shard(session, i, shards[i]) for i in range(workers))
            upload_s = time.perf_counter() - t0
            print(f"shards uploaded: {uploaded / 1e6:.1f} MB in {upload_s:.2f} s = "
                  f"{uploaded / upload_s / 1e6:.1f} MB/s", file=out, flush=True)
            t0 = time.perf_counter()
            step_times = _train(session, cluster, steps, chaos, shards, out)
            train_s = time.perf_counter() - t0
            progress = session.call(ps_progress)
            weights = session.call(ps_pull)
    stopped = {f"/job:{job}/task:{i}": cluster.process(job, i).poll()
               for job, count in (("ps", 1), ("worker", workers)) for i in range(count)}
    step, loss = progress["step"], progress["loss"]
    median, p90 = np.percentile(step_times, [50, 90]) * 1e3
    # A step moves dim float32s each way: its time is round trips, not bandwidth.
    print(f"training: {step} steps in {train_s:.2f} s = {step / train_s:.1f} steps/s over "
          f"{workers} workers; a step (pull {dim * 4 / 1e3:.1f} KB of weights, compute, push "
          f"the gradient) takes {median:.1f} ms median, {p90:.1f} ms p90", file=out, flush=True)
    print(f"final loss {loss:.3e} (initial {initial_loss:.4f})", file=out, flush=True)
    return _verdict(initial_loss, loss, step, steps, workers, weights, stopped, out)


def _verdict(initial_loss: float, loss: float, step: int, steps: int, workers: int,
             weights: np.ndarray, stopped: dict[str, int | None], out) -> int:
    """Print one line saying whether the job did what it should; its exit status."""
    total = steps * workers
    factor, failures = training_failures(initial_loss, loss, steps, weights, stopped)
    if step != total:
        failures.append(f"{step} of {total} steps ran")
    return say_verdict(failures, f"the loss fell {factor:.3g}x (>= {LOSS_FACTOR}x), "
                       f"{step}/{total} steps ran, all {len(stopped)} processes stopped "
                       "cleanly", out)


def training_failures(initial_loss: float, loss: float, steps: int, weights: np.ndarray,
                      stopped: dict[str, int | None]) -> tuple[float, list[str]]:
    """How much the loss fell, and what every demo's run must not have: a loss that did not
    fall ``LOSS_FACTOR``x (one that fell, but too little in ``steps`` steps a worker, says
    to raise ``--steps``), weights not finite, a process that did not stop cleanly."""
    factor = initial_loss / loss if loss > 0 else float("inf")
    failures = []
    if not (np.isfinite(loss) and factor >= LOSS_FACTOR):
        failure = f"the loss fell {factor:.3g}x, not the {LOSS_FACTOR}x expected"
        # The loss a push reports is of the weights it pulled, on its worker's shard: after
        # one step it is about the initial loss; a loss that diverged has grown far more.
        if np.isfinite(loss) and factor > 0.5:
            rate = f"; about {_steps_for(factor, steps)} at this rate" if factor > 1.1 else ""
            failure += (f", too few steps for it: raise --steps (this run: {steps} a "
                        f"worker{rate})")
        failures.append(failure)
    if not np.isfinite(weights).all():
        failures.append("the weights are not finite")
    unclean = {task: code for task, code in stopped.items() if code != 0}
    if unclean:
        failures.append(f"processes did not stop cleanly (exit status): {unclean}")
    return factor, failures


def _steps_for(factor: float, steps: int) -> int:
    """Steps a worker that would make the loss fall ``LOSS_FACTOR``x if it kept falling as
    it did (``factor``x in ``steps``), with a fifth more as a margin."""
    return math.ceil(1.2 * steps * math.log(LOSS_FACTOR) / math.log(factor))


def say_verdict(failures: list[str], ok: str, out) -> int:
    """Print the verdict line (FAILED with the ``failures``, or OK with ``ok``); the exit
    status."""
    if failures:
        print(f"verdict: FAILED: {'; '.join(failures)}", file=out, flush=True)
        return 1
    print(f"verdict: OK: {ok}", file=out, flush=True)
    return 0


def _send_shard(session: Session, index: int, shard: tuple[np.ndarray, np.ndarray]) -> int:
    task = f"/job:worker/task:{index}"
    session.put("features", shard[0], task=task)
    session.put("labels", shard[1], task=task)
    return shard[0].nbytes + shard[1].nbytes


def _train(session: Session, cluster, steps: int, chaos: bool, shards, out) -> np.ndarray:
    """Run every worker's training loop, printing progress when the step moves; with
    ``chaos``, kill the last worker a third of the way in, restart it and let it train its
    remaining steps. Returns the seconds of every step of the runs that finished."""
    workers = len(shards)
    total = steps * workers

    def launch(pool: ThreadPoolExecutor, index: int, count: int) -> Future:
        return pool.submit(session.call, worker_train, cluster.target("worker", index), count,
                           0.4, index, task=f"/job:worker/task:{index}", timeout=600)

    times = []
    with ThreadPoolExecutor(workers) as pool:
        runs = {i: launch(pool, i, steps) for i in range(workers)}
        victim = workers - 1 if chaos else None
        shown = 0
        while runs:
            # Poll often while the chaos kill is pending, so it lands mid-run.
            done, _ = wait(list(runs.values()), timeout=0.05 if victim is not None else 0.5,
                           return_when=FIRST_COMPLETED)
            progress = session.call(ps_progress)
            for index in [i for i, run in runs.items() if run in done]:
                run = runs.pop(index)
                if isinstance(run.exception(), UnavailableError) and index == victim:
                    left = steps - progress["steps_of"][index]
                    _send_shard(session, index, shards[index])
                    print(f"  chaos: worker {index} is back; its shard was sent again and it "
                          f"trains its remaining {left} of {steps} steps", file=out, flush=True)
                    runs[index] = launch(pool, index, left)
                    victim = None
                else:
                    times.append(run.result())
            if progress["step"] > shown:
                shown = progress["step"]
                print(f"  step {shown:4d}/{total}  loss {progress['loss']:.3e}", file=out,
                      flush=True)
            if victim is not None and victim in runs and progress["step"] >= total // 3:
                own = progress["steps_of"][victim]
                killed = time.perf_counter()
                cluster.restart("worker", victim)
                print(f"  chaos: worker {victim} killed (SIGKILL) at step {progress['step']}/"
                      f"{total}, after {own} of its {steps} steps; restarted on "
                      f"{cluster.target('worker', victim)} in "
                      f"{time.perf_counter() - killed:.2f} s with an empty store; the ps kept "
                      f"its weights and step", file=out, flush=True)
    return np.concatenate(times)
