"""close() from another thread ends an iteration whose ``next()`` waits for splits: a
distributed_epoch consumer holding none (the job's other consumers hold them all) was left
waiting forever by a close() from the thread that saves its position and stops it."""

from __future__ import annotations

import threading

import pytest
from conftest import in_process_data_service

from clusterwire import data

pytestmark = pytest.mark.timeout(60)


def test_close_from_another_thread_ends_a_next_waiting_for_splits():
    with in_process_data_service(workers=1) as dispatcher:
        dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(8000))
        # One worker: 8 splits; each consumer's 2 read slots hold 2 of them, one element a
        # read, so the first 4 consumers hold them all.
        holders = [iter(data.from_dataset_id("distributed_epoch", dispatcher.target,
                                             dataset_id, job_name="j",
                                             max_outstanding_requests=1))
                   for _ in range(4)]
        for holder in holders:
            next(holder)
        waiting = iter(data.from_dataset_id("distributed_epoch", dispatcher.target,
                                            dataset_id, job_name="j"))
        got: list[list] = []
        reader = threading.Thread(target=lambda: got.append(list(waiting)), daemon=True)
        reader.start()
        reader.join(1.0)
        assert reader.is_alive()  # no split for it while the others hold theirs
        waiting.close()
        reader.join(10)
        assert not reader.is_alive() and got == [[]]
        for holder in holders:
            holder.close()
