"""README blocks a newcomer pastes work as pasted: plugins.toml is the repository's, the
Security snippet runs with the certificates the README makes, and the framework blocks and
install commands take one framework each, in its CPU build."""

from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import sys

import cw_install_hints as install
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from clusterwire.plugins import PluginManager

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _section(heading: str) -> str:
    start = README.index(f"\n{heading}\n")
    found = re.search(r"\n##+ ", README[start + len(heading) + 2:])
    return README[start:start + len(heading) + 2 + found.start()] if found else README[start:]


def _blocks(heading: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", _section(heading), re.S)


def test_the_plugins_toml_block_is_the_repositorys_file(tmp_path):
    block, = _blocks("## plugins.toml", "toml")
    repository = (ROOT / "plugins.toml").read_text(encoding="utf-8")
    assert tomllib.loads(block) == tomllib.loads(repository)
    for line in block.splitlines():  # the commented examples are the file's too
        if line.startswith("# "):
            assert line.split("  #")[0].rstrip() in repository.splitlines(), line
    pasted = tmp_path / "plugins.toml"
    pasted.write_text(block)
    manager = PluginManager(pasted)
    assert "grpc" in manager.protocols()


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl on the PATH")
def test_the_security_snippet_runs_with_the_certificates_the_readme_makes(tmp_path):
    recipe, = _blocks("## Security", "sh")[:1]
    made = subprocess.run(["bash", "-e", "-c", recipe], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60,
                          env={"PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin"})
    assert made.returncode == 0, made.stderr
    assert oct((tmp_path / "cluster-token").stat().st_mode & 0o777) == "0o600"
    snippet = _blocks("## Security", "python")[0]
    (tmp_path / "snippet.py").write_text(snippet)
    ran = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.strip() == "1"


def _imported(code: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(code.replace("...", "pass"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_each_framework_block_imports_its_framework_only():
    install_block, = _blocks("### PyTorch and JAX", "sh")
    torch_block, jax_block = _blocks("### PyTorch and JAX", "python")
    assert "torch" in _imported(torch_block) and "jax" not in _imported(torch_block)
    assert "clusterwire.data.jax_iterator" not in str(_imported(torch_block))
    assert "jax" not in _imported(jax_block) and "torch" not in _imported(jax_block)
    assert "clusterwire.data.jax_iterator.JaxIterator" in _imported(jax_block)
    # What a skipped test tells the reader is what the README says, CPU build first.
    commands = [line for line in install_block.splitlines() if line.startswith("pip ")]
    assert " && ".join(commands[:2]) == install.TORCH and commands[2] == install.JAX
    assert CPU_INDEX in install.TORCH


@pytest.mark.parametrize("example", ["train_torch.py", "train_torch_parquet.py"])
def test_the_torch_examples_say_to_install_the_cpu_build_first(example):
    docstring = ast.get_docstring(ast.parse((ROOT / "examples" / example).read_text()))
    commands = [line.strip() for line in docstring.splitlines()
                if line.strip().startswith("pip install")]
    assert commands[0].startswith(f"pip install torch {CPU_INDEX}")
    assert commands[1].startswith("pip install 'clusterwire[torch")
