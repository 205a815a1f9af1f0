"""Output a terminal can trust (issue 29): what ``top``, ``status``, ``plugins``, the CLI's
error line and log lines print of a string from the network. The hostile servers are real
processes (tests/cw_hostile_server.py); the dead tasks are real listening sockets that
accept and never answer, so every connection to them is counted."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import TESTS_DIR, child_env, end_child, in_process_data_service
from cw_hostile_server import HOSTILE, HUGE, PREFIXED
from test_top import Tmux, wait_for_screen

from clusterwire import top
from clusterwire.local_cluster import await_ready
from clusterwire.terminal_text import (
    LOG_CHARS,
    TerminalFormatter,
    printable,
    printable_lines,
)

pytestmark = pytest.mark.timeout(120)

#: HOSTILE as printable() shows it: every sequence visible, none acted on.
SHOWN = (r"\x1b]0;pwned\x07\x1b[2J\x1b]8;;evil.example/x\x07link\x1b]8;;\x07"
         r"[/pwned][bold]x\u202eevil\u202c\x00\x9b31m\x7f")


#: The error of an address whose host is HOSTILE (no host at all), as printed.
REFUSED = f"InvalidArgumentError: Address '{SHOWN}:1' has a host"


def raw_controls(data: bytes) -> set[str]:
    """What in ``data`` (UTF-8, strictly) a terminal would act on or render deceptively:
    every character ``str.isprintable()`` refuses, but the newline."""
    return {repr(char) for char in data.decode("utf-8") if char != "\n"
            and not char.isprintable()}


# -- the rule ---------------------------------------------------------------------------


def test_printable_escapes_every_control_and_keeps_the_rest_readable():
    assert printable(HOSTILE) == SHOWN
    assert printable("tab\there\r\nnext \\ é 中 ok") == r"tab\there\r\nnext \ é 中 ok"
    # C1 controls, NBSP, zero-width and line separators, BOM, private use, a tag character.
    for char, shown in (("\x85", r"\x85"), ("\xa0", r"\xa0"), ("\u200b", r"\u200b"),
                        ("\u2028", r"\u2028"), ("\ufeff", r"\ufeff"), ("\ue000", r"\ue000"),
                        ("\U000e0041", r"\U000e0041"), ("\u2067", r"\u2067")):
        assert printable(f"a{char}b") == f"a{shown}b"
    # A message quoting a value with repr reads the same.
    assert printable(f"name {HOSTILE!r}") == f"name {HOSTILE!r}"
    assert printable(42) == "42" and printable("plain") == "plain"


def test_printable_bounds_the_length_and_says_what_it_cut():
    assert printable("x" * 5000, 100) == "x" * 100 + "...(+4900 characters)"
    cut = printable("\x1b" * 5000, 100)
    assert cut == r"\x1b" * 25 + "...(+4975 characters)"
    assert printable("ab\x1b", 5) == "ab...(+1 characters)"  # an escape is never split
    started = time.monotonic()
    assert len(printable(HUGE * 64)) < 1100  # 64 MB in, the first 1024 characters looked at
    assert time.monotonic() - started < 1


def test_printable_lines_keep_line_breaks_and_bound_their_number():
    assert printable_lines("a\x1b[2J\nb\u202e") == "a\\x1b[2J\nb\\u202e"
    assert printable_lines("x\n" * 500, lines=3) == "x\nx\nx\n...(+498 lines)"


def test_the_log_formatter_escapes_message_arguments_and_tracebacks():
    formatter = TerminalFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("clusterwire", logging.WARNING, __file__, 1,
                               "worker %s failed: %s", (HOSTILE + ":1", "bad\nforged line"),
                               None)
    assert formatter.format(record) == (
        f"WARNING worker {SHOWN}:1 failed: bad\\nforged line")
    try:
        raise RuntimeError(HOSTILE)
    except RuntimeError:
        record = logging.LogRecord("clusterwire", logging.ERROR, __file__, 1, "failed", (),
                                   sys.exc_info())
    logging.Formatter().format(record)  # another handler's first: it caches its traceback
    lines = formatter.format(record).split("\n")
    assert lines[0] == "ERROR failed" and lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == f"RuntimeError: {SHOWN}"
    record.exc_info = None  # a record that came with its traceback as text
    assert formatter.format(record).split("\n")[-1] == f"RuntimeError: {SHOWN}"
    huge = logging.LogRecord("clusterwire", logging.WARNING, __file__, 1, "%s", (HUGE,), None)
    assert len(formatter.format(huge)) < LOG_CHARS + 100


def test_import_clusterwire_escapes_the_last_resort_log_handler():
    """An application that configured no logging prints clusterwire's warnings through
    logging's last-resort handler: escaped, every line."""
    code = ("import logging, sys, clusterwire\n"
            f"logging.getLogger('clusterwire.data.reader').warning('worker %s', {HOSTILE!r})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert done.returncode == 0 and done.stderr.decode() == f"worker {SHOWN}\n"


# -- the commands against a hostile server ----------------------------------------------


@contextlib.contextmanager
def hostile_server(kind: str, tmp_path, listed: list[str] = (), rotate: int = 0):
    """The hostile server of ``kind`` ("task", "dispatcher", "invalid", "stalling"), also
    listing ``listed`` (with ``rotate``, the next ``rotate`` of them in each reply); yields
    its address."""
    listed_file = tmp_path / f"listed-{kind}.json"
    listed_file.write_text(json.dumps(list(listed)))
    process = subprocess.Popen(
        [sys.executable, os.path.join(TESTS_DIR, "cw_hostile_server.py"), kind,
         str(listed_file), str(rotate)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, **child_env()})
    try:
        address = await_ready(process, 60)
        assert address is not None, "the hostile server did not start"
        yield address
    finally:
        end_child(process, 20)


def clusterwire(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterwire", *args], capture_output=True,
                          timeout=timeout, env={**os.environ, **child_env()})


def test_top_once_shows_a_hostile_task_escaped(tmp_path):
    with hostile_server("task", tmp_path) as address:
        result = clusterwire("top", f"grpc://{address}", "--once", "--interval", "0.2",
                             "--timeout", "5")
    assert result.returncode == 1, result.stderr  # task 1's host is not a host
    assert raw_controls(result.stdout) == raw_controls(result.stderr) == set()
    out = result.stdout.decode()
    # The names and addresses as cells (cut to 128 characters), the errors whole.
    assert f"/job:{SHOWN[:100]}" in out
    assert f"/job:worker/task:2: {SHOWN}" in out  # the UNAVAILABLE message of a task
    assert f"/job:worker/task:1: {REFUSED}" in out
    assert "[/pwned][bold]x" in out  # markup shown, not applied and not a MarkupError
    assert f"/job:{SHOWN}/task:7" in out  # an unreachable peer
    assert len(out) < 100_000
    assert "Traceback" not in result.stderr.decode()


def test_top_names_an_invalid_cluster_escaped(tmp_path):
    with hostile_server("invalid", tmp_path) as address:
        result = clusterwire("top", f"grpc://{address}", "--once", "--timeout", "5")
    assert result.returncode == 1
    assert raw_controls(result.stderr) == set()
    assert result.stderr.decode().startswith(
        f"clusterwire top: InternalError: The task at grpc://{address} reported an invalid "
        f"cluster: Invalid job name {HOSTILE!r}: use letters")


def test_top_once_shows_a_hostile_dispatcher_escaped(tmp_path):
    with hostile_server("dispatcher", tmp_path) as address:
        result = clusterwire("top", "--dispatcher", address, "--once", "--interval", "0.2",
                             "--timeout", "5")
    assert result.returncode == 1, result.stderr
    assert raw_controls(result.stdout) == raw_controls(result.stderr) == set()
    out = result.stdout.decode()
    jobs = {cells[1]: cells for line in out.splitlines()
            if len(cells := [c.strip() for c in line.split("│")[1:-1]]) == 8}
    assert jobs["[/pwned]"][0] == "2" and jobs["[bold]x"][0] == "3"
    assert jobs[SHOWN][2] == SHOWN  # name and processing mode
    assert any(name.startswith("HHHH") and name.endswith("characters)") for name in jobs)
    # The worker's address and its error (which wraps in the dispatcher's view).
    assert f"{SHOWN}:1: InvalidArgumentError: Address" in out
    assert f": UnavailableError: {SHOWN}" in out  # the failing worker's message
    # The reply does not choose the transport top uses.
    assert (f"{PREFIXED}: not asked: listed with a protocol prefix; top asks the workers "
            "over the dispatcher's, grpc") in out


def test_a_real_dispatcher_with_markup_job_names(tmp_path):
    """Jobs named ``[/pwned]`` and ``[bold]x`` on a real data service: top neither raises
    rich's MarkupError nor styles anything."""
    from clusterwire import data

    with in_process_data_service(workers=1) as dispatcher:
        iterators = [iter(data.Dataset.range(10**6).apply(data.distribute(
            processing_mode="parallel_epochs", service=dispatcher.target, job_name=name)))
            for name in ("[/pwned]", "[bold]x")]
        for iterator in iterators:
            next(iterator)
        result = clusterwire("top", "--dispatcher", dispatcher.target.removeprefix("grpc://"),
                             "--once", "--interval", "0.2", "--timeout", "10")
        for iterator in iterators:
            iterator.close()
    assert result.returncode == 0, result.stderr
    names = [c.strip() for line in result.stdout.decode().splitlines()
             for c in line.split("│")[2:3]]
    assert "[/pwned]" in names and "[bold]x" in names


def test_status_prints_hostile_strings_as_ascii_json_and_loses_nothing(tmp_path):
    with hostile_server("task", tmp_path) as address:
        one = clusterwire("status", "--json", f"grpc://{address}", "--timeout", "10")
        every = clusterwire("status", "--all", "--json", f"grpc://{address}", "--timeout",
                            "10")
    assert one.returncode == 0, one.stderr
    # ensure_ascii: every byte is printable ASCII or a newline.
    for output in (one.stdout, every.stdout):
        assert set(output) <= set(range(0x20, 0x7f)) | {0x0A}
    status = json.loads(one.stdout)
    assert status["job"] == status["protocol"] == status["target"] == HOSTILE
    assert status["cluster"]["worker"][1] == f"{HOSTILE}:1"
    assert status["unreachable_peers"][0]["error"] == HOSTILE + HUGE
    assert "\\u001b]0;pwned\\u0007" in one.stdout.decode()  # readable
    assert every.returncode == 1
    assert all(entry["error"] == f"InternalError: {HOSTILE}"
               for entry in json.loads(every.stdout).values())


def test_status_summary_of_a_hostile_task_is_escaped(tmp_path):
    """The human summary (the default) prints the hostile names, addresses and errors
    through printable: no control reaches the terminal, each is shown escaped."""
    with hostile_server("task", tmp_path) as address:
        one = clusterwire("status", f"grpc://{address}", "--timeout", "10")
        every = clusterwire("status", "--all", f"grpc://{address}", "--timeout", "10")
    assert one.returncode == 0, one.stderr
    for output in (one.stdout, every.stdout, every.stderr):
        assert raw_controls(output) == set()
    out = one.stdout.decode()
    assert f"task        /job:{SHOWN}/task:" in out and f"address     {SHOWN}" in out
    assert f"unreachable /job:{SHOWN}/task:7 at " in out
    assert every.returncode == 1
    lines = every.stdout.decode().splitlines()
    assert lines and all(line.startswith("task /job:") and
                         line.endswith(f"did not answer: InternalError: {SHOWN}")
                         for line in lines), lines


def test_status_all_has_one_deadline_against_a_target_that_stalls_every_forward(tmp_path):
    """The target lists 203 tasks and holds every forwarded status: the command ends
    within its --timeout (asked 16 at a time, each for --timeout, it took 26 s), every task
    is in the output with why it has no status, and the exit status says so."""
    listed = [f"127.0.0.1:{port}" for port in range(20000, 20200)]
    with hostile_server("stalling", tmp_path, listed) as address:
        started = time.monotonic()
        result = clusterwire("status", "--all", "--json", f"grpc://{address}", "--timeout",
                             "2")
        elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    statuses = json.loads(result.stdout)
    assert list(statuses) == [f"/job:worker/task:{index}" for index in range(203)]
    errors_ = [status["error"] for status in statuses.values()]
    asked = [e for e in errors_ if e.startswith("DeadlineExceededError: Request 'status'")]
    unasked = [e for e in errors_ if "not asked: the deadline of 2 s for the whole" in e]
    assert len(asked) == 64 and len(unasked) == 203 - 64, set(errors_)
    # The interpreter's start and imports, then one 2 s deadline.
    assert elapsed < 2 + 8, elapsed


def test_the_cli_error_line_carries_a_peers_message_escaped(tmp_path):
    with hostile_server("task", tmp_path) as address:
        result = clusterwire("status", f"grpc://{address}", "--task", "/job:worker/task:1",
                             "--timeout", "10")
    assert result.returncode == 1
    assert raw_controls(result.stderr) == set()
    assert result.stderr.decode() == f"clusterwire status: InternalError: {SHOWN}\n"


def test_a_hostile_host_is_refused_at_once_and_escaped():
    """A target whose host is HOSTILE (but NUL, which an argument cannot hold) is no host: it
    is refused before any connection or retry (no retry warning), its error escaped."""
    host = HOSTILE.replace("\x00", "")
    shown = printable(host)
    result = clusterwire("status", f"grpc://{host}:1", "--timeout", "30")
    assert result.returncode == 1
    assert raw_controls(result.stderr) == set()
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"clusterwire status: InvalidArgumentError: Address '{shown}:1' has a host"), lines


def test_plugins_escapes_a_hostile_distribution(tmp_path):
    dist = tmp_path / "cw_hostile-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: cw-hostile\n"
                                   "Version: 1.0\x1b]0;pwned\x07\x1b[2J\n")
    (dist / "entry_points.txt").write_text("[clusterwire]\nhostile = cw_hostile_plugin\n")
    (tmp_path / "cw_hostile_plugin.py").write_text(f"raise ImportError({HOSTILE!r})\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("CLUSTERWIRE_PLUGINS", None)
    result = subprocess.run([sys.executable, "-m", "clusterwire", "plugins"],
                            capture_output=True, timeout=60, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert raw_controls(result.stdout) == raw_controls(result.stderr) == set()
    assert any(line.split()[:2] == ["broken", "hostile"] and r"1.0\x1b]0;pwned\x07\x1b[2J"
               in line for line in result.stdout.decode().splitlines())
    assert "plugin 'hostile' failed to load: " in result.stderr.decode()
    assert SHOWN in result.stderr.decode()


# -- top in a real terminal -------------------------------------------------------------


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_live_top_of_a_hostile_task_in_a_terminal(tmp_path):
    tmux = Tmux(tmp_path)
    log = tmp_path / "pane.log"
    with hostile_server("task", tmp_path) as address:
        command = (f"bash -c '{sys.executable} -m clusterwire top grpc://{address} "
                   "--interval 0.3 --timeout 2; echo top exited with status $?'")
        try:
            tmux("new-session", "-d", "-s", "top", "-x", "250", "-y", "50", command)
            tmux("set-option", "-t", "top", "-w", "remain-on-exit", "on")
            tmux("pipe-pane", "-t", "top", f"cat >> {log}")
            # Task 1's host is not a host: its error, whole, is below the table.
            error = f"/job:worker/task:1: {REFUSED}"
            screen = wait_for_screen(tmux, lambda s: error[:200] in s.replace("\n", ""),
                                     "the hostile task's rows and errors", timeout=30)
            assert "[/pwned][bold]x" in screen
            # OSC 0 would have set the pane's title.
            assert tmux("display", "-p", "-t", "top", "#{pane_title}").strip() != "pwned"
            tmux("send-keys", "-t", "top", "C-c")
            screen = wait_for_screen(tmux, lambda s: "top exited with status" in s,
                                     "top to exit on Ctrl-C")
            assert "top exited with status 0" in screen and "Traceback" not in screen
        finally:
            tmux.kill()
    written = log.read_bytes()
    for raw in (b"\x1b]0;pwned", b"\x1b[2J", b"\x1b]8;;evil", "\u202e".encode(), b"\x00",
                "\x9b".encode(), b"\x7f"):
        assert raw not in written, raw


# -- a reply naming a thousand dead tasks --------------------------------------------------


class BlackHoles:
    """``count`` listening sockets that accept every connection and never answer;
    ``connected`` counts the connections each address took. On 127.0.0.77, where no other
    test serves: a client of an earlier test still reconnecting to a 127.0.0.1 port would
    otherwise count as top's when one of these took that port."""

    HOST = "127.0.0.77"

    def __init__(self, count: int):
        self._servers = [socket.create_server((self.HOST, 0)) for _ in range(count)]
        self.addresses = [f"{self.HOST}:{s.getsockname()[1]}" for s in self._servers]
        self.connected: dict[str, int] = {}
        self._held: list[socket.socket] = []
        self._selector = selectors.DefaultSelector()
        for server, address in zip(self._servers, self.addresses, strict=True):
            server.setblocking(False)
            self._selector.register(server, selectors.EVENT_READ, address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.1):
                # Nothing to accept, or a connection reset before it was taken (top exited).
                with contextlib.suppress(OSError):
                    self._held.append(key.fileobj.accept()[0])
                    self.connected[key.data] = self.connected.get(key.data, 0) + 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._selector.close()
        for sock in self._servers + self._held:
            sock.close()


@pytest.mark.parametrize("kind", ["task", "dispatcher"])
def test_top_asks_a_bounded_number_of_the_servers_a_reply_names(kind, tmp_path):
    """A reply listing 1,000 dead servers (before: 65 s and 1,000 connections): one
    refresh asks at most MAX_SERVERS, all at once, so --once takes about the interval and
    three deadlines."""
    holes = BlackHoles(1000)
    try:
        with hostile_server(kind, tmp_path, holes.addresses) as address:
            target = (("--dispatcher", address) if kind == "dispatcher"
                      else (f"grpc://{address}",))
            started = time.monotonic()
            result = clusterwire("top", *target, "--once", "--interval", "0.2",
                                 "--timeout", "1")
            took = time.monotonic() - started
    finally:
        holes.close()
    assert result.returncode == 1, result.stderr
    out = result.stdout.decode()
    # Besides the dead: the target (twice: its own name, task 0), the unresolvable host
    # and the failing server; the dispatcher lists the last two, PREFIXED and the dead as
    # workers.
    asked = top.MAX_SERVERS - 4
    # Fewer only if a deadline passed before a connection was tried (a loaded machine).
    assert 0 < len(holes.connected) <= asked, holes.connected
    assert sum(holes.connected.values()) <= 2 * asked  # a reconnect at most, per address
    # About 3 s on an idle machine (the interval, three deadlines and Python's start).
    assert took < 30, took
    if kind == "task":
        assert re.search(rf"\(top asks {top.MAX_SERVERS} of the cluster's 1004\)", out)
    else:
        assert f"1003 workers (top asks {top.MAX_SERVERS - 1})" in out
    print(f"{kind}: {took:.1f} s, {len(holes.connected)} addresses, "
          f"{sum(holes.connected.values())} connections")


def test_top_asks_its_own_task_and_63_others_of_a_real_cluster_of_1000():
    """A real Server whose cluster lists 999 dead tasks before its own: one poll asks
    the target's task (last in the cluster's order) and the first 63 others, at once."""
    from clusterwire import Server

    holes = BlackHoles(999)
    server = Server({"worker": [*holes.addresses, "127.0.0.1:0"]}, job_name="worker",
                    task_index=999)
    poller = top.TaskPoller(server.target, timeout=1.0)
    try:
        started = time.monotonic()
        snapshots = poller.poll()
        took = time.monotonic() - started
        assert [s.task for s in snapshots] == [
            *(f"/job:worker/task:{i}" for i in range(top.MAX_SERVERS - 1)),
            "/job:worker/task:999"]
        assert snapshots[-1].status is not None
        assert all(s.status is None for s in snapshots[:-1])
        assert set(holes.connected) <= set(holes.addresses[:top.MAX_SERVERS - 1])
        assert poller.listed == 1000
        assert took < 10, took  # one deadline, as all are asked at once
    finally:
        poller.close()
        server.stop()
        holes.close()


def test_top_keeps_asking_the_tasks_of_the_first_answer(tmp_path):
    """A target whose every reply lists 100 other dead tasks, under a new membership
    version: top asks the tasks of its first answer, every refresh, no other address, and
    says the cluster changed."""
    from rich.console import Console

    holes = BlackHoles(1000)
    try:
        with hostile_server("task", tmp_path, holes.addresses, rotate=100) as address:
            view = top.task_view(f"grpc://{address}", interval=1.0, timeout=1.0)
            try:
                asked = []
                for _ in range(3):
                    snapshots = view.poll()
                    assert len(snapshots) == top.MAX_SERVERS
                    asked.append({s.address for s in snapshots} & set(holes.addresses))
                out = io.StringIO()
                Console(file=out, width=400).print(view.render(None, snapshots))
            finally:
                view.close()
    finally:
        holes.close()
    assert asked[0] == asked[1] == asked[2] and len(asked[0]) == top.MAX_SERVERS - 4
    assert set(holes.connected) <= asked[0]
    assert re.search(r"the cluster changed since top started \(membership version 0 -> "
                     r"\d+\): restart top to follow it", out.getvalue().replace("\n", ""))


def test_top_asks_at_most_63_worker_addresses_in_all(tmp_path):
    """A dispatcher whose every reply lists 100 other dead workers: top asks the first
    reply's, each over one connection kept, and no other address ever."""
    holes = BlackHoles(1000)
    try:
        with hostile_server("dispatcher", tmp_path, holes.addresses, rotate=100) as address:
            poller = top.DataPoller(address, "grpc", timeout=1.0)
            try:
                asked = [{w.address for w in poller.poll().workers} & set(holes.addresses)
                         for _ in range(3)]
            finally:
                poller.close()
    finally:
        holes.close()
    # The first reply lists 3 others first (an unresolvable host, a failing worker and
    # PREFIXED); the later ones list only addresses top does not know.
    assert len(asked[0]) == top.MAX_SERVERS - 4 and asked[1] == asked[2] == set()
    assert set(holes.connected) <= asked[0] and set(holes.connected.values()) <= {1}
