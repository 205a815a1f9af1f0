"""tf.data service with clusterwire.data: a dispatcher, two workers, both processing modes.

    python examples/data_service.py

Servers run in this process here for brevity; in production each runs as its
own process: ``clusterwire dispatcher --port 5050 --worker-token-file FILE`` and
``clusterwire worker --dispatcher-address HOST:5050 --worker-address HOST:%port%
--worker-token-file FILE --import MODULE`` (the workers' own secret: only they register).
Functions in a pipeline must be importable by the workers (module level), so
this example uses numpy's.
"""

from __future__ import annotations

import numpy as np

from clusterwire import data


def main() -> None:
    dispatcher = data.DispatchServer(port=0)
    address = dispatcher.target.split("://")[1]
    workers = [data.WorkerServer(port=0, dispatcher_address=address) for _ in range(2)]
    try:
        dataset = data.Dataset.range(8).map(np.square)
        every_worker = dataset.apply(data.distribute("parallel_epochs", dispatcher.target))
        print("parallel_epochs:  ", sorted(int(x) for x in every_worker))
        shared = dataset.apply(data.distribute("distributed_epoch", dispatcher.target))
        print("distributed_epoch:", sorted(int(x) for x in shared))
        batches = shared.batch(4)  # transformations after distribute run in the client
        print("client-side batch:", [b.shape for b in batches])
    finally:
        for worker in workers:
            worker.stop()
        dispatcher.stop()


if __name__ == "__main__":
    main()
