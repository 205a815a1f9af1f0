"""Train a small PyTorch model from Parquet files, read through clusterwire's data service.

    pip install torch --index-url https://download.pytorch.org/whl/cpu   # the CPU build
    pip install 'clusterwire[torch,parquet]'
    python examples/train_torch_parquet.py [--epochs 5]

Writes a synthetic classification set (numpy, seeded) as 4 Parquet files in a temporary
folder: an ``index`` column, feature columns ``f0``.. and a ``label`` column, row groups of
1024 rows. A dispatcher and two workers start as processes of their own on 127.0.0.1 (in
production: ``clusterwire dispatcher`` and ``clusterwire worker --readable-dir DIR`` on the
input hosts), allowed to read that folder only (``readable_dirs``) and serving elements over
``grpc+local`` (shared memory) besides grpc. The workers read the files with
``Dataset.from_parquet(paths, batch_rows=256)``, a row group per split; a ``DataLoader``
with two loader workers reads the batches (dicts column -> tensor) through ``ServiceDataset``
in ``distributed_epoch`` mode, and a 2-layer MLP learns the labels on the CPU.

Prints each epoch's loss, accuracy and read rate, then one verdict line; the exit status is 1
when the loss did not fall 5x, an epoch lost or repeated a row, or a server did not stop
cleanly.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from _training import BATCH, CLASSES, FEATURES, SAMPLES, synthetic_task, verdict
from torch.utils.data import DataLoader

from clusterwire import data
from clusterwire.data.torch_dataset import ServiceDataset
from clusterwire.plugins import get_plugin_manager

FILES, ROW_GROUP_ROWS = 4, 1024
FEATURE_COLUMNS = [f"f{k}" for k in range(FEATURES)]


def write_parquet(folder: str, features: np.ndarray, labels: np.ndarray) -> list[str]:
    """The set as ``FILES`` Parquet files (a column per feature); their paths."""
    paths = []
    for part, rows in enumerate(np.array_split(np.arange(SAMPLES), FILES)):
        columns = {"index": rows, "label": labels[rows]}
        columns.update({name: features[rows, k] for k, name in enumerate(FEATURE_COLUMNS)})
        paths.append(os.path.join(folder, f"train-{part}.parquet"))
        pq.write_table(pa.table(columns), paths[-1], row_group_size=ROW_GROUP_ROWS)
    return paths


def evaluate(model: torch.nn.Module, features: np.ndarray, labels: np.ndarray
             ) -> tuple[float, float]:
    """Loss and accuracy over the whole set."""
    with torch.no_grad():
        logits = model(torch.from_numpy(features))
        targets = torch.from_numpy(labels)
        loss = torch.nn.functional.cross_entropy(logits, targets).item()
        return loss, (logits.argmax(1) == targets).float().mean().item()


def train(target: str, transfer: str | None, paths: list[str], epochs: int,
          features: np.ndarray, labels: np.ndarray, model: torch.nn.Module) -> list[str]:
    """Train ``epochs`` epochs on the Parquet rows the service reads; what went wrong."""
    pipeline = data.Dataset.from_parquet(paths, columns=["index", *FEATURE_COLUMNS, "label"],
                                         batch_rows=BATCH)
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
        for batch in loader:
            x = torch.stack([batch[name] for name in FEATURE_COLUMNS], dim=1)
            loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen.append(batch["index"])
            losses.append(loss.item())
        elapsed = time.perf_counter() - started
        got = torch.cat(seen).sort().values if seen else torch.empty(0)
        if not torch.equal(got, torch.arange(SAMPLES)):
            problems.append(f"epoch {epoch} read {len(got)} rows, "
                            f"{len(torch.unique(got))} distinct, of {SAMPLES}")
        _, accuracy = evaluate(model, features, labels)
        print(f"epoch {epoch}/{epochs}: {len(losses)} steps, mean loss {np.mean(losses):.3f}, "
              f"accuracy {accuracy:.3f}; {len(got) / elapsed:,.0f} rows/s read from Parquet "
              f"and trained", flush=True)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    # A model this small trains fastest on one thread, and the servers and loader workers
    # need the other cores.
    torch.set_num_threads(1)
    features, labels = synthetic_task()
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, CLASSES))
    initial, _ = evaluate(model, features, labels)
    transfer = "grpc+local" if "grpc+local" in get_plugin_manager().protocols() else None
    with tempfile.TemporaryDirectory() as folder:
        paths = write_parquet(folder, features, labels)
        print(f"{SAMPLES} rows in {FILES} Parquet files, {SAMPLES // ROW_GROUP_ROWS} row groups, "
              f"in {folder}", flush=True)
        servers = data.LocalDataService(2, transfer, readable_dirs=[folder])
        try:
            print(f"dispatcher {servers.target} and 2 workers up, reading {folder} only; "
                  f"elements over {transfer or 'grpc'}", flush=True)
            problems = train(servers.target, transfer, paths, args.epochs, features, labels,
                             model)
        finally:
            codes = servers.stop()
    final, accuracy = evaluate(model, features, labels)
    return verdict(initial, final, accuracy, args.epochs, codes, problems)


if __name__ == "__main__":
    raise SystemExit(main())
