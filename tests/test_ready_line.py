"""Ready lines stay whole when many processes and threads print them to one stream (as
``srun`` or a shell's ``&`` give several servers one stdout), even unbuffered."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading

from conftest import end_child

from clusterwire.ready_line import READY_PREFIX

PROCESSES, THREADS, LINES = 16, 4, 250

# Each thread of a child prints LINES ready lines naming its own port, once its stdin ends
# (so all start together).
_CHILD = f"""
import sys, threading
from clusterwire.ready_line import say_ready
sys.stdin.read()
def run(port):
    for _ in range({LINES}):
        say_ready(f"grpc://127.0.0.1:{{port}}")
threads = [threading.Thread(target=run, args=(int(sys.argv[1]) * 100 + t,))
           for t in range({THREADS})]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""


def _read_all(fd: int, into: list[bytes]) -> None:
    with os.fdopen(fd, "rb") as stream:
        into.append(stream.read())


def test_ready_lines_of_many_processes_and_threads_are_each_whole():
    read, write = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # print would make two writes a line
    children = []
    try:
        for index in range(1, PROCESSES + 1):
            children.append(subprocess.Popen([sys.executable, "-c", _CHILD, str(index)],
                                             stdin=subprocess.PIPE, stdout=write, env=env))
    finally:
        os.close(write)
    received: list[bytes] = []
    reader = threading.Thread(target=_read_all, args=(read, received), daemon=True)
    reader.start()
    for child in children:
        end_child(child, timeout=120)  # closing stdin is the start signal
    for child in children:
        assert child.returncode == 0
    reader.join(60)
    assert received, "the children's stdout did not end"
    lines = received[0].decode().split("\n")
    assert lines.pop() == ""
    pattern = re.compile(re.escape(READY_PREFIX) + r"grpc://127\.0\.0\.1:(\d+)")
    broken = [line for line in lines if not pattern.fullmatch(line)]
    assert broken == []
    counts = collections.Counter(int(pattern.fullmatch(line)[1]) for line in lines)
    assert counts == {index * 100 + t: LINES
                      for index in range(1, PROCESSES + 1) for t in range(THREADS)}
