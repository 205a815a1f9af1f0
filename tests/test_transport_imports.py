"""Built-in transports import only their own modules and the shared support package; the zmq
plugin imports no built-in transport's module (nor that package); clusterwire and its data
service never import torch or jax (only the framework adapters do)."""

from __future__ import annotations

import ast
import pathlib

import pytest
from conftest import fresh_python

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = "_grpc_common"


def _imported(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("clusterwire.transports.")}


@pytest.mark.parametrize("transport", ["grpc", "local", "verbs", SHARED])
def test_a_built_in_transport_imports_no_other_transport(transport):
    allowed = (f"clusterwire.transports.{transport}", f"clusterwire.transports.{SHARED}")
    for path in (ROOT / "transports" / transport).glob("*.py"):
        foreign = {n for n in _imported(path) if not n.startswith(allowed)}
        assert not foreign, f"{path.relative_to(ROOT)} imports {sorted(foreign)}"


def test_the_zmq_plugin_imports_no_built_in_transport():
    for path in (ROOT / "plugins" / "clusterwire-zmq" / "clusterwire_zmq").glob("*.py"):
        assert not _imported(path), f"{path.relative_to(ROOT)} imports a built-in transport"


def test_clusterwire_and_its_data_service_never_import_torch_or_jax():
    adapters = ("__init__", "torch_dataset", "jax_iterator")
    modules = sorted(f"clusterwire.data.{path.stem}" for path in (ROOT / "core" / "data").glob(
        "*.py") if path.stem not in adapters)
    code = (f"import sys, clusterwire, clusterwire.data\nfor name in {modules!r}:\n"
            "    __import__(name)\n"
            "from clusterwire.data import Dataset, distribute\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax')))")
    assert fresh_python(code).strip() == "[]"
