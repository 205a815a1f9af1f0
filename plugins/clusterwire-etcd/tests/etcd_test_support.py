"""A real etcd for the tests: Debian's etcd-server on free loopback ports, its own data dir."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterwire.testing.ports import free_ports

ETCD = shutil.which("etcd")
START_SECONDS = 30.0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as reply:
            return json.loads(reply.read()).get("health") == "true"
    except (OSError, ValueError):
        return False


def start(data_dir: Path, ports: tuple[int, int] | None = None
          ) -> tuple[subprocess.Popen, str] | None:
    """etcd serving on ``ports`` (client, peer; default: two free ones) with ``data_dir``;
    None if it exited (a port taken meanwhile)."""
    client, peer = ports or free_ports(2)
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    process = subprocess.Popen(
        [ETCD, "--name", "test", "--data-dir", str(data_dir),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
         "--initial-cluster", f"test={peer_url}", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + START_SECONDS
    while not _healthy(url):
        if process.poll() is not None:
            process.stderr.close()
            return None
        if time.monotonic() > deadline:
            stop(process)
            pytest.fail(f"etcd did not serve at {url} within {START_SECONDS} s")
        time.sleep(0.05)
    return process, url


def stop(process: subprocess.Popen) -> None:
    """End etcd: SIGTERM, then SIGKILL after 10 s."""
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
    if process.stderr:
        process.stderr.close()


@contextlib.contextmanager
def running_etcd(data_dir: Path) -> Iterator[str]:
    """A running etcd's client URL; stopped and its data dir removed afterwards. A port taken
    between choosing and binding (etcd then exits) is retried once on new ports."""
    if ETCD is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    started = start(data_dir) or start(data_dir)
    if started is None:
        shutil.rmtree(data_dir, ignore_errors=True)
        pytest.fail("etcd exited at start twice (ports taken?)")
    process, url = started
    try:
        yield url
    finally:
        stop(process)
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="module", name="etcd")
def etcd_fixture(tmp_path_factory) -> Iterator[str]:
    """The client URL of an etcd shared by the module's tests (each uses its own cluster)."""
    with running_etcd(tmp_path_factory.mktemp("etcd") / "data") as url:
        yield url
