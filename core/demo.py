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
from concurrent.futures import ThreadPoolExecutor

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
             samples_per_worker: int = 6144, out=sys.stdout) -> int:
    """Train on a local cluster of 1 ps + ``workers`` workers; 0 if the loss fell 100x."""
    from clusterwire.local_cluster import LocalCluster

    started = time.perf_counter()
    rng = np.random.default_rng(0)
    true_weights = (rng.standard_normal(dim) / np.sqrt(dim)).astype(np.float32)
    with LocalCluster({"ps": 1, "worker": workers}, protocol=protocol,
                      imports=["clusterwire.demo"]) as cluster:
        print(f"cluster up in {time.perf_counter() - started:.2f} s ({protocol}): "
              f"{cluster.cluster_spec}", file=out, flush=True)
        moved = 0
        with Session(cluster.target("ps")) as session:
            session.call(ps_init, dim)
            for index in range(workers):
                features = rng.standard_normal((samples_per_worker, dim), np.float32)
                labels = features @ true_weights
                task = f"/job:worker/task:{index}"
                session.put("features", features, task=task)
                session.put("labels", labels, task=task)
                moved += features.nbytes + labels.nbytes
            initial_loss = float(np.mean(labels ** 2))
            t0 = time.perf_counter()
            with ThreadPoolExecutor(workers) as pool:
                runs = [pool.submit(session.call, worker_train, cluster.target("worker", i),
                                    steps, 0.4, task=f"/job:worker/task:{i}", timeout=600)
                        for i in range(workers)]
                done = threading.Event()
                threading.Thread(target=lambda: ([r.result() for r in runs], done.set()),
                                 daemon=True).start()
                while not done.wait(0.5):
                    step, loss = session.call(ps_progress)
                    print(f"  step {step:4d}/{steps * workers}  loss {loss:.3e}",
                          file=out, flush=True)
                moved += sum(r.result() for r in runs)
            elapsed = time.perf_counter() - t0
            step, loss = session.call(ps_progress)
    print(f"final loss {loss:.3e} (initial {initial_loss:.4f}) after {step} steps; "
          f"{moved / 1e6:.1f} MB moved in {elapsed:.2f} s = {moved / elapsed / 1e6:.1f} MB/s",
          file=out, flush=True)
    return 0 if loss < initial_loss / 100 else 1
