"""TensorFlow's own distributed runtime as a baseline for bench_session.py, when installed.

A 3-task TF cluster ``{"ps": 1, "worker": 2}`` holds an 8-byte and a large variable on
the ps task; the benchmark process reads them through TF1 graph ``Session``s, the way TF
users read a parameter-server variable:

* direct: a Session on the ps task reads its own variable (client -> owner);
* forwarded: a Session on worker 0, another process, reads it (client -> worker -> ps);
* worker process: worker 1's ``tf.distribute.Server`` runs in the benchmark process, and
  a Session on its target reads it (TF's in-process ``LocalMaster``, then worker -> ps):
  what a TF worker's training loop does.

The ps task and worker 0 are subprocesses. TF cannot bind port 0 inside a cluster spec, so
free ports are picked first (another process could take one in between: the servers then
fail to start and the benchmark says so). Each server process::

    python bench/_tf_baseline.py --cluster JSON --job ps|worker

prints ``READY`` once serving and exits when its stdin closes. The in-process server
cannot be stopped (TF has no way to); it ends with the benchmark process.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading

import numpy as np

_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}
_START_TIMEOUT = 120.0  # two TensorFlow imports at once on 2 cores


def available() -> bool:
    """True when tensorflow can be imported here."""
    return importlib.util.find_spec("tensorflow") is not None


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (each probe stays bound until all are picked)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


class TfCluster:
    """The TF servers (subprocesses) and the graph reading their variables. A context manager."""

    def __init__(self, small: np.ndarray, big: np.ndarray):
        os.environ.update(_QUIET)
        ps, *workers = (f"127.0.0.1:{port}" for port in _free_ports(3))
        self.cluster = {"ps": [ps], "worker": workers}
        self._procs = [
            subprocess.Popen([sys.executable, os.path.abspath(__file__), "--cluster",
                              json.dumps(self.cluster), "--job", job],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**os.environ, **_QUIET}, text=True)
            for job in ("ps", "worker")]
        self._sessions: dict = {}
        try:
            self._await_ready()
            self._build(small, big)
        except BaseException:
            self.close()
            raise

    def _await_ready(self) -> None:
        ready = []
        readers = [threading.Thread(target=lambda p=p: ready.append(p.stdout.readline()),
                                    daemon=True) for p in self._procs]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(_START_TIMEOUT)
        if sorted(line.strip() for line in ready) != ["READY", "READY"]:
            raise RuntimeError(f"TensorFlow servers did not start: {ready!r} (a port picked "
                               f"for {self.cluster} may have been taken meanwhile)")

    def _build(self, small: np.ndarray, big: np.ndarray) -> None:
        import tensorflow as tf

        tf1 = tf.compat.v1
        self._own_server = tf.distribute.Server(tf.train.ClusterSpec(self.cluster),
                                                job_name="worker", task_index=1,
                                                protocol="grpc", start=True)
        graph = tf.Graph()
        self.reads: dict[tuple[str, str], object] = {}
        with graph.as_default():
            assigns = []
            for name, value in (("small", small), ("big", big)):
                with tf.device("/job:ps/task:0"):
                    variable = tf1.Variable(tf.zeros(value.shape, value.dtype), name=name)
                    feed = tf1.placeholder(value.dtype, value.shape)
                    assigns.append((variable.assign(feed), feed, value))
                    self.reads[name, "direct"] = tf.identity(variable)
                with tf.device("/job:worker/task:0"):
                    self.reads[name, "forwarded"] = tf.identity(variable)
                with tf.device("/job:worker/task:1"):
                    self.reads[name, "worker process"] = tf.identity(variable)
            init = tf1.global_variables_initializer()
        self._sessions = {
            "direct": tf1.Session(f"grpc://{self.cluster['ps'][0]}", graph=graph),
            "forwarded": tf1.Session(f"grpc://{self.cluster['worker'][0]}", graph=graph),
            "worker process": tf1.Session(self._own_server.target, graph=graph)}
        self.direct = self._sessions["direct"]
        self.direct.run(init)
        for assign, feed, value in assigns:
            self.direct.run(assign.op, feed_dict={feed: value})

    def read(self, name: str, topology: str) -> np.ndarray:
        """Fetch variable ``name`` ("small" or "big") into this process."""
        return self._sessions[topology].run(self.reads[name, topology])

    def close(self) -> None:
        """Close the sessions and stop the servers (idempotent)."""
        for session in self._sessions.values():
            with contextlib.suppress(Exception):
                session.close()
        self._sessions = {}
        for proc in self._procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()

    def __enter__(self) -> TfCluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _serve(cluster: dict, job: str) -> None:
    import tensorflow as tf

    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=0,
                                  protocol="grpc", start=True)
    print("READY", flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin (or dies)
    del server


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--job", required=True, choices=["ps", "worker"])
    arguments = parser.parse_args()
    _serve(json.loads(arguments.cluster), arguments.job)
