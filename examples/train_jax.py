"""Train a small JAX model on batches from clusterwire's data service.

    pip install 'clusterwire[jax]'
    python examples/train_jax.py [--epochs 5]

A dispatcher and two workers start as processes of their own on 127.0.0.1 (in production:
``clusterwire dispatcher`` and ``clusterwire worker`` on the input hosts), the workers serving
elements over ``grpc+local`` (shared memory) besides grpc. The workers slice a synthetic
classification set (made with numpy, seeded) into batches of 256; each epoch a
``JaxIterator`` reads them in ``distributed_epoch`` mode as ``jax.Array``s on the default
device, two batches placed ahead of the step, and a 2-layer MLP written with ``jax.numpy``
learns the labels by plain SGD (``jax.grad``).

Prints each epoch's loss, accuracy and read rate, then one verdict line; the exit status is 1
when the loss did not fall 5x, an epoch lost or repeated a sample, or a server did not stop
cleanly.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from _training import BATCH, CLASSES, FEATURES, SAMPLES, synthetic_task, verdict

from clusterwire import data
from clusterwire.data.jax_iterator import JaxIterator
from clusterwire.plugins import get_plugin_manager

LEARNING_RATE = 0.5


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    """A 2-layer MLP's weights (He-initialised) and zero biases."""
    first, second = jax.random.split(key)
    return {"w1": jax.random.normal(first, (FEATURES, 64)) * np.sqrt(2 / FEATURES),
            "b1": jnp.zeros(64),
            "w2": jax.random.normal(second, (64, CLASSES)) * np.sqrt(2 / 64),
            "b2": jnp.zeros(CLASSES)}


def logits(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy of the labels ``y``."""
    log_probs = jax.nn.log_softmax(logits(params, x))
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


@jax.jit
def sgd_step(params: dict[str, jax.Array], x: jax.Array, y: jax.Array
             ) -> tuple[dict[str, jax.Array], jax.Array]:
    """One plain SGD step; the new weights and the batch's loss."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree_util.tree_map(lambda w, g: w - LEARNING_RATE * g, params, grads), loss


def evaluate(params: dict[str, jax.Array], features: np.ndarray, labels: np.ndarray
             ) -> tuple[float, float]:
    """Loss and accuracy over the whole set."""
    x, y = jnp.asarray(features), jnp.asarray(labels)
    accuracy = jnp.mean(jnp.argmax(logits(params, x), axis=1) == y)
    return float(loss_fn(params, x, y)), float(accuracy)


def train(target: str, transfer: str | None, epochs: int, features: np.ndarray,
          labels: np.ndarray, params: dict[str, jax.Array]
          ) -> tuple[dict[str, jax.Array], list[str]]:
    """Train ``epochs`` epochs on the service's batches; the weights and what went wrong."""
    pipeline = data.Dataset.from_tensor_slices(
        (np.arange(SAMPLES), features, labels)).batch(BATCH)
    dataset_id = data.register_dataset(target, pipeline)  # once; each epoch reads it anew
    problems = []
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        seen, losses = [], []
        with JaxIterator(dataset_id, "distributed_epoch", target,
                         data_transfer_protocol=transfer) as batches:
            for index, x, y in batches:
                params, loss = sgd_step(params, x, y)
                seen.append(index)
                losses.append(loss)
        elapsed = time.perf_counter() - started
        got = np.sort(np.concatenate([np.asarray(index) for index in seen])) if seen else []
        if not np.array_equal(got, np.arange(SAMPLES)):
            problems.append(f"epoch {epoch} read {len(got)} samples, "
                            f"{len(np.unique(got))} distinct, of {SAMPLES}")
        _, accuracy = evaluate(params, features, labels)
        print(f"epoch {epoch}/{epochs}: {len(losses)} steps, mean loss "
              f"{float(jnp.mean(jnp.stack(losses))):.3f}, accuracy {accuracy:.3f}; "
              f"{len(seen) / elapsed:.0f} batches/s = {len(got) / elapsed:,.0f} samples/s read "
              "and trained", flush=True)
    return params, problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    features, labels = synthetic_task()
    params = init_params(jax.random.key(0))
    initial, _ = evaluate(params, features, labels)
    transfer = "grpc+local" if "grpc+local" in get_plugin_manager().protocols() else None
    started = time.perf_counter()
    servers = data.LocalDataService(2, transfer)
    try:
        print(f"dispatcher {servers.target} and 2 workers up in "
              f"{time.perf_counter() - started:.2f} s; elements over {transfer or 'grpc'} to "
              f"{jax.devices()[0]}", flush=True)
        params, problems = train(servers.target, transfer, args.epochs, features, labels,
                                 params)
    finally:
        codes = servers.stop()
    final, accuracy = evaluate(params, features, labels)
    return verdict(initial, final, accuracy, args.epochs, codes, problems)


if __name__ == "__main__":
    raise SystemExit(main())
