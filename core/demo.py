"""``clusterwire demo``: parameter-server training on a local multi-process cluster.

One ps task holds the weights of a linear model; each worker task holds a
shard of the data in its tensor store, pulls the weights from the ps,
computes the gradient of the squared loss with numpy and pushes it back.
Everything crosses real processes and the chosen protocol.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np

from clusterwire.functions import remote
from clusterwire.session import Session

PS = "/job:ps/task:0"
_lock = threading.Lock()
_state: dict[str, object] = {}


@remote
def ps_init(dim: int) -> None:
    """Reset the parameter server's weights to zeros."""
    with _lock:
        _state.update(weights=np.zeros(dim, np.float32), step=0, loss=float("nan"))


@remote
def ps_pull() -> np.ndarray:
    """The current weights."""
    with _lock:
        return _state["weights"]


@remote
def ps_push(gradient: np.ndarray, loss: float, learning_rate: float) -> int:
    """Apply one worker's gradient; returns the global step."""
    with _lock:
        _state["weights"] = _state["weights"] - learning_rate * gradient
        _state["step"] += 1
        _state["loss"] = loss
        return _state["step"]


@remote
def ps_progress() -> tuple[int, float]:
    """(global step, last reported loss)."""
    with _lock:
        return _state["step"], _state["loss"]


@remote
def worker_train(own_target: str, steps: int, learning_rate: float) -> int:
    """Run ``steps`` pull/compute/push rounds on this worker's shard; returns bytes moved."""
    moved = 0
    with Session(own_target) as session:
        features, labels = session.get("features"), session.get("labels")
        for _ in range(steps):
            weights = session.call(ps_pull, task=PS)
            error = features @ weights - labels
            gradient = features.T @ error / len(labels)
            session.call(ps_push, gradient, float(np.mean(error ** 2)), learning_rate, task=PS)
            moved += weights.nbytes + gradient.nbytes
    return moved


def run_demo(protocol: str = "grpc", steps: int = 60, workers: int = 2, dim: int = 2048,
             samples_per_worker: int = 6144, chaos: bool = False, out=sys.stdout) -> int:
    """Train on a local cluster of 1 ps + ``workers`` workers; 0 if the loss fell 100x.

    With ``chaos``, the last worker is SIGKILLed a third of the way through and
    restarted on the same port; its shard is sent again and it trains again,
    while the ps keeps its state.
    """
    from clusterwire.local_cluster import LocalCluster

    started = time.perf_counter()
    rng = np.random.default_rng(0)
    true_weights = (rng.standard_normal(dim) / np.sqrt(dim)).astype(np.float32)
    shards = []
    for _ in range(workers):
        features = rng.standard_normal((samples_per_worker, dim), np.float32)
        shards.append((features, features @ true_weights))
    initial_loss = float(np.mean(shards[-1][1] ** 2))
    with LocalCluster({"ps": 1, "worker": workers}, protocol=protocol,
                      imports=["clusterwire.demo"]) as cluster:
        print(f"cluster up in {time.perf_counter() - started:.2f} s ({protocol}): "
              f"{cluster.cluster_spec}", file=out, flush=True)
        with Session(cluster.target("ps")) as session:
            session.call(ps_init, dim)
            moved = sum(_send_shard(session, i, shards[i]) for i in range(workers))
            t0 = time.perf_counter()
            moved += _train(session, cluster, steps, chaos, shards, out)
            elapsed = time.perf_counter() - t0
            step, loss = session.call(ps_progress)
            weights = session.call(ps_pull)
    print(f"final loss {loss:.3e} (initial {initial_loss:.4f}) after {step} steps; "
          f"{moved / 1e6:.1f} MB moved in {elapsed:.2f} s = {moved / elapsed / 1e6:.1f} MB/s",
          file=out, flush=True)
    intact = bool(np.isfinite(weights).all()) and step >= steps * workers
    if chaos:
        print(f"ps state intact: {intact} (step {step} >= {steps * workers}, weights finite)",
              file=out, flush=True)
    return 0 if intact and loss < initial_loss / 100 else 1


def _send_shard(session: Session, index: int, shard: tuple[np.ndarray, np.ndarray]) -> int:
    task = f"/job:worker/task:{index}"
    session.put("features", shard[0], task=task)
    session.put("labels", shard[1], task=task)
    return shard[0].nbytes + shard[1].nbytes


def _train(session: Session, cluster, steps: int, chaos: bool, shards, out) -> int:
    """Run every worker's training loop (restarting one mid-way with ``chaos``); bytes moved."""
    from clusterwire.errors import UnavailableError

    workers = len(shards)
    total = steps * workers
    moved = 0

    def launch(pool: ThreadPoolExecutor, index: int) -> Future:
        return pool.submit(session.call, worker_train, cluster.target("worker", index), steps,
                           0.4, task=f"/job:worker/task:{index}", timeout=600)

    with ThreadPoolExecutor(workers) as pool:
        runs = {i: launch(pool, i) for i in range(workers)}
        victim = workers - 1 if chaos else None
        last_report = 0.0
        while runs:
            # Poll often while the chaos kill is pending, so it lands mid-run.
            done, _ = wait(list(runs.values()), timeout=0.05 if victim is not None else 0.5,
                           return_when=FIRST_COMPLETED)
            for index in [i for i, run in runs.items() if run in done]:
                run = runs.pop(index)
                if isinstance(run.exception(), UnavailableError) and index == victim:
                    moved += _send_shard(session, index, shards[index])
                    runs[index] = launch(pool, index)  # the restarted worker trains again
                    victim = None
                else:
                    moved += run.result()
            step, loss = session.call(ps_progress)
            if done or time.monotonic() - last_report >= 0.5:
                last_report = time.monotonic()
                print(f"  step {step:4d}/{total}  loss {loss:.3e}", file=out, flush=True)
            if victim is not None and step >= total // 3 and victim in runs:
                cluster.restart("worker", victim)
                print(f"  chaos: worker {victim} killed (SIGKILL) at step {step} and restarted "
                      "on the same port", file=out, flush=True)
    return moved
