"""A real Prometheus (Debian's ``prometheus`` package) scraping a 3-process cluster.

Three task processes serve their metrics (``metrics_port: 0``) behind the cluster token; a
Prometheus started here on a free loopback port scrapes them every second with the token as
its bearer token (and once more without it), while a client drives gets. The rates, the
exact counts and every query of the Grafana dashboard come back through Prometheus' HTTP API.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
from test_metrics_docs import dashboard_expressions

from clusterwire import errors
from clusterwire.session import Session

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
pytestmark = pytest.mark.skipif(
    not os.access(PROMETHEUS, os.X_OK),
    reason="needs the prometheus binary: apt-get install prometheus (.ci/run installs it)")

DEADLINE_S = 20.0
TASKS = [f"/job:task/task:{index}" for index in range(3)]

# One task of a 3-task cluster: ports 0, its target and metrics URL on stdout, SIGTERM stops it.
TASK = """
import json, signal, sys, threading
import clusterwire
server = clusterwire.Server({"task": ["127.0.0.1:0"] * 3}, job_name="task",
                            task_index=int(sys.argv[1]),
                            config={"metrics_port": 0, "auth_token_file": sys.argv[2]})
signal.signal(signal.SIGTERM,
              lambda *_: threading.Thread(target=server.stop, args=(1,)).start())
print(json.dumps([server.target, server.metrics_url]), flush=True)
server.join()
"""

CONFIG = """
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: clusterwire
    authorization:
      credentials_file: {token}
    static_configs:
      - targets: {targets}
  - job_name: no-token
    static_configs:
      - targets: {targets}
"""


def _line(process: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"no line from process {process.pid} within {timeout} s")
    return process.stdout.readline()


def _wait_for_log(path, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, path.read_text())
        if match:
            return match
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} not in {path} after {timeout} s:\n{path.read_text()}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout:
        process.stdout.close()


class Prometheus:
    """Prometheus' HTTP API at ``url``."""

    def __init__(self, url: str):
        self.url = url

    def api(self, path: str, **parameters: str):
        """The data of an API answer; fails on any error Prometheus reports."""
        address = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(parameters)}"
        with urllib.request.urlopen(address, timeout=5) as response:
            answer = json.load(response)
        assert answer["status"] == "success", (path, parameters, answer)
        return answer["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector of ``expr`` now."""
        return self.api("query", query=expr)["result"]

    def values(self, expr: str, *labels: str) -> dict:
        """``expr``'s values by the values of ``labels`` (one label: by its value)."""
        values = {}
        for series in self.query(expr):
            key = tuple(series["metric"].get(label, "") for label in labels)
            values[key[0] if len(key) == 1 else key] = float(series["value"][1])
        return values

    def wait_until(self, expr: str, labels: tuple[str, ...], holds, what: str) -> dict:
        """Poll ``expr`` until ``holds(values)`` (Prometheus needs a few scrapes); the values."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            values = self.values(expr, *labels)
            if holds(values):
                return values
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: {expr} is {values} after {DEADLINE_S} s")
            time.sleep(0.2)


@pytest.fixture
def cluster(tmp_path):
    """Three task processes of one cluster and the token file; yields (targets, metrics
    addresses, token file)."""
    token = tmp_path / "token"
    token.write_text("prometheus-test-token\n")
    token.chmod(0o600)
    processes = []
    try:
        for index in range(3):
            processes.append(subprocess.Popen(
                [sys.executable, "-c", TASK, str(index), str(token)],
                stdout=subprocess.PIPE, text=True))
        started = [json.loads(_line(process, 30)) for process in processes]
        targets = [target for target, _ in started]
        spec = {"task": [target.split("://", 1)[1] for target in targets]}
        for target in targets:
            with Session(target, config={"auth_token_file": str(token)}) as session:
                session.complete_cluster(spec)
        metrics = [urllib.parse.urlsplit(url).netloc for _, url in started]
        yield targets, metrics, token
    finally:
        for process in processes:
            _stop(process)


@pytest.fixture
def prometheus(tmp_path, cluster):
    """Prometheus on a free loopback port, scraping the cluster with and without the token."""
    _, metrics, token = cluster
    config = tmp_path / "prometheus.yml"
    config.write_text(CONFIG.format(token=token, targets=json.dumps(metrics)))
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", "--web.listen-address=127.0.0.1:0",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        address = _wait_for_log(log, r'msg="Listening on" address=(127\.0\.0\.1:\d+)', 30)[1]
        _wait_for_log(log, r"Server is ready to receive web requests", 30)
        yield Prometheus(f"http://{address}")
    finally:
        _stop(process)


@pytest.mark.timeout(60)
def test_prometheus_scrapes_the_cluster_and_queries_its_rates(cluster, prometheus):
    targets, _, token = cluster
    counts = {"direct": 0, "forwarded": 0, "missing": 0}
    stop = threading.Event()
    failures = []

    def load() -> None:
        # Gets on task 0, on task 1 through task 0, and now and then a missing name on task 0;
        # task 2 gets nothing.
        try:
            with Session(targets[0], config={"auth_token_file": str(token)}) as session:
                session.put("w", np.arange(1024, dtype=np.float32))
                session.put("w", np.arange(1024, dtype=np.float32), task=TASKS[1])
                while not stop.wait(0.002):
                    session.get("w")
                    counts["direct"] += 1
                    session.get("w", task=TASKS[1])
                    counts["forwarded"] += 1
                    if counts["direct"] % 20 == 0:
                        with pytest.raises(errors.NotFoundError):
                            session.get("missing")
                        counts["missing"] += 1
        except BaseException as err:  # noqa: BLE001 - reported by the test
            failures.append(err)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        # Every target is up with the token, and down (401) without it.
        prometheus.wait_until('up{job="clusterwire"}', ("instance",),
                              lambda up: len(up) == 3 and set(up.values()) == {1.0},
                              "the three tasks scraped with the token")
        prometheus.wait_until('up{job="no-token"}', ("instance",),
                              lambda up: len(up) == 3 and set(up.values()) == {0.0},
                              "the three tasks refused without the token")
        refused = {target["lastError"] for target in prometheus.api("targets")["activeTargets"]
                   if target["labels"]["job"] == "no-token"}
        assert refused == {"server returned HTTP status 401 Unauthorized"}, refused
        # The get rate is non-zero on the loaded tasks; the idle one has no get series at all.
        rates = prometheus.wait_until(
            'sum by (server) (rate(clusterwire_requests_total{job="clusterwire",method="get",'
            'code="OK"}[5s]))', ("server",),
            lambda rates: set(rates) == set(TASKS[:2]) and all(rates.values()),
            "a get rate on tasks 0 and 1")
        assert rates[TASKS[0]] > rates[TASKS[1]] > 0  # task 0 also serves what it forwards
        # Every query of the Grafana dashboard runs; those on what tasks export have data.
        for title, expr in dashboard_expressions():
            expr = expr.replace("$__rate_interval", "5s")
            if "clusterwire_data_" in expr:
                prometheus.query(expr)
            else:
                prometheus.wait_until(expr, (), bool, f"data for the panel {title!r}")
    finally:
        stop.set()
        loader.join(10)
    assert not loader.is_alive() and not failures, failures
    # Once the load stopped, Prometheus' last scrape has exactly the requests made.
    gets = {(TASKS[0], "OK"): counts["direct"] + counts["forwarded"],
            (TASKS[0], "NOT_FOUND"): counts["missing"],
            (TASKS[1], "OK"): counts["forwarded"]}
    prometheus.wait_until('clusterwire_requests_total{job="clusterwire",method="get"}',
                          ("server", "code"), lambda values: values == gets, "the get counts")
    prometheus.wait_until(
        'clusterwire_forwarded_requests_total{job="clusterwire",method="get"}', ("server",),
        lambda values: values == {TASKS[0]: counts["forwarded"]}, "the forwarded gets")
