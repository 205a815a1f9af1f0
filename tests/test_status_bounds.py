"""``clusterwire status --all`` against a target listing more tasks than a cluster may have
(issue 29): only membership's MAX_TASKS are asked and printed, and the command says how many
it left out."""

from __future__ import annotations

import json
import time

from test_terminal_output import clusterwire, hostile_server

from clusterwire.membership import MAX_TASKS


def test_status_all_prints_at_most_max_tasks_and_says_how_many_it_left_out(tmp_path):
    """The hostile target lists 20,003 tasks (3 of its own and 20,000 invented addresses);
    each forwarded status fails at once. The output has the first 4,096 tasks in the
    cluster's order, stderr names the 15,907 left out, and the exit status is 1."""
    listed = [f"127.0.0.1:{20000 + i % 40000}" for i in range(20_000)]
    with hostile_server("task", tmp_path, listed) as address:
        started = time.monotonic()
        result = clusterwire("status", "--all", "--json", f"grpc://{address}", "--timeout", "30",
                             timeout=120)
        elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    statuses = json.loads(result.stdout)
    assert list(statuses) == [f"/job:worker/task:{index}" for index in range(MAX_TASKS)]
    left_out = 20_003 - MAX_TASKS
    assert result.stderr.decode().splitlines()[-1] == (
        f"clusterwire status: the target listed 20003 tasks, more than a cluster has "
        f"({MAX_TASKS}): the first {MAX_TASKS} are shown, {left_out} left out")
    print(f"\nstatus --all of a target listing 20,003 tasks: {elapsed:.1f} s, "
          f"{len(result.stdout)} bytes of output")
