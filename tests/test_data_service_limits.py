"""The data service's limits in one table (``clusterwire.data.ServiceLimits``, issue 35).

Its defaults are the module constants they replaced (no change in behaviour); a limit set
through ``DispatcherConfig``, the command line (a real ``clusterwire dispatcher`` process) or
plugins.toml's ``[data_limits]`` takes effect; bad values are refused naming the limit; and
README's Reliability table is the dataclass's.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from clusterwire import data, errors
from clusterwire.cli import build_parser
from clusterwire.data.config import server_limits
from clusterwire.data.dispatcher_state import DispatcherState
from clusterwire.data.quotas import ServiceLimits, limit_names, parse_limit
from clusterwire.data.rpc import DispatcherClient
from clusterwire.plugins import PluginManager, set_plugin_manager
from clusterwire.protos.data_service_pb2 import (
    DataRequest,
    GetOrCreateJobRequest,
    JobInfo,
    JournalEntry,
    JournalJob,
    JournalMerge,
    JournalSplit,
)
from clusterwire.security import Security

pytestmark = pytest.mark.timeout(120)

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")

#: The module constants ServiceLimits replaced (dispatcher.py, dispatcher_state.py, worker.py,
#: streams.py, cross_trainer_cache.py), and limits added since (consumer_heartbeat_rate).
OLD_CONSTANTS = {"max_datasets": 1024, "max_dataset_bytes": 4 << 30, "max_jobs": 4096,
                 "max_handouts": 100_000, "max_merges": 1024,
                 "consumer_heartbeat_rate": 1000, "max_open_streams": 64,
                 "max_streams_per_consumer": 16, "idle_stream_s": 600.0,
                 "idle_split_stream_s": 30.0, "idle_cache_s": 10.0,
                 "stream_buffer_bytes": 16 << 20, "stream_buffer_elements": 8192,
                 "max_cached_jobs": 16, "max_cache_trainers": 1024,
                 "removed_jobs_kept": 16_384}


def test_the_defaults_are_the_old_constants():
    assert dataclasses.asdict(ServiceLimits()) == OLD_CONSTANTS
    config = data.DispatcherConfig()
    assert config.limits is None
    with _plugins_toml(None):
        assert server_limits(config) == ServiceLimits()


def _fill_datasets(target: str, count: int) -> None:
    """Register ``count`` datasets and a job for each (so none is unused: none displaced)."""
    client = DispatcherClient("grpc", target.split("://")[1], 10.0, Security())
    try:
        for n in range(count):
            dataset_id = data.register_dataset(target, data.Dataset.range(n + 1))
            client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
                dataset_id=dataset_id, job_key=f"uses/{dataset_id}")))
    finally:
        client.close()


def test_max_datasets_set_through_the_dispatcher_config_refuses_the_third():
    with data.DispatchServer(data.DispatcherConfig(limits={"max_datasets": 2})) as dispatcher:
        _fill_datasets(dispatcher.target, 2)
        with pytest.raises(errors.ResourceExhaustedError,
                           match=r"is full \(2 datasets, limits max_datasets\)"):
            data.register_dataset(dispatcher.target, data.Dataset.range(10))


def test_max_datasets_set_on_the_command_line_refuses_the_third(processes):
    dispatcher = processes("dispatcher", "--limit", "max_datasets=2", "--limit",
                           "max-jobs=10")
    _fill_datasets(dispatcher.target, 2)
    with pytest.raises(errors.ResourceExhaustedError,
                       match=r"is full \(2 datasets, limits max_datasets\)"):
        data.register_dataset(dispatcher.target, data.Dataset.range(10))


def test_the_dispatcher_state_keeps_max_handouts_and_max_merges_of_its_table():
    """A job of a DispatcherState with max_handouts = 2 and max_merges = 2 keeps a
    consumer's last 2 hand-outs (older positions cannot resume) and its last 2 merges."""
    state = DispatcherState(ServiceLimits(max_handouts=2, max_merges=2))
    state.apply(JournalEntry(job=JournalJob(job=JobInfo(job_id=1, dataset_id="d"),
                                            job_key="k", split_units=10, total_units=10)))
    for split in range(5):
        state.apply(JournalEntry(assign=JournalSplit(job_id=1, split_id=split,
                                                     consumer_id="a")))
    job = state.jobs[1]
    assert [split for split, _ in job.handouts["a"]] == [3, 4]
    assert job.handout_base["a"] == 3 and job.handout_index("a", 2) == -1
    for merge in ("m1", "m2", "m3"):
        state.apply(JournalEntry(merged=JournalMerge(job_id=1, merge_id=merge)))
    assert list(job.merges) == ["m2", "m3"]


class _plugins_toml:
    """Use a PluginManager reading ``text`` as plugins.toml (None: no file) in the block."""

    def __init__(self, text: str | None, tmp_path=None):
        self.path = None
        if text is not None:
            self.path = tmp_path / "plugins.toml"
            self.path.write_text(text)

    def __enter__(self):
        self.previous = set_plugin_manager(PluginManager(self.path or os.devnull))
        return self

    def __exit__(self, *exc):
        set_plugin_manager(self.previous)


def test_plugins_toml_sets_limits_under_the_config_and_command_line(tmp_path):
    with _plugins_toml("[data_limits]\nmax_jobs = 7\nmax_datasets = 2\nidle_cache_s = 2.5\n",
                       tmp_path):
        assert server_limits(data.DispatcherConfig()).max_jobs == 7
        worker = data.WorkerConfig(dispatcher_address="localhost:1",
                                   limits={"idle_cache_s": 1})
        assert (server_limits(worker).idle_cache_s, server_limits(worker).max_jobs) == (1, 7)
        explicit = data.DispatcherConfig(limits=ServiceLimits(max_jobs=3))
        assert server_limits(explicit) == ServiceLimits(max_jobs=3)
        with data.DispatchServer(data.DispatcherConfig()) as dispatcher:
            _fill_datasets(dispatcher.target, 2)
            with pytest.raises(errors.ResourceExhaustedError,
                               match=r"is full \(2 datasets, limits max_datasets\)"):
                data.register_dataset(dispatcher.target, data.Dataset.range(10))


def test_a_bad_plugins_toml_limit_names_the_file(tmp_path):
    with _plugins_toml("[data_limits]\nmax_jobs = -4\n", tmp_path) as toml, \
            pytest.raises(errors.InvalidArgumentError) as caught:
        server_limits(data.DispatcherConfig())
    assert str(toml.path) in caught.value.message
    assert "max_jobs = -4" in caught.value.message


@pytest.mark.parametrize("limits,message", [
    ({"max_jobz": 3}, r"Unknown data-service limit\(s\) \['max_jobz'\].*max_jobs"),
    ({"max_jobs": -1}, r"max_jobs = -1 must be a positive int \(default 4096\)"),
    ({"max_jobs": 0}, r"max_jobs = 0 must be a positive int"),
    ({"max_jobs": 2.5}, r"max_jobs = 2.5 must be a positive int"),
    ({"max_jobs": "10"}, r"max_jobs = '10' must be a positive int"),
    ({"idle_stream_s": True}, r"idle_stream_s = True must be a positive number of seconds"),
    ([("max_jobs", 1)], r"`limits` must be a ServiceLimits or a dict"),
])
def test_bad_limits_are_refused_naming_the_limit(limits, message):
    with pytest.raises(errors.InvalidArgumentError, match=message):
        data.DispatcherConfig(limits=limits)
    with pytest.raises(errors.InvalidArgumentError, match=message):
        data.WorkerConfig(dispatcher_address="localhost:1", limits=limits)


@pytest.mark.parametrize("server,text,message", [
    ("dispatcher", "max_jobs", r"give NAME=VALUE with NAME one of the dispatcher's limits"),
    ("dispatcher", "max_open_streams=3", r"one of the dispatcher's limits: max_datasets"),
    ("worker", "max_jobs=3", r"one of the worker's limits: max_open_streams"),
    ("worker", "idle_stream_s=soon", r"idle_stream_s='soon': the value must be a number"),
    ("dispatcher", "max_jobs=1.5", r"max_jobs='1.5': the value must be an int"),
])
def test_bad_command_line_limits_are_refused(server, text, message):
    with pytest.raises(errors.InvalidArgumentError, match=message):
        parse_limit(text, server)


def test_a_bad_command_line_limit_exits_1_naming_it():
    result = subprocess.run(
        [sys.executable, "-m", "clusterwire", "dispatcher", "--limit", "max_jobs=-2"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "InvalidArgumentError: Data-service limit max_jobs = -2 must be a positive int" \
        in result.stderr, result.stderr


def test_help_lists_each_servers_limits_with_their_defaults(capsys):
    for server in ("dispatcher", "worker"):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args([server, "--help"])
        assert exited.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        for name in limit_names(server):
            assert f"{name} (default {getattr(ServiceLimits, name)!r})" in text, name
        for name in set(limit_names()) - set(limit_names(server)):
            assert f"{name} (default" not in text, name


def _readme_table() -> str:
    def default(value: int | float) -> str:
        return f"{value:g} s" if isinstance(value, float) else f"{value:,}"

    rows = ["| limit | server | default | bounds | what a peer gets at the limit |",
            "|---|---|---|---|---|"]
    rows += [f"| `{f.name}` | {f.metadata['server']} | {default(f.default)} | "
             f"{f.metadata['bounds']} | {f.metadata['at_limit']} |"
             for f in dataclasses.fields(ServiceLimits)]
    return "\n".join("  " + row for row in rows)


def test_the_readme_table_is_the_dataclass():
    with open(README, encoding="utf-8") as handle:
        text = handle.read()
    found = re.search(r"<!-- service-limits:begin -->\n(.*?)\n?<!-- service-limits:end -->",
                      text, re.DOTALL)
    assert found, "README's Reliability list lost its service-limits block"
    assert found.group(1) == _readme_table(), (
        "README's data-service limits table differs from ServiceLimits; put this between "
        "the service-limits markers:\n" + _readme_table())
