"""examples/elastic_resume_torch.py (issue 31) runs to its OK verdict: 2 ranks x 2 loader
workers checkpoint and are SIGKILLed, the fault-tolerant dispatcher is SIGKILLed and
restarted, 3 ranks x 1 loader worker resume, and every sample of the epoch is trained on
once over the run. Its verdict fails a run that lost or repeated a sample."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys

import cw_install_hints as install
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
SCRIPT = os.path.join(EXAMPLES, "elastic_resume_torch.py")
#: The run takes about 40 s here; a busy machine gets a wide margin.
DEADLINE_S = 300

pytestmark = pytest.mark.timeout(DEADLINE_S + 120)


@pytest.fixture(scope="module", autouse=True)
def _torch():
    for library in ("torch", "torchdata"):
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"{library} is not installed ({install.TORCH})")


def left_running(port: str) -> list[str]:
    """The command lines of processes still running that the run started: its ranks and
    their loader workers (``--target`` the dispatcher), its workers and its dispatcher."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                argv = file.read().decode(errors="replace").split("\0")
        except OSError:  # ended meanwhile
            continue
        line = " ".join(argv)
        if f"127.0.0.1:{port}" in line or ("dispatcher" in argv and f"--port {port}" in line):
            found.append(line)
    return found


def example_module():
    """The example imported (its helpers import ``_training`` from its folder)."""
    sys.path.insert(0, EXAMPLES)
    try:
        spec = importlib.util.spec_from_file_location("elastic_resume_torch", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(EXAMPLES)


def test_the_example_resumes_on_another_world_size_with_every_sample_once():
    process = subprocess.Popen([sys.executable, SCRIPT], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        process.terminate()  # the example ends the processes it started on SIGTERM
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        pytest.fail(f"the example did not finish within {DEADLINE_S} s:\n{out}\n{err[-3000:]}")
    assert process.returncode == 0, out + err[-3000:]
    lines = out.splitlines()
    assert lines[-1] == (
        "verdict: OK: every one of the 16384 samples trained on exactly once: 256 by 2 ranks "
        "x 2 loader workers up to the checkpoint, 16128 by 3 ranks x 1 loader worker after "
        "the SIGKILLs and the dispatcher's restart (the 96 the killed ranks trained on "
        "after the checkpoint were trained on again)"), out
    events = [line for line in lines if not line.startswith("rank ")]
    assert events[1] == ("SIGKILLed 2 ranks (with their loader workers) and the dispatcher")
    address = re.match(r"dispatcher (grpc://127\.0\.0\.1:(\d+)) \(fault-tolerant\)", events[0])
    assert address and events[2].startswith(f"dispatcher restarted at {address[1]};"), events
    assert left_running(address[2]) == []
    checkpoints = [line for line in lines if "checkpoint at step 8" in line]
    past = [line for line in lines if "step 11, past the checkpoint" in line]
    assert len(checkpoints) == len(past) == 2, out
    resumed = [re.match(r"rank (\d): resumed, (\d+) batches", line) for line in lines]
    shares = {int(m[1]): int(m[2]) for m in resumed if m}
    assert sorted(shares) == [0, 1, 2] and sum(shares.values()) == 16128 // 16, out


def test_options_that_would_let_a_loader_worker_starve_are_refused():
    """The first run's in-order loaders need every split to outlast it (see the example)."""
    for options, message in (
            (["--samples", "16000"], "--samples must be at least 16384 (64 batches of 16"),
            (["--steps-before-kill", "30", "--steps-after-checkpoint", "3"],
             "at most 32 together (the first run must not end a split), got 30 and 3"),
            (["--steps-after-checkpoint", "0"], "must be at least 1")):
        done = subprocess.run([sys.executable, SCRIPT, *options], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_verdict_fails_a_lost_or_repeated_sample(capsys):
    module = example_module()
    args = argparse.Namespace(samples=10, steps_after_checkpoint=1)
    assert module.verdict(args, [0, 1, 2], list(range(3, 10))) == 0
    assert capsys.readouterr().out.startswith("verdict: OK: every one of the 10 samples")
    assert module.verdict(args, [0, 1, 2, 3], list(range(3, 9)) + [12]) == 1
    assert capsys.readouterr().out == (
        "verdict: FAILED: of 10 samples, 1 never trained on [9], 1 more than once [3], 1 not "
        "of the epoch [12] (4 before the checkpoint, 7 after the resume)\n")
