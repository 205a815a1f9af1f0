"""What the training examples share: the synthetic task and the verdict."""

from __future__ import annotations

import numpy as np

SAMPLES, FEATURES, CLASSES, BATCH = 16384, 32, 4, 256
#: The loss must fall by at least this factor for the run to pass.
LOSS_FACTOR = 5


def synthetic_task(samples: int = SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """``samples`` features and the labels a random linear teacher gives them (seeded)."""
    rng = np.random.default_rng(0)
    features = rng.standard_normal((samples, FEATURES), np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES), np.float32)
    return features, np.argmax(features @ teacher, axis=1)


def verdict(initial: float, final: float, accuracy: float, epochs: int,
            codes: list[int | None], problems: list[str]) -> int:
    """Print the run's verdict line (what failed, or what it showed); the exit status."""
    factor = initial / final if final > 0 else float("inf")
    if not factor >= LOSS_FACTOR:
        problems.append(f"the loss fell {factor:.3g}x, not the {LOSS_FACTOR}x expected")
    if any(code != 0 for code in codes):
        problems.append(f"servers did not stop cleanly (exit statuses {codes})")
    if problems:
        print(f"verdict: FAILED: {'; '.join(problems)}", flush=True)
        return 1
    print(f"verdict: OK: loss {initial:.3f} -> {final:.3f} ({factor:.3g}x, >= {LOSS_FACTOR}x), "
          f"accuracy {accuracy:.3f}, every sample once in each of {epochs} epochs, "
          f"{len(codes)} servers stopped cleanly", flush=True)
    return 0
