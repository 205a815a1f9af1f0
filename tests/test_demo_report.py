"""What ``clusterwire demo`` reports: the training as step times (a step moves 8 KB each way:
its time is round trips), and a verdict that says to raise --steps when too few ran."""

from __future__ import annotations

import io
import re

import numpy as np

from clusterwire import demo

_TRAINING = re.compile(
    r"training: (\d+) steps in ([\d.]+) s = ([\d.]+) steps/s over 2 workers; a step \(pull "
    r"8\.2 KB of weights, compute, push the gradient\) takes ([\d.]+) ms median, "
    r"([\d.]+) ms p90")


def _run(steps: int) -> tuple[int, list[str]]:
    out = io.StringIO()
    status = demo.run_demo(steps=steps, out=out)
    return status, out.getvalue().splitlines()


def test_the_training_line_gives_step_times_not_megabytes_per_second():
    status, lines = _run(20)
    assert status == 0, lines
    training = next(line for line in lines if line.startswith("training:"))
    assert "MB" not in training
    match = _TRAINING.fullmatch(training)
    assert match, training
    steps, seconds, rate, median, p90 = (float(group) for group in match.groups())
    assert steps == 40
    assert abs(rate - steps / seconds) <= 0.05 * rate + 0.1
    # Each worker runs its 20 steps one after another, within the training window.
    assert 0 < median <= p90 and 20 * median / 1e3 <= seconds * 1.05


def test_too_few_steps_fail_with_raise_steps_and_the_steps_named_are_enough():
    status, lines = _run(2)
    assert status == 1
    verdict = re.fullmatch(
        r"verdict: FAILED: the loss fell [\d.]+x, not the 100x expected, too few steps for "
        r"it: raise --steps \(this run: 2 a worker; about (\d+) at this rate\)", lines[-1])
    assert verdict, lines[-1]
    enough = int(verdict[1])
    assert 2 < enough <= 60
    status, lines = _run(enough)
    assert status == 0 and lines[-1].startswith("verdict: OK: the loss fell"), lines[-1]


def test_a_loss_that_grew_or_is_not_finite_does_not_blame_the_steps():
    stopped = {"/job:ps/task:0": 0}
    for loss in (1e3, float("nan"), float("inf")):
        _, failures = demo.training_failures(1.0, loss, 60, np.zeros(3), stopped)
        assert len(failures) == 1 and "--steps" not in failures[0], failures
    _, failures = demo.training_failures(1.0, 1.0, 1, np.zeros(3), stopped)
    assert failures == ["the loss fell 1x, not the 100x expected, too few steps for it: "
                        "raise --steps (this run: 1 a worker)"]
