"""The plugin manager: entry points, plugins.toml, validation and clear errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import TESTS_DIR, fresh_python

from clusterwire import ResolverSpec, TransportSpec, hookimpl
from clusterwire.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError
from clusterwire.plugins import PluginManager, get_plugin_manager, load_config


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def no_env_config(monkeypatch, tmp_path):
    monkeypatch.delenv("CLUSTERWIRE_PLUGINS", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(TESTS_DIR)


class Plugin:
    def __init__(self, *records, resolvers=()):
        self.records, self.resolvers = records, resolvers

    @hookimpl
    def clusterwire_add_transports(self):
        return list(self.records)

    @hookimpl
    def clusterwire_add_resolvers(self):
        return list(self.resolvers)


def test_builtin_grpc_comes_from_the_entry_point_with_its_distribution(no_env_config):
    manager = PluginManager()
    listing = {info.name: info for info in manager.listing()}
    grpc = listing["grpc"]
    assert grpc.kind == "transport"
    assert grpc.module == "clusterwire.transports.grpc"
    assert grpc.distribution == "clusterwire"
    assert grpc.version == "0.1.0"


def test_entry_points_load_lazily(no_env_config):
    manager = PluginManager()
    assert manager.pluggy.get_plugins() == set()
    assert "grpc" in manager.protocols()
    assert manager.pluggy.get_plugins()


def test_import_clusterwire_imports_no_transport():
    code = "import sys, clusterwire; print(sorted(m for m in sys.modules if 'grpc' in m))"
    assert fresh_python(code).strip() == "[]"


def test_duplicate_protocol_names_both_plugins_and_distributions(no_env_config):
    manager = PluginManager()
    manager.protocols()
    with pytest.raises(AlreadyExistsError) as info:
        manager.register(Plugin(TransportSpec("grpc", dict)), name="impostor")
    text = str(info.value)
    assert "'grpc'" in text and "'impostor'" in text and "distribution clusterwire" in text


@pytest.mark.parametrize("protocol", ["", "GRPC", "grpc+", "+x", "a b", "grpc://", 5])
def test_invalid_protocol_string_is_refused(no_env_config, protocol):
    with pytest.raises(InvalidArgumentError, match="invalid transport name"):
        PluginManager().register(Plugin(TransportSpec(protocol, dict)), name="bad")


def test_wrong_record_type_is_refused(no_env_config):
    with pytest.raises(InvalidArgumentError, match="expected clusterwire.plugins.TransportSpec"):
        PluginManager().register(Plugin(("grpc2", dict)), name="bad")


def test_resolvers_register_like_transports(no_env_config):
    manager = PluginManager()
    manager.register(Plugin(resolvers=[ResolverSpec("mine", dict)]), name="mine-plugin")
    assert "mine" in manager.resolver_names()
    assert manager.resolver_spec("mine").factory is dict
    with pytest.raises(NotFoundError, match="No cluster resolver registered for 'nope'"):
        manager.resolver_spec("nope")


@pytest.mark.parametrize("protocol,hint", [
    ("grpc+verbs", "pip install 'clusterwire[verbs]'"),
    ("zmq", "pip install ./plugins/clusterwire-zmq"),
    ("carrier-pigeon", None),
])
def test_unknown_protocol_lists_installed_and_names_the_provider(no_env_config, tmp_path,
                                                                protocol, hint):
    # Block the optional transports so the test sees them as not installed.
    path = write(tmp_path / "p.toml", 'block = ["grpc+verbs", "zmq"]\n')
    with pytest.raises(NotFoundError) as info:
        PluginManager(path).transport(protocol)
    text = str(info.value)
    assert f"No transport registered for {protocol!r}" in text
    assert "Installed: " in text and "grpc" in text
    if hint:
        assert hint in text


def test_plugins_toml_load_block_and_options(no_env_config, tmp_path):
    path = write(tmp_path / "custom.toml", """
        load = ["cw_test_plugin"]
        block = ["grpc"]
        [options.cw_test_plugin]
        depth = 3
        name = "x"
    """)
    manager = PluginManager(path)
    assert "dummy" in manager.protocols() and "grpc" not in manager.protocols()
    assert manager.transport("dummy").options == {"depth": 3, "name": "x"}
    assert manager.transport("dummy") is manager.transport("dummy")
    with pytest.raises(NotFoundError, match="Installed: dummy"):
        manager.transport("grpc")
    assert "grpc" not in {info.name for info in manager.listing()}


def test_config_found_through_env_then_cwd(no_env_config, tmp_path, monkeypatch):
    write(tmp_path / "plugins.toml", 'block = ["grpc"]\n')
    assert load_config().block == ["grpc"]
    other = write(tmp_path / "other.toml", 'load = ["cw_test_plugin"]\n')
    monkeypatch.setenv("CLUSTERWIRE_PLUGINS", other)
    assert load_config().load == ["cw_test_plugin"] and load_config().block == []
    assert load_config(tmp_path / "plugins.toml").block == ["grpc"]


def test_no_config_anywhere_means_defaults(no_env_config):
    config = load_config()
    assert (config.path, config.load, config.block, config.options) == (None, [], [], {})


def test_malformed_config_names_file_and_line(no_env_config, tmp_path):
    path = write(tmp_path / "broken.toml", 'load = ["a"]\nblock = [\n"x" "y"]\n')
    with pytest.raises(InvalidArgumentError) as info:
        load_config(path)
    assert "broken.toml" in str(info.value) and "line 3" in str(info.value)


@pytest.mark.parametrize("text,match", [
    ('load = "cw_test_plugin"\n', "'load' must be a list of strings"),
    ("block = [1]\n", "'block' must be a list of strings"),
    ("plugins = []\n", "unknown key"),
    ("[options]\ngrpc = 1\n", "one table per plugin"),
])
def test_invalid_config_values(no_env_config, tmp_path, text, match):
    with pytest.raises(InvalidArgumentError, match=match):
        load_config(write(tmp_path / "p.toml", text))


def test_named_config_that_does_not_exist(no_env_config, tmp_path):
    with pytest.raises(NotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_unimportable_load_module_is_a_clear_error(no_env_config, tmp_path):
    path = write(tmp_path / "p.toml", 'load = ["no_such_module_xyz"]\n')
    with pytest.raises(NotFoundError, match="cannot load plugin module 'no_such_module_xyz'"):
        PluginManager(path).protocols()


def test_repo_plugins_toml_is_valid_and_changes_nothing():
    config = load_config(os.path.join(TESTS_DIR, "..", "plugins.toml"))
    assert config.block == [] and config.load == []


def test_third_party_entry_point_is_discovered(tmp_path):
    """A distribution installed beside clusterwire registers through the entry point group."""
    dist = tmp_path / "cw_fake_transport-2.5.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: cw-fake-transport\n"
                                   "Version: 2.5\n")
    (dist / "entry_points.txt").write_text("[clusterwire]\nfake = cw_fake_transport\n")
    (tmp_path / "cw_fake_transport.py").write_text(textwrap.dedent("""
        from clusterwire import TransportSpec, hookimpl

        from clusterwire.errors import UnimplementedError

        def needs_hardware(options):
            raise UnimplementedError("needs a quantum NIC: pip install 'fake[qnic]'")

        @hookimpl
        def clusterwire_add_transports():
            return [TransportSpec("fake", lambda options: "a fake transport"),
                    TransportSpec("afake", needs_hardware)]
    """))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("CLUSTERWIRE_PLUGINS", None)
    out = subprocess.run([sys.executable, "-m", "clusterwire", "plugins"], capture_output=True,
                         text=True, timeout=60, env=env, cwd=tmp_path, check=True).stdout
    lines = out.splitlines()[1:]
    rows = {line.split()[1]: line.split() for line in lines}
    assert rows["fake"] == ["transport", "fake", "cw_fake_transport", "cw-fake-transport", "2.5",
                            "yes"]
    assert rows["grpc"][3:] == ["clusterwire", "0.1.0", "yes"]
    # A protocol that cannot run here says why and what fixes it.
    assert lines[0].split(None, 5)[:5] == ["transport", "afake", "cw_fake_transport",
                                           "cw-fake-transport", "2.5"]
    assert lines[0].endswith("no: needs a quantum NIC: pip install 'fake[qnic]'")
    # Stable order: transports, then resolvers, each by name.
    kinds_names = [(line.split()[0], line.split()[1]) for line in lines]
    assert kinds_names == sorted(kinds_names, key=lambda kn: (kn[0] != "transport", kn))


def test_a_broken_plugin_does_not_take_the_others_down(tmp_path):
    """A distribution whose plugin module fails to import: grpc still works, its protocol errs."""
    dist = tmp_path / "cw_broken-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: cw-broken\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[clusterwire]\nbroken = cw_broken_plugin\n")
    (tmp_path / "cw_broken_plugin.py").write_text("import no_such_dependency_xyz\n")
    code = textwrap.dedent("""
        import clusterwire
        with clusterwire.Server({"w": ["127.0.0.1:0"]}) as server:
            print("GRPC", clusterwire.Session(server.target).status()["protocol"])
        try:
            clusterwire.Server({"w": ["127.0.0.1:0"]}, protocol="broken")
        except clusterwire.errors.NotFoundError as err:
            print("ERROR", err)
    """)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("CLUSTERWIRE_PLUGINS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env, cwd=tmp_path).stdout
    assert "GRPC grpc" in out
    assert ("Plugin 'broken' (distribution cw-broken 1.0) failed to load: "
            "ModuleNotFoundError") in out
    listing = subprocess.run([sys.executable, "-m", "clusterwire", "plugins"],
                             capture_output=True, text=True, timeout=60, env=env,
                             cwd=tmp_path).stdout
    assert any(line.split()[:2] == ["broken", "broken"] for line in listing.splitlines())


@pytest.mark.parametrize("typo, meant", [("grcp", "grpc"), ("grpc+loca", "grpc+local"),
                                         ("gprc", "grpc")])
def test_a_misspelt_protocol_suggests_the_closest_name(typo, meant):
    with pytest.raises(NotFoundError, match=f"Did you mean '{re.escape(meant)}'"):
        get_plugin_manager().transport(typo)


def test_a_misspelt_resolver_suggests_the_closest_name():
    with pytest.raises(NotFoundError, match="Did you mean 'slurm'"):
        get_plugin_manager().resolver_spec("slrum")
