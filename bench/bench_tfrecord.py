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

MB/s are 10^6 bytes of record data per second. Then ``parse_example`` of 2000 Examples
(an int64 label, a 784-float image, 0-2 string tags) in one batch: clusterwire's and
``tf.io.parse_example``'s, examples/s.
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

import numpy as np
from _machine import cpu_model

from clusterwire.data import (
    FixedLenFeature,
    TFRecordReader,
    TFRecordWriter,
    VarLenFeature,
    crc32c,
    parse_example,
)
from clusterwire.protos.example_pb2 import Example

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
if len(sys.argv) > 4:
    records = list(tf.compat.v1.io.tf_record_iterator(sys.argv[4]))
    spec = {"label": tf.io.FixedLenFeature([], tf.int64),
            "image": tf.io.FixedLenFeature([784], tf.float32),
            "tags": tf.io.VarLenFeature(tf.string)}
    parse = lambda: tf.nest.map_structure(lambda t: t.numpy(), tf.io.parse_example(records, spec),
                                          expand_composites=True)
    parse()
    times = []
    for _ in range(runs):
        start = time.perf_counter(); parse(); times.append(time.perf_counter() - start)
    out["parse"] = [len(records), times]
out["version"] = tf.__version__
print(json.dumps(out))
"""
PARSE_EXAMPLES = 2000


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


def _write_examples(path: str) -> list[bytes]:
    rng = np.random.default_rng(0)
    records = []
    for i in range(PARSE_EXAMPLES):
        example = Example()
        features = example.features.feature
        features["label"].int64_list.value.append(i)
        features["image"].float_list.value.extend(rng.standard_normal(784).tolist())
        features["tags"].bytes_list.value.extend([b"a", b"bb"][:i % 3])
        records.append(example.SerializeToString())
    with TFRecordWriter(path) as writer:
        for record in records:
            writer.write(record)
    return records


def _parse_rate(records: list[bytes], runs: int) -> tuple[int, list[float]]:
    spec = {"label": FixedLenFeature([], "int64"), "image": FixedLenFeature([784], "float32"),
            "tags": VarLenFeature("string")}
    _, times = _time(lambda: parse_example(records, spec), runs)
    return len(records), times


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
        examples = os.path.join(folder, "examples.tfrecord")
        records = _write_examples(examples)
        tf_parse = None
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
            command = [tf_python, "-c", TF_TIMER, path, compression or "", str(args.runs)]
            done = subprocess.run(command + ([examples] if compression is None else []),
                                  capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                print(f"| TensorFlow | failed: {done.stderr.strip()[-300:]} | |")
                continue
            results = json.loads(done.stdout.strip().splitlines()[-1])
            version = results.pop("version")
            tf_parse = results.pop("parse", tf_parse)
            for name, (total, times) in results.items():
                print(_row(f"TF {version} {name}", total, times))
        print(f"\nparse_example, {PARSE_EXAMPLES} Examples (label, 784 floats, tags) in one "
              f"batch, {args.runs} runs\n")
        print("| parser | best examples/s | median examples/s |\n|---|---:|---:|")
        rows = [("clusterwire parse_example", _parse_rate(records, args.runs))]
        if tf_parse is not None:
            rows.append(("tf.io.parse_example (+ .numpy())", tf_parse))
        for name, (count, times) in rows:
            print(f"| {name} | {count / min(times):,.0f} | "
                  f"{count / statistics.median(times):,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
