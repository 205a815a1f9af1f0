"""Resolvers as plugins, optional dependencies, Server.from_resolver and the CLI's --resolver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import fresh_python

from clusterwire import ResolverSpec, Server, Session, errors, hookimpl
from clusterwire.cli import main
from clusterwire.local_cluster import READY_PREFIX
from clusterwire.plugins import PluginManager
from clusterwire.resolvers import (
    AWSClusterResolver,
    ClusterResolver,
    GCEClusterResolver,
    KubernetesClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
)

BUILT_IN = {"aws", "gce", "kubernetes", "simple", "slurm", "tfconfig", "union"}
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("CLUSTERWIRE_PLUGINS", raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)


def test_built_in_resolvers_come_from_entry_points(clean_env):
    manager = PluginManager()
    assert set(manager.resolver_names()) >= BUILT_IN
    listed = {i.name: i for i in manager.listing() if i.kind == "resolver"}
    for name in BUILT_IN:
        assert listed[name].module == f"clusterwire.resolvers.{name}"
        assert listed[name].distribution == "clusterwire"


class ThirdParty:
    """What a third-party package's plugin module looks like."""

    @hookimpl
    def clusterwire_add_resolvers(self):
        return [ResolverSpec("fixed", lambda **kw: SimpleClusterResolver(
            {"worker": ["127.0.0.1:0"]}, task_type="worker", task_id=0, **kw))]


def test_third_party_resolver_and_blocking_a_built_in(clean_env, tmp_path):
    (tmp_path / "plugins.toml").write_text('block = ["aws"]\n')
    manager = PluginManager()
    manager.register(ThirdParty(), name="third-party")
    assert "fixed" in manager.resolver_names() and "aws" not in manager.resolver_names()
    resolver = manager.resolver_spec("fixed").factory(rpc_layer="grpc")
    with Server.from_resolver(resolver) as server:
        assert server.target.startswith("grpc://127.0.0.1:")


@pytest.mark.parametrize(("module", "build", "extra"), [
    ("boto3", lambda: AWSClusterResolver({"cluster": "x"}), "aws"),
    ("googleapiclient.discovery",
     lambda: GCEClusterResolver("p", "z", "g", 8470, credentials=None), "gce"),
    ("kubernetes.config", lambda: KubernetesClusterResolver(), "kubernetes"),
])
def test_missing_optional_dependency_names_the_extra(monkeypatch, module, build, extra):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    with pytest.raises(ImportError, match=rf"pip install 'clusterwire\[{extra}\]'") as info:
        build()
    assert isinstance(info.value, errors.FailedPreconditionError)


def test_loading_resolver_plugins_imports_no_optional_dependency():
    code = ("import sys\n"
            "import clusterwire.resolvers\n"
            "from clusterwire.plugins import get_plugin_manager\n"
            "names = get_plugin_manager().resolver_names()\n"
            "optional = ('boto3', 'botocore', 'googleapiclient', 'google.auth', 'kubernetes')\n"
            "print(sorted(m for m in optional\n"
            "             if m in sys.modules), names)\n")
    assert fresh_python(code, timeout=30).startswith("[] ")


def test_server_from_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["127.0.0.1:0"], "worker": ["127.0.0.1:1"]},
        "task": {"type": "chief", "index": 0}, "rpc_layer": "grpc"}))
    resolver = TFConfigClusterResolver()
    assert isinstance(resolver, ClusterResolver)
    with Server(resolver) as server, Session(server.target) as session:
        status = session.status()
        assert (status["job"], status["task_index"]) == ("chief", 0)
        assert status["cluster"].task_address("worker", 0) == "127.0.0.1:1"


def test_server_from_a_resolver_without_a_task_is_refused():
    resolver = SimpleClusterResolver({"worker": ["127.0.0.1:0"]})
    with pytest.raises(errors.InvalidArgumentError, match="does not say which task"):
        Server.from_resolver(resolver)


def test_resolve_command_prints_cluster_task_and_master(monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"ps": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
        "task": {"type": "worker", "index": 1}}))
    assert main(["resolve", "--resolver", "tfconfig", "--resolver-arg", "rpc_layer=grpc"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"cluster": {"ps": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
                       "task_type": "worker", "task_id": 1, "master": "grpc://h2:2222",
                       "rpc_layer": "grpc"}


def test_resolve_errors_are_one_line(monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", "{oops")
    assert main(["resolve", "--resolver", "tfconfig"]) == 1
    assert "TF_CONFIG is not valid JSON" in capsys.readouterr().err
    assert main(["resolve", "--resolver", "nope"]) == 1
    assert "No cluster resolver registered for 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        main(["resolve", "--resolver", "tfconfig", "--resolver-arg", "novalue"])
    with pytest.raises(SystemExit, match="like ps=1,worker=3"):
        main(["resolve", "--resolver", "slurm", "--jobs", "ps:1"])


def test_serve_with_resolver_until_sigterm():
    env = {**os.environ, "TF_CONFIG": json.dumps({
        "cluster": {"worker": ["127.0.0.1:0"]}, "task": {"type": "worker", "index": 0}})}
    proc = subprocess.Popen([sys.executable, "-m", "clusterwire", "serve", "--resolver",
                             "tfconfig", "--quiet"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), proc.stderr.read()
        with Session(line[len(READY_PREFIX):].strip()) as session:
            assert session.status()["job"] == "worker"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_serve_needs_a_cluster_or_a_resolver_not_both():
    with pytest.raises(SystemExit, match="--cluster JSON or --resolver NAME"):
        main(["serve"])
    with pytest.raises(SystemExit, match="not both"):
        main(["serve", "--resolver", "tfconfig", "--cluster", '{"w": ["127.0.0.1:0"]}'])
