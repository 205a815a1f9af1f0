"""The dispatcher's lease on its work_dir: the one process that may write its journal.

The lease is an exclusive ``flock`` on ``<work_dir>/lease``, held while the dispatcher runs.
The kernel drops it when the holder's process ends however it ends (SIGKILL too), so a
dispatcher restarted on the work_dir after a crash takes it at once, and a standby waiting
for it takes over. The file holds a description of its holder (pid, host, address) for the
messages of those refused or waiting.

The work_dir's file system must honour ``flock`` between every host that shares it: a local
disk, NFS (Linux maps ``flock`` to NFS byte-range locks; NFSv4, or v3 with lockd), Lustre
mounted with ``-o flock`` (not ``localflock``), GPFS. A lock held by a *host* that died is
freed only when the file server expires it (NFSv4: the server's lease time).
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import weakref

#: The lease file in a work_dir.
LEASE_FILE = "lease"
#: How often a standby tries to take the lease: one non-blocking ``flock`` each time (a
#: blocking one could not be given up when the standby is stopped).
POLL_INTERVAL_S = 0.2

_open_leases: weakref.WeakSet[Lease] = weakref.WeakSet()


def _forget_in_child() -> None:
    # A forked child shares the lock (it belongs to the open file, not the process): closing
    # the child's descriptor keeps the parent's lease and lets it end with the parent.
    for lease in list(_open_leases):
        lease.forget()


os.register_at_fork(after_in_child=_forget_in_child)


class Lease:
    """The lease file of ``work_dir`` (created if missing), not yet held."""

    def __init__(self, work_dir: str):
        os.makedirs(work_dir, exist_ok=True)
        self.path = os.path.join(work_dir, LEASE_FILE)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._lock = threading.Lock()
        self.held = False
        _open_leases.add(self)

    def try_take(self) -> bool:
        """Take the lease if nobody holds it (True); never waits."""
        with self._lock:
            if self._fd is None:
                return False
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self.held = True
            return True

    def wait(self, stop: threading.Event) -> bool:
        """Take the lease once its holder lets go (True), trying every POLL_INTERVAL_S;
        False once ``stop`` is set."""
        while not self.try_take():
            if stop.wait(POLL_INTERVAL_S):
                return False
        return True

    def describe(self, address: str) -> None:
        """Write this process as the holder, serving at ``address`` (call holding it)."""
        text = f"pid {os.getpid()} on {socket.gethostname()}, serving at {address}\n"
        with self._lock:
            if self._fd is None or not self.held:
                return
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text.encode(), 0)
            os.fsync(self._fd)  # other hosts read it from the file server

    def holder(self) -> str:
        """The holder's description as it wrote it (or that it wrote none yet)."""
        try:
            with open(self.path, encoding="utf-8", errors="replace") as handle:
                text = handle.read(1024).strip()
        except OSError as err:
            return f"unknown: {self.path} is unreadable ({err.strerror})"
        return text or "a dispatcher that has not described itself yet"

    def forget(self) -> None:
        """Close this process's descriptor without unlocking (the forked child's copy; no
        lock taken: a thread of the parent may have held it at the fork)."""
        fd, self._fd, self.held = self._fd, None, False
        if fd is not None:
            os.close(fd)

    def release(self) -> None:
        """Let go of the lease (idempotent): the next dispatcher may take it."""
        with self._lock:
            fd, self._fd, self.held = self._fd, None, False
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
