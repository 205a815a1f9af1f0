"""A trainer process for the resume tests: reads a data-service dataset, checkpointing the
elements it saw and its position every ``--every`` elements; started again on the same
checkpoint file, it resumes from the position saved there.

``python cw_data_trainer.py TARGET DATASET_ID MODE CHECKPOINT [--every N] [--announce K]``
prints ``READ K`` once it has read K elements in this run (the test SIGKILLs it then, while
it goes on reading, checkpointing no more) and ``DONE`` after the last element (or once it
has ``--limit`` elements in all). ``--consumer-index``/``--num-consumers``: round-robin reads.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from clusterwire import data


def save(path: str, record: dict) -> None:
    """Write ``record`` to ``path`` atomically (a kill never leaves half a checkpoint)."""
    with open(path + ".tmp", "w") as file:
        json.dump(record, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(path + ".tmp", path)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("target", "dataset_id", "mode", "checkpoint"):
        parser.add_argument(name)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--announce", type=int, default=0)
    parser.add_argument("--job-name", default=None)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--consumer-index", type=int, default=None)
    parser.add_argument("--num-consumers", type=int, default=None)
    args = parser.parse_args()
    seen: list[int] = []
    state = None
    if os.path.exists(args.checkpoint):
        with open(args.checkpoint) as file:
            record = json.load(file)
        seen, state = record["seen"], record["state"]
    dataset = data.from_dataset_id(args.mode, args.target, args.dataset_id,
                                   job_name=args.job_name, consumer_index=args.consumer_index,
                                   num_consumers=args.num_consumers, state=state)
    iterator = iter(dataset)
    for read, element in enumerate(iterator, 1):
        seen.append(int(element))
        if len(seen) == args.limit:
            break
        if read % args.every == 0 and not (args.announce and read > args.announce):
            save(args.checkpoint, {"seen": seen, "state": iterator.state_dict()})
        if read == args.announce:
            print(f"READ {read}", flush=True)
        if args.announce and read > args.announce:
            time.sleep(0.002)  # reading on, slowly, until the test's SIGKILL comes
    save(args.checkpoint, {"seen": seen, "state": iterator.state_dict(), "done": True})
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
