"""clusterwire.testing.hosts as a library: a server on one emulated host reached from
another, cut and healed; tasks forked from each host's zygote, in the host's namespace and
environment; the errors for a machine without namespaces and for bad arguments; importable
without pytest."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import child_env, wait_for
from emulated_hosts import requires_netns

import clusterwire.testing.hosts as hosts_module
from clusterwire import errors
from clusterwire.testing.hosts import EmulatedHosts

PORT = 2222


def namespace_of(pid: int) -> str:
    """The name of the network namespace process ``pid`` is in ('' for the root one)."""
    done = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True,
                          text=True, check=True, timeout=10)
    return done.stdout.strip()


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def environment_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as environ:
        pairs = environ.read().decode().split("\0")
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


def can_fetch(client: hosts_module.Interpreter, target: str) -> bool:
    try:
        return client.eval(f"clusterwire.Session({target!r}, timeout=1).get('x').tolist()") == [
            0, 1, 2]
    except (errors.UnavailableError, errors.DeadlineExceededError):
        return False


@requires_netns
@pytest.mark.timeout(90)
def test_a_server_on_one_host_is_reached_from_another_lost_when_cut_and_back_when_healed():
    with EmulatedHosts(2) as hosts:
        assert len(hosts) == 2 and [h.address for h in hosts] == ["192.0.2.10", "192.0.2.11"]
        cluster = json.dumps({"a": [f"{hosts[0].address}:{PORT}"]})
        server = hosts[0].serve("serve", "--cluster", cluster, "--job-name", "a",
                                "--task-index", "0", env=child_env()).wait_ready()
        assert server.target == f"grpc://{hosts[0].address}:{PORT}"
        assert namespace_of(server.process.pid) == hosts[0].name
        client = hosts[1].interpreter(child_env())
        assert namespace_of(client.eval("__import__('os').getpid()")) == hosts[1].name
        client.exec(f"import numpy as np, clusterwire\n"
                    f"clusterwire.Session({server.target!r}, timeout=10).put('x', np.arange(3))")
        assert can_fetch(client, server.target)

        hosts.cut(0)
        assert not can_fetch(client, server.target)
        assert server.process.poll() is None  # cut off, not dead
        hosts.heal(0)
        wait_for(lambda: can_fetch(client, server.target), timeout=15, what="healed")
        zygote = parent_of(server.process.pid)
    # Leaving the block ends the task, its zygote and the namespaces.
    assert server.process.poll() is not None
    assert not any(name.startswith(hosts.prefix) for name in hosts_module._namespaces())
    with pytest.raises(ProcessLookupError):
        os.kill(zygote, 0)


@requires_netns
@pytest.mark.timeout(120)
def test_a_hosts_tasks_are_forks_of_one_zygote_per_environment_in_the_hosts_namespace():
    tasks = 8
    with EmulatedHosts(1) as hosts:
        host = hosts[0]
        cluster = json.dumps({"w": [f"{host.address}:0"] * tasks})
        started = [host.serve("serve", "--cluster", cluster, "--job-name", "w",
                              "--task-index", str(i), env=child_env()) for i in range(tasks)]
        other = host.serve("serve", "--cluster", json.dumps({"o": [f"{host.address}:0"]}),
                           "--job-name", "o", "--task-index", "0",
                           env={**child_env(), "CW_HOSTS_MARK": "other"})
        for served in [*started, other]:
            served.wait_ready()
        addresses = {served.address for served in started}
        assert len(addresses) == tasks and all(
            a.startswith(host.address + ":") for a in addresses)
        zygotes = {parent_of(served.process.pid) for served in started}
        assert len(zygotes) == 1  # forked, not each an interpreter of its own
        (zygote,) = zygotes
        with open(f"/proc/{zygote}/cmdline", "rb") as cmdline:
            assert cmdline.read().split(b"\0")[1:3] == [b"-m", b"clusterwire.zygote"]
        assert namespace_of(zygote) == host.name
        assert "CW_HOSTS_MARK" not in environment_of(started[0].process.pid)
        # Another environment: another zygote, started with it.
        assert parent_of(other.process.pid) != zygote
        assert environment_of(other.process.pid)["CW_HOSTS_MARK"] == "other"
        # A task that cannot serve is reported with what it wrote.
        broken = host.serve("serve", "--cluster", "{not json", "--job-name", "w",
                            "--task-index", "0", env=child_env())
        with pytest.raises(errors.UnavailableError,
                           match=r"did not serve .*: clusterwire: invalid --cluster '\{not json'"):
            broken.wait_ready(timeout=30)
        assert broken.process.wait(10) == 1
    assert all(served.process.poll() is not None for served in started)


def test_no_namespaces_is_a_clear_error_naming_the_fix(monkeypatch):
    reason = ("emulated hosts need root (ip netns add, veth and bridge devices need "
              "CAP_SYS_ADMIN and CAP_NET_ADMIN): run as root, e.g. with sudo")
    monkeypatch.setattr(hosts_module, "netns_available", lambda: (False, reason))
    monkeypatch.setattr(hosts_module, "remove_stale", lambda: pytest.fail("touched ip"))
    with pytest.raises(errors.FailedPreconditionError) as raised:
        EmulatedHosts(2)
    assert raised.value.message == f"Cannot make emulated hosts: {reason}."


def test_the_probe_names_what_is_missing(monkeypatch):
    probe = hosts_module._probe.__wrapped__  # uncached
    monkeypatch.setattr(hosts_module.os, "geteuid", lambda: 1000)
    assert "need root" in probe() and "sudo" in probe()
    monkeypatch.setattr(hosts_module.os, "geteuid", lambda: 0)
    monkeypatch.setattr(hosts_module.shutil, "which", lambda name: None)
    assert "`ip` command" in probe() and "install iproute2" in probe()
    monkeypatch.setattr(hosts_module.sys, "platform", "darwin")
    assert "this is darwin" in probe()


@pytest.mark.parametrize("count", [0, -1, 245, 2.0, True, "3"])
def test_a_host_count_out_of_range_is_refused(count):
    with pytest.raises(errors.InvalidArgumentError, match=f"1 to 244 hosts .* got {count!r}"):
        EmulatedHosts(count)


@requires_netns
@pytest.mark.timeout(60)
def test_a_partition_must_place_every_host_once():
    with EmulatedHosts(3) as hosts:
        for groups in [({0, 1},), ({0, 1}, {1, 2}), ({0, 1}, {2, 3})]:
            with pytest.raises(errors.InvalidArgumentError, match="exactly one group"):
                hosts.partition(*groups)


def test_the_library_imports_without_pytest():
    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('pytest', '_pytest'):\n"
               "            raise ImportError(name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "import clusterwire.testing.hosts as h\n"
               "print(callable(h.netns_available), 'pytest' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["True", "False"], done.stderr


@requires_netns
@pytest.mark.timeout(90)
def test_the_readme_example_runs_as_written(tmp_path):
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("\n### Rehearse a cluster on one machine\n"):]
    snippet = re.search(r"```python\n(.*?)```", section, re.S)[1]
    (tmp_path / "snippet.py").write_text(snippet)
    done = subprocess.run([sys.executable, "snippet.py"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "1\n"), done.stderr


@requires_netns
@pytest.mark.timeout(60)
def test_an_interpreter_raises_what_was_raised_there_and_gives_up_after_its_timeout():
    with EmulatedHosts(1) as hosts:
        python = hosts[0].interpreter()
        with pytest.raises(ZeroDivisionError) as raised:
            python.eval("1 / 0")
        assert "(192.0.2.10)" in str(raised.value.__cause__)
        python.exec("import threading; never = threading.Event()")
        with pytest.raises(errors.DeadlineExceededError, match="no answer within 0.5 s"):
            python.exec("never.wait()", timeout=0.5)
        with pytest.raises(errors.UnavailableError, match="unusable"):
            python.eval("1")
