"""Readers over fsspec URLs against a real S3 API (moto's server on 127.0.0.1), and the
readable-prefix rule for URLs.

s3fs gets no options from clusterwire: the endpoint and credentials come from the
environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), as on a worker.
"""

from __future__ import annotations

import io
import socket
import tarfile

import numpy as np
import pytest
from aws_moto import moto_endpoint, point_aws_at
from conftest import fresh_python

boto3 = pytest.importorskip("boto3", reason="pip install 'clusterwire[test]'")
pytest.importorskip("moto.server", reason="pip install 'moto[s3]'")
s3fs = pytest.importorskip("s3fs", reason="pip install 'clusterwire[fsspec]'")
pa = pytest.importorskip("pyarrow", reason="pip install 'clusterwire[parquet]'")
pq = pytest.importorskip("pyarrow.parquet")

from clusterwire.data import (  # noqa: E402
    ParquetReader,
    TarShardReader,
    TFRecordReader,
    TFRecordWriter,
)
from clusterwire.data.filesystems import (  # noqa: E402
    _check_opened,
    check_prefixes,
    open_readable,
    resolve_readable,
)
from clusterwire.data.parquet import plan_row_groups  # noqa: E402
from clusterwire.data.permissions import WorkerPermissions  # noqa: E402
from clusterwire.errors import (  # noqa: E402
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)

pytestmark = pytest.mark.timeout(90)

BUCKET = "train-data"
PREFIX = f"s3://{BUCKET}/shards"


@pytest.fixture(scope="module")
def moto_url():
    with moto_endpoint() as url:
        yield url


@pytest.fixture(scope="module")
def local_files(tmp_path_factory):
    """A Parquet file, a tar shard and a TFRecord file, written locally (the expected values)."""
    folder = tmp_path_factory.mktemp("s3src")
    table = pa.table({"x": np.arange(500, dtype=np.int64), "y": np.linspace(0, 1, 500),
                      "name": [f"n{i}" for i in range(500)]})
    pq.write_table(table, folder / "part-0.parquet", row_group_size=128)
    with tarfile.open(folder / "shard-0.tar", "w") as tar:
        for key in range(3):
            for ext, data in (("jpg", bytes([key]) * 1000), ("cls", str(key).encode())):
                info = tarfile.TarInfo(f"s{key:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with TFRecordWriter(folder / "part-0.tfrecord") as writer:
        for i in range(10):
            writer.write(b"record %d" % i)
    return folder


@pytest.fixture
def s3(monkeypatch, moto_url, local_files):
    """moto's S3 with the files uploaded, and the environment a worker would have."""
    point_aws_at(monkeypatch, moto_url)
    s3fs.S3FileSystem.clear_instance_cache()  # s3fs reads the environment once per instance
    client = boto3.client("s3")
    for bucket in (BUCKET, BUCKET + "-evil"):
        client.create_bucket(Bucket=bucket)
        for path in local_files.iterdir():
            client.upload_file(str(path), bucket, f"shards/{path.name}")
    client.upload_file(str(local_files / "part-0.parquet"), BUCKET, "shards2/part-0.parquet")
    yield client
    s3fs.S3FileSystem.clear_instance_cache()


def test_parquet_from_s3_equals_pyarrows_read_of_the_same_file(s3, local_files):
    expected = pq.read_table(local_files / "part-0.parquet")
    with ParquetReader(f"{PREFIX}/part-0.parquet", batch_rows=100,
                       readable_prefixes=[PREFIX]) as reader:
        assert reader.num_row_groups == 4
        batches = list(reader.read(1, 4))
    assert [len(b["x"]) for b in batches] == [100, 28, 100, 28, 100, 16]
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]),
                                  expected.column("x").to_numpy()[128:])
    np.testing.assert_array_equal(np.concatenate([b["y"] for b in batches]),
                                  expected.column("y").to_numpy()[128:])
    assert list(np.concatenate([b["name"] for b in batches])) == \
        expected.column("name").to_pylist()[128:]
    plan = plan_row_groups([f"{PREFIX}/part-0.parquet"] * 2, readable_prefixes=[PREFIX])
    assert plan.row_groups == 8 and plan.rows == 1000


def test_tar_shard_from_s3_equals_the_local_read(s3, local_files):
    local = list(TarShardReader(local_files / "shard-0.tar", readable_prefixes=None))
    remote = list(TarShardReader(f"{PREFIX}/shard-0.tar", readable_prefixes=[PREFIX]))
    assert remote == local
    assert [s["__key__"] for s in remote] == ["s0000", "s0001", "s0002"]
    assert remote[2] == {"__key__": "s0002", "jpg": b"\x02" * 1000, "cls": b"2"}


def test_tfrecord_bytes_through_open_readable(s3, local_files):
    with open_readable(f"{PREFIX}/part-0.tfrecord", [PREFIX]) as remote:
        data = remote.read()
    assert data == (local_files / "part-0.tfrecord").read_bytes()
    records = list(TFRecordReader(local_files / "part-0.tfrecord"))
    assert records == [b"record %d" % i for i in range(10)]


@pytest.mark.parametrize("url", [
    f"s3://{BUCKET}-evil/shards/part-0.parquet",  # a bucket whose name starts the same
    f"s3://{BUCKET}/shards2/part-0.parquet",  # a folder whose name starts the same
    f"gs://{BUCKET}/shards/part-0.parquet",  # another store
])
def test_a_prefix_not_allowed_is_permission_denied_naming_url_and_fix(s3, url):
    with pytest.raises(PermissionDeniedError) as caught:
        ParquetReader(url, readable_prefixes=[PREFIX, "/nonexistent-local-dir"])
    assert url in str(caught.value) and "--readable-dir" in str(caught.value)
    with pytest.raises(PermissionDeniedError):
        TarShardReader(url, readable_prefixes=[])  # default deny


@pytest.mark.parametrize("url", [
    f"s3://{BUCKET}/shards/../shards2/part-0.parquet",
    f"s3://{BUCKET}/shards/./part-0.parquet",
    f"s3://{BUCKET}/shards/%2E%2e/shards2/part-0.parquet",
    f"s3://{BUCKET}/shards/a%2F..%2F..%2Fshards2/part-0.parquet",
    f"s3://{BUCKET}/shards//part-0.parquet",
    f"s3://{BUCKET}/shards/part-0.parquet?versionId=1",
    f"simplecache::s3://{BUCKET}/shards/part-0.parquet",
    "s3:///shards/part-0.parquet",
])
def test_urls_that_could_escape_a_prefix_are_refused(s3, url):
    with pytest.raises((InvalidArgumentError, PermissionDeniedError)):
        open_readable(url, [PREFIX])


def test_url_components_are_normalised(s3):
    assert resolve_readable(f"S3://{BUCKET}/shards/a", [PREFIX]) == f"s3://{BUCKET}/shards/a"
    assert resolve_readable(f"s3a://{BUCKET}/shards/a", [PREFIX + "/"]) == \
        f"s3://{BUCKET}/shards/a"
    assert resolve_readable(f"s3://{BUCKET}/x", [f"s3://{BUCKET}"]) == f"s3://{BUCKET}/x"
    assert resolve_readable(f"gcs://{BUCKET}/x", [f"gs://{BUCKET}"]) == f"gs://{BUCKET}/x"
    with pytest.raises(PermissionDeniedError):
        resolve_readable(f"s3://{BUCKET}", [PREFIX])  # the bucket is not under its folder


def test_worker_permissions_take_url_prefixes_without_reaching_the_store(tmp_path):
    permissions = WorkerPermissions(readable_dirs=[PREFIX, str(tmp_path)])
    assert permissions.readable_dirs == (PREFIX, str(tmp_path.resolve()))
    assert permissions.path(f"{PREFIX}/a.tar") == f"{PREFIX}/a.tar"
    assert permissions.path(str(tmp_path / "a.tar")) == str(tmp_path.resolve() / "a.tar")
    with pytest.raises(PermissionDeniedError, match="readable_dirs"):
        permissions.path(f"s3://{BUCKET}-evil/shards/a.tar")
    with pytest.raises(InvalidArgumentError):
        check_prefixes(["s3://bucket/../other"])
    with pytest.raises(NotFoundError):
        check_prefixes([str(tmp_path / "missing")])


def test_file_urls_are_local_paths(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"abc")
    with open_readable(f"file://{tmp_path}/a.bin", [str(tmp_path)]) as file:
        assert file.read() == b"abc"
    with pytest.raises(PermissionDeniedError):
        open_readable(f"file://{tmp_path}/../a.bin", [str(tmp_path)])
    with pytest.raises(InvalidArgumentError, match="file:///absolute"):
        open_readable("file://host/etc/passwd", ["/"])


def test_a_file_swapped_for_a_link_after_the_check_is_not_read(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    # What open() gets when a link replaced the checked path in between: the descriptor
    # names the file outside, and the check on the descriptor refuses it.
    file = open(outside / "secret", "rb")  # noqa: SIM115 - closed by the check
    with pytest.raises(PermissionDeniedError, match="replaced by a link"):
        _check_opened(file, str(allowed / "data"), (str(allowed),))
    assert file.closed


def test_a_missing_object_is_not_found_naming_it(s3):
    url = f"{PREFIX}/missing.parquet"
    with pytest.raises(NotFoundError, match=url):
        ParquetReader(url, readable_prefixes=[PREFIX])
    with pytest.raises(NotFoundError, match="s3://no-such-bucket/shards/a.tar"):
        TarShardReader("s3://no-such-bucket/shards/a.tar",
                       readable_prefixes=["s3://no-such-bucket"])


def test_an_unreachable_store_is_unavailable_naming_the_url(s3, monkeypatch):
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    s3fs.S3FileSystem.clear_instance_cache()
    url = f"{PREFIX}/part-0.parquet"
    with pytest.raises(UnavailableError, match=url):
        open_readable(url, [PREFIX])


def test_importing_clusterwire_data_loads_neither_pyarrow_nor_fsspec():
    loaded = fresh_python(
        "import sys, clusterwire, clusterwire.data as d\n"
        "import clusterwire.data.filesystems, clusterwire.data.parquet, "
        "clusterwire.data.tar_shards, clusterwire.data.permissions\n"
        "d.ParquetReader, d.TarShardReader\n"
        "print(sorted(m for m in ('pyarrow', 'fsspec', 's3fs') if m in sys.modules))")
    assert loaded.strip() == "[]"


def test_file_sources_read_s3_through_the_service(s3, local_files):
    """list_files + TFRecordDataset and from_parquet over s3:// URLs, read by in-process
    workers whose readable_dirs is the URL prefix (their credentials: the environment)."""
    from collections import Counter

    from conftest import in_process_data_service

    from clusterwire import data

    records = list(TFRecordReader(local_files / "part-0.tfrecord"))
    assert list(TFRecordReader(f"{PREFIX}/part-0.tfrecord", readable_prefixes=[PREFIX])) == \
        records
    names = data.Dataset.list_files(f"{PREFIX}/*.tfrecord", shuffle=False)
    assert [n.decode() for n in names] == [f"{PREFIX}/part-0.tfrecord"]
    rows = pq.read_table(local_files / "part-0.parquet").column("x").to_pylist()
    with in_process_data_service(2, readable_dirs=[PREFIX]) as dispatcher:
        for mode in ("parallel_epochs", "distributed_epoch"):
            read = data.TFRecordDataset(names).apply(
                data.distribute(processing_mode=mode, service=dispatcher.target))
            copies = 2 if mode == "parallel_epochs" else 1
            assert Counter(read) == Counter(records * copies)
            table = data.Dataset.from_parquet(f"{PREFIX}/part-0.parquet", columns=["x"]).apply(
                data.distribute(processing_mode=mode, service=dispatcher.target))
            assert Counter(int(r["x"]) for r in table) == Counter(rows * copies)
        outside = data.TFRecordDataset(f"s3://{BUCKET}-evil/shards/part-0.tfrecord").apply(
            data.distribute(processing_mode="parallel_epochs", service=dispatcher.target))
        with pytest.raises(PermissionDeniedError, match=f"{BUCKET}-evil"):
            list(outside)
