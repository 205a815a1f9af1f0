"""TarShardReader against tarfile reading the same shards, and hostile shards."""

from __future__ import annotations

import io
import os
import pathlib
import tarfile

import pytest

from clusterwire.data import TarShardReader
from clusterwire.data import tar_shards as tar_shards_module
from clusterwire.data.tar_shards import read_tar_shard
from clusterwire.errors import (
    DataLossError,
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
)

pytestmark = pytest.mark.timeout(60)

MEMBERS = [
    ("sample0000.jpg", os.urandom(3000)),
    ("sample0000.cls", b"3"),
    ("sample0000.seg.PNG", os.urandom(700)),  # ext "seg.png", as WebDataset's lcase
    ("dir/sample0001.jpg", os.urandom(1)),
    ("dir/sample0001.cls", b"5"),
    ("v1.2/sample0002.json", b"{}"),  # a dot in a folder name is not the key's
    ("sample0000.txt", b"again"),  # the key again, not consecutive: a new sample
]


def _write(path, members, mode="w", extra=None):
    with tarfile.open(path, mode) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra or ():
            tar.addfile(info)
    return str(path)


def _tarfile_samples(path):
    """The same shard grouped from tarfile's own read (the expected values)."""
    samples: list[dict] = []
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            folder, _, base = member.name.rpartition("/")
            stem, _, ext = base.partition(".")
            key = f"{folder}/{stem}" if folder else stem
            if not samples or samples[-1]["__key__"] != key:
                samples.append({"__key__": key})
            samples[-1][ext.lower()] = data
    return samples


@pytest.mark.parametrize("mode", ["w", "w:gz", "w:bz2", "w:xz"])
def test_samples_equal_tarfiles_read(tmp_path, mode):
    path = _write(tmp_path / "shard.tar", MEMBERS, mode)
    samples = list(TarShardReader(path, readable_prefixes=[str(tmp_path)]))
    assert samples == _tarfile_samples(path)
    assert [s["__key__"] for s in samples] == [
        "sample0000", "dir/sample0001", "v1.2/sample0002", "sample0000"]
    assert samples[0]["seg.png"] == MEMBERS[2][1] and samples[0]["jpg"] == MEMBERS[0][1]


def test_directories_and_metadata_members_are_skipped_as_webdataset_does(tmp_path):
    folder = tarfile.TarInfo("dir")
    folder.type = tarfile.DIRTYPE
    meta = ("__meta__", b"{}")
    path = _write(tmp_path / "shard.tar", [meta, *MEMBERS[:2]], extra=[folder])
    assert list(read_tar_shard(path, readable_prefixes=None)) == [
        {"__key__": "sample0000", "jpg": MEMBERS[0][1], "cls": b"3"}]


@pytest.mark.parametrize("name", ["README", "dir/noext", "sample.", "dir.v2/noext"])
def test_a_member_without_a_key_is_invalid_naming_shard_and_member(tmp_path, name):
    path = _write(tmp_path / "shard.tar", [MEMBERS[0], (name, b"x")])
    reader = iter(TarShardReader(path, readable_prefixes=None))
    with pytest.raises(InvalidArgumentError) as caught:
        list(reader)
    assert path in str(caught.value) and repr(name) in str(caught.value)


def test_a_repeated_ext_in_one_sample_is_invalid(tmp_path):
    path = _write(tmp_path / "shard.tar", [("a.jpg", b"1"), ("a.JPG", b"2")])
    with pytest.raises(InvalidArgumentError, match=r"'a.JPG' repeats ext 'jpg'"):
        list(TarShardReader(path, readable_prefixes=None))


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE,
                                  tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_links_and_devices_are_refused_never_followed(tmp_path, kind):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"do not read")
    link = tarfile.TarInfo("sample0000.txt")
    link.type = kind
    link.linkname = str(secret) if kind != tarfile.LNKTYPE else "sample0000.jpg"
    path = _write(tmp_path / "shard.tar", [MEMBERS[0]], extra=[link])
    got = []
    with pytest.raises(InvalidArgumentError, match="not a regular file") as caught:
        got.extend(TarShardReader(path, readable_prefixes=None))
    assert "'sample0000.txt'" in str(caught.value) and path in str(caught.value)
    assert b"do not read" not in repr(got).encode()


def test_a_member_over_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(tar_shards_module, "MAX_MEMBER_BYTES", 1000)
    path = _write(tmp_path / "shard.tar", [("a.bin", b"x" * 1000), ("b.bin", b"x" * 1001)])
    reader = iter(TarShardReader(path, readable_prefixes=None))
    assert next(reader) == {"__key__": "a", "bin": b"x" * 1000}
    with pytest.raises(ResourceExhaustedError, match=r"'b.bin' is 1001 bytes.*1000-byte"):
        next(reader)


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_a_metadata_member_over_the_limit_is_refused(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(tar_shards_module, "MAX_MEMBER_BYTES", 1000)
    name = "k" * 1500 + ".bin"  # over 100 bytes: a pax record or a GNU long name
    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w", format=fmt) as tar:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ResourceExhaustedError, match=r"shard.tar.*metadata member.*1000-byte"):
        list(TarShardReader(str(path), readable_prefixes=None))
    monkeypatch.setattr(tar_shards_module, "MAX_MEMBER_BYTES", 4096)
    assert list(TarShardReader(str(path), readable_prefixes=None)) == [
        {"__key__": "k" * 1500, "bin": b"x"}]


def _cut(tmp_path, data: bytes, length: int) -> str:
    path = tmp_path / "cut.tar"
    path.write_bytes(data[:length])
    return str(path)


def test_a_truncated_shard_is_data_loss_after_the_samples_before_it(tmp_path):
    members = [("a.x", os.urandom(1000)), ("a.y", b"1"), ("b.x", os.urandom(5000))]
    data = pathlib.Path(_write(tmp_path / "full.tar", members)).read_bytes()
    # Cut inside b.x's data (its header at 2560, data from 3072): sample a is whole.
    reader = iter(TarShardReader(_cut(tmp_path, data, 4000), readable_prefixes=None))
    assert next(reader) == {"__key__": "a", "x": members[0][1], "y": b"1"}
    with pytest.raises(DataLossError, match="cut.tar"):
        next(reader)


@pytest.mark.parametrize("length", [0, 100, 2560, 2560 + 100, 1536 + 200])
def test_truncations_tarfile_ends_quietly_on_are_data_loss(tmp_path, length):
    members = [("a.x", os.urandom(1000)), ("a.y", b"1"), ("b.x", b"2")]
    data = pathlib.Path(_write(tmp_path / "full.tar", members)).read_bytes()
    path = _cut(tmp_path, data, length)
    if length >= 2560:  # cut at b.x's header: tarfile alone ends quietly, b.x lost unseen
        with tarfile.open(path, "r|") as quiet:
            assert [m.name for m in quiet] == ["a.x", "a.y"]
    with pytest.raises(DataLossError, match="cut.tar") as caught:
        list(TarShardReader(path, readable_prefixes=None))
    assert "nothing after it was read" in str(caught.value)


def test_a_corrupt_header_is_data_loss(tmp_path):
    data = bytearray(pathlib.Path(_write(tmp_path / "full.tar", MEMBERS)).read_bytes())
    data[3584 + 148:3584 + 156] = b"9999999\x00"  # sample0000.cls's header checksum
    path = _cut(tmp_path, bytes(data), len(data))
    with pytest.raises(DataLossError, match="cut.tar"):
        list(TarShardReader(path, readable_prefixes=None))


def test_a_truncated_gzip_shard_is_data_loss(tmp_path):
    data = pathlib.Path(_write(tmp_path / "full.tar.gz", MEMBERS, "w:gz")).read_bytes()
    with pytest.raises(DataLossError, match="cut.tar"):
        list(TarShardReader(_cut(tmp_path, data, len(data) // 2), readable_prefixes=None))


@pytest.mark.parametrize("mode", ["w:gz", "w:bz2", "w:xz"])
def test_a_compressed_shard_failing_its_checksum_is_data_loss(tmp_path, mode):
    data = bytearray(pathlib.Path(_write(tmp_path / "full.tar.c", MEMBERS, mode)).read_bytes())
    if mode == "w:gz":
        data[-8] ^= 1  # the CRC-32 of gzip's trailer: every byte before it is intact
    else:
        data[len(data) // 2] ^= 1
    with pytest.raises(DataLossError, match="cut.tar"):
        list(TarShardReader(_cut(tmp_path, bytes(data), len(data)), readable_prefixes=None))


def test_reads_only_under_readable_prefixes(tmp_path):
    path = _write(tmp_path / "shard.tar", MEMBERS)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    with pytest.raises(PermissionDeniedError, match="--readable-dir"):
        TarShardReader(path, readable_prefixes=[str(allowed)])
    with pytest.raises(PermissionDeniedError):
        TarShardReader(path, readable_prefixes=[])


# ---- By sample (global_shuffle's random access) -------------------------------------------


def test_an_index_reads_each_sample_as_iterating_does(tmp_path):
    path = _write(tmp_path / "shard.tar", MEMBERS)
    with TarShardReader(path, readable_prefixes=None) as reader:
        entries = reader.index()
        assert [reader.sample(e) for e in reversed(entries)] == \
            list(reversed(_tarfile_samples(path)))
    assert entries[0][1][0] == ("jpg", 512, 3000)  # (ext, data offset, bytes)
    gz = _write(tmp_path / "shard.tar.gz", MEMBERS, "w:gz")
    with pytest.raises(InvalidArgumentError, match="shard.tar.gz' is compressed"):
        TarShardReader(gz, readable_prefixes=None).index()


@pytest.mark.parametrize("length", [0, 100, 2560, 2560 + 100, 1536 + 200])
def test_an_index_of_a_truncated_shard_is_data_loss(tmp_path, length):
    members = [("a.x", os.urandom(1000)), ("a.y", b"1"), ("b.x", b"2")]
    data = pathlib.Path(_write(tmp_path / "full.tar", members)).read_bytes()
    with pytest.raises(DataLossError, match="cut.tar"):
        TarShardReader(_cut(tmp_path, data, length), readable_prefixes=None).index()


@pytest.mark.parametrize("name", ["nokey", "a."])
def test_an_index_refuses_a_member_without_a_key(tmp_path, name):
    path = _write(tmp_path / "shard.tar", [("a.x", b"1"), (name, b"2")])
    with pytest.raises(InvalidArgumentError, match=f"member '{name}' has no key"):
        TarShardReader(path, readable_prefixes=None).index()
