"""Read throughput of 1 MiB TFRecord records: clusterwire's reader, TF's, a raw file read.

    python bench/bench_tfrecord.py [--records 256] [--runs 5] [--tf-python PATH]

Writes one file of ``--records`` 1 MiB random records (plain, and GZIP with
``--gzip``) in a temporary folder, reads it once to warm the page cache, then times,
in one run, each reader over the whole file (best and median of ``--runs``):

* raw read: ``f.read(1 MiB)`` to the end (a bytes object per MiB, as a reader hands out);
* clusterwire ``TFRecordReader`` (both CRC-32C checks), with the crc library it has;
* TensorFlow, in a subprocess of ``--tf-python`` (a Python with tensorflow; default this
  one if it has it): ``tf.data.TFRecordDataset`` iterated eagerly (tensors, and
  ``.numpy()`` bytes) and ``tf.compat.v1.io.tf_record_iterator`` (bytes, like ours).

MB/s are 10^6 bytes of record data per second.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _machine import cpu_model

from clusterwire.data import TFRecordReader, TFRecordWriter, crc32c

MIB = 1 << 20

TF_TIMER = """
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
path, compression, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
def dataset_tensors():
    return sum(int(tf.strings.length(r)) for r in tf.data.TFRecordDataset(path, compression))
def dataset_numpy():
    return sum(len(r.numpy()) for r in tf.data.TFRecordDataset(path, compression))
def record_iterator():
    options = tf.io.TFRecordOptions(compression_type=compression)
    return sum(len(r) for r in tf.compat.v1.io.tf_record_iterator(path, options))
out = {}
for name, reader in [("tf.data.TFRecordDataset (tensors)", dataset_tensors),
                     ("tf.data.TFRecordDataset (.numpy() bytes)", dataset_numpy),
                     ("tf_record_iterator (bytes)", record_iterator)]:
    reader()
    times = []
    for _ in range(runs):
        start = time.perf_counter(); total = reader(); times.append(time.perf_counter() - start)
    out[name] = [total, times]
out["version"] = tf.__version__
print(json.dumps(out))
"""


def _time(reader, runs: int) -> tuple[int, list[float]]:
    reader()  # warm-up
    times = []
    total = 0
    for _ in range(runs):
        start = time.perf_counter()
        total = reader()
        times.append(time.perf_counter() - start)
    return total, times


def _raw(path: str) -> int:
    total = 0
    with open(path, "rb") as file:
        while chunk := file.read(MIB):
            total += len(chunk)
    return total


def _ours(path: str, compression: str | None) -> int:
    return sum(len(record) for record in TFRecordReader(path, compression))


def _row(name: str, total: int, times: list[float]) -> str:
    best, median = total / min(times) / 1e6, total / statistics.median(times) / 1e6
    return f"| {name} | {best:,.0f} | {median:,.0f} |"


def _tf_python(given: str | None) -> str | None:
    if given:
        return given
    return sys.executable if importlib.util.find_spec("tensorflow") else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=256, help="1 MiB records in the file")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gzip", action="store_true", help="also time a GZIP file")
    parser.add_argument("--tf-python", default=os.environ.get("CLUSTERWIRE_TF_PYTHON"),
                        help="a Python with tensorflow for TF's rows")
    args = parser.parse_args()
    tf_python = _tf_python(args.tf_python)
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; CRC-32C: "
          f"{'google-crc32c (C)' if crc32c.accelerated() else 'numpy fallback'}")
    with tempfile.TemporaryDirectory() as folder:
        for compression in [None, "GZIP"] if args.gzip else [None]:
            path = os.path.join(folder, f"bench-{compression or 'plain'}.tfrecord")
            with TFRecordWriter(path, compression) as writer:
                for _ in range(args.records):
                    writer.write(os.urandom(MIB))
            print(f"\n{args.records} x 1 MiB records, {compression or 'uncompressed'} "
                  f"({os.path.getsize(path) / MIB:.0f} MiB file, page cache warm), "
                  f"{args.runs} runs\n")
            print("| reader | best MB/s | median MB/s |\n|---|---:|---:|")
            if compression is None:
                print(_row("raw file read, 1 MiB reads", *_time(lambda p=path: _raw(p),
                                                                 args.runs)))
            print(_row("clusterwire TFRecordReader", *_time(
                lambda p=path, c=compression: _ours(p, c), args.runs)))
            if tf_python is None:
                print("| TensorFlow | not installed (--tf-python) | |")
                continue
            done = subprocess.run([tf_python, "-c", TF_TIMER, path, compression or "",
                                   str(args.runs)], capture_output=True, text=True,
                                  timeout=1800)
            if done.returncode != 0:
                print(f"| TensorFlow | failed: {done.stderr.strip()[-300:]} | |")
                continue
            results = json.loads(done.stdout.strip().splitlines()[-1])
            version = results.pop("version")
            for name, (total, times) in results.items():
                print(_row(f"TF {version} {name}", total, times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
