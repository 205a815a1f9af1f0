"""Train a small PyTorch model on batches from clusterwire's data service.

    pip install torch --index-url https://download.pytorch.org/whl/cpu   # the CPU build
    pip install 'clusterwire[torch]'
    python examples/train_torch.py [--epochs 5]

PyTorch's CPU build (about 190 MB) is all this needs: a plain ``pip install torch`` on Linux
takes a CUDA build of several GB.

A dispatcher and two workers start as processes of their own on 127.0.0.1 (in production:
``clusterwire dispatcher`` and ``clusterwire worker`` on the input hosts), the workers serving
elements over ``grpc+local`` (shared memory) besides grpc. The workers slice a synthetic
classification set (made with numpy, seeded) into batches of 256; a ``DataLoader`` with two
loader workers reads them through ``ServiceDataset`` in ``distributed_epoch`` mode, each loader
worker a consumer of the epoch's job, and a 2-layer MLP learns the labels on the CPU.

Prints each epoch's loss, accuracy and read rate, then one verdict line; the exit status is 1
when the loss did not fall 5x, an epoch lost or repeated a sample, or a server did not stop
cleanly.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from _training import BATCH, CLASSES, FEATURES, SAMPLES, synthetic_task, verdict
from torch.utils.data import DataLoader

from clusterwire import data
from clusterwire.data.torch_dataset import ServiceDataset
from clusterwire.plugins import get_plugin_manager


def evaluate(model: torch.nn.Module, features: np.ndarray, labels: np.ndarray
             ) -> tuple[float, float]:
    """Loss and accuracy over the whole set."""
    with torch.no_grad():
        logits = model(torch.from_numpy(features))
        targets = torch.from_numpy(labels)
        loss = torch.nn.functional.cross_entropy(logits, targets).item()
        return loss, (logits.argmax(1) == targets).float().mean().item()


def train(target: str, transfer: str | None, epochs: int, features: np.ndarray,
          labels: np.ndarray, model: torch.nn.Module) -> list[str]:
    """Train ``epochs`` epochs on the service's batches; what went wrong (nothing: [])."""
    pipeline = data.Dataset.from_tensor_slices(
        (np.arange(SAMPLES), features, labels)).batch(BATCH)
    # This process only builds the ServiceDataset (its loader workers register and read), so
    # the DataLoader may fork them.
    dataset = ServiceDataset(pipeline, "distributed_epoch", target,
                             data_transfer_protocol=transfer)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, in_order=False,
                        persistent_workers=True, timeout=60)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    problems = []
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        seen, losses = [], []
        for index, x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen.append(index)
            losses.append(loss.item())
        elapsed = time.perf_counter() - started
        got = torch.cat(seen).sort().values if seen else torch.empty(0)
        if not torch.equal(got, torch.arange(SAMPLES)):
            problems.append(f"epoch {epoch} read {len(got)} samples, "
                            f"{len(torch.unique(got))} distinct, of {SAMPLES}")
        _, accuracy = evaluate(model, features, labels)
        print(f"epoch {epoch}/{epochs}: {len(losses)} steps, mean loss {np.mean(losses):.3f}, "
              f"accuracy {accuracy:.3f}; {len(seen) / elapsed:.0f} batches/s = "
              f"{len(got) / elapsed:,.0f} samples/s read and trained", flush=True)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    # A model this small trains fastest on one thread (more wait on each other for
    # microseconds of work), and the servers and loader workers need the other cores.
    torch.set_num_threads(1)
    features, labels = synthetic_task()
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, CLASSES))
    initial, _ = evaluate(model, features, labels)
    transfer = "grpc+local" if "grpc+local" in get_plugin_manager().protocols() else None
    started = time.perf_counter()
    servers = data.LocalDataService(2, transfer)
    try:
        print(f"dispatcher {servers.target} and 2 workers up in "
              f"{time.perf_counter() - started:.2f} s; elements over {transfer or 'grpc'}",
              flush=True)
        problems = train(servers.target, transfer, args.epochs, features, labels, model)
    finally:
        codes = servers.stop()
    final, accuracy = evaluate(model, features, labels)
    return verdict(initial, final, accuracy, args.epochs, codes, problems)


if __name__ == "__main__":
    raise SystemExit(main())
