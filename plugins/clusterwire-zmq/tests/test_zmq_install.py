"""Installing clusterwire-zmq makes "zmq" work; without the distribution it is a clear error.

The "absent" case runs a real interpreter whose site-packages holds everything installed
here except the files ``pip uninstall clusterwire-zmq`` would remove (from the
distribution's RECORD), so the plugin manager finds no entry point, exactly as after an
uninstall, without touching the shared environment.
"""

from __future__ import annotations

import importlib.metadata
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from clusterwire import Server, Session

DIST = "clusterwire-zmq"
pytestmark = pytest.mark.timeout(60)


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for variable in ("CLUSTERWIRE_PLUGINS", "PYTHONPATH"):
        env.pop(variable, None)
    return env


def test_distribution_metadata_registers_the_entry_point():
    dist = importlib.metadata.distribution(DIST)
    assert dist.version == "0.1.0"
    entry_points = [(ep.name, ep.value) for ep in dist.entry_points if ep.group == "clusterwire"]
    assert entry_points == [("zmq", "clusterwire_zmq")]
    requires = " ".join(dist.requires or [])
    assert "clusterwire" in requires and "pyzmq" in requires


def test_server_and_session_use_zmq_when_installed():
    with Server({"w": ["127.0.0.1:0"]}, protocol="zmq") as server, \
            Session(server.target, timeout=20) as session:
        assert server.target.startswith("zmq://127.0.0.1:")
        session.put("x", np.arange(6.0))
        assert session.get("x").tolist() == [0, 1, 2, 3, 4, 5]
        status = session.status()
        assert status["protocol"] == "zmq" and "ROUTER/DEALER" in status["transport"]["control"]


def test_clusterwire_plugins_lists_the_distribution_and_version(tmp_path):
    out = subprocess.run([sys.executable, "-m", "clusterwire", "plugins"], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path, env=_clean_env(), check=True).stdout
    rows = {line.split()[1]: line.split() for line in out.splitlines()[1:]}
    assert rows["zmq"] == ["transport", "zmq", "clusterwire_zmq", DIST, "0.1.0", "yes"]


@pytest.fixture(scope="module")
def site_without_plugin(tmp_path_factory) -> list[Path]:
    """Site directories mirrored with symlinks, minus the distribution's recorded files."""
    dist = importlib.metadata.distribution(DIST)
    home = Path(dist.locate_file("")).resolve()
    removed = {Path(str(f)).parts[0] for f in dist.files or []}
    assert removed, "the distribution records no files"
    mirrors = []
    for index, source in enumerate(_site_dirs()):
        mirror = tmp_path_factory.mktemp(f"site{index}")
        for entry in source.iterdir():
            if entry.name == "__pycache__" or (source == home and entry.name in removed):
                continue
            (mirror / entry.name).symlink_to(entry)
        mirrors.append(mirror)
    return mirrors


def _site_dirs() -> list[Path]:
    """Every site directory this interpreter imports from (a venv's included)."""
    found = [*site.getsitepackages(), site.getusersitepackages()]
    found += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    unique = dict.fromkeys(Path(p).resolve() for p in found)
    return [p for p in unique if p.is_dir()]


def _run_isolated(site_dirs: list[Path], code: str, cwd: Path) -> str:
    """``code`` in an interpreter that sees only the stdlib and ``site_dirs``."""
    prelude = "import site\n" + "".join(f"site.addsitedir({str(d)!r})\n" for d in site_dirs)
    done = subprocess.run([sys.executable, "-I", "-S", "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60, cwd=cwd,
                          env=_clean_env())
    assert done.returncode == 0, done.stderr
    return done.stdout


_PROBE = """
    import importlib.util
    from clusterwire import Server, errors
    from clusterwire.cli import main

    print("FOUND", importlib.util.find_spec("clusterwire_zmq") is not None)
    Server({"w": ["127.0.0.1:0"]}, protocol="grpc").stop()
    try:
        Server({"w": ["127.0.0.1:0"]}, protocol="zmq").stop()
        print("ZMQ OK")
    except errors.NotFoundError as err:
        print("NOT FOUND:", err)
    main(["plugins"])
"""


def test_without_the_distribution_zmq_is_not_found_naming_the_package(site_without_plugin,
                                                                       tmp_path):
    out = _run_isolated(site_without_plugin, _PROBE, tmp_path)
    assert "FOUND False" in out  # the environment is otherwise whole: grpc served above
    assert "NOT FOUND: No transport registered for 'zmq'" in out
    assert "pip install ./plugins/clusterwire-zmq" in out
    listed = [line.split()[1] for line in out.splitlines() if line.startswith("transport")]
    assert "grpc" in listed and "zmq" not in listed


def test_the_isolated_interpreter_finds_the_plugin_when_installed(tmp_path):
    """The control: the same harness over the real site directories finds "zmq"."""
    out = _run_isolated(_site_dirs(), _PROBE, tmp_path)
    assert "FOUND True" in out and "ZMQ OK" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("transport")]
    assert ["transport", "zmq", "clusterwire_zmq", DIST, "0.1.0", "yes"] in rows
