"""Checks UCX worker addresses in a child process before this process's UCX sees them.

UCX aborts the whole process (an assertion, not an error) when asked to
unpack a malformed worker address, and a hello carries an address from the
network. A long-lived checker process unpacks each address first: if the
garbage kills it, only the checker dies (and is restarted), and the address
is refused.

Run as ``python -m clusterwire.transports.verbs.address_check``: reads
length-prefixed addresses on stdin, answers one byte each (1 = usable).
"""

from __future__ import annotations

import atexit
import os
import struct
import subprocess
import sys
import threading

from clusterwire.transports.verbs.engine import _import_ucxx

_LENGTH = struct.Struct("<I")
MAX_ADDRESS_BYTES = 1 << 16


class AddressChecker:
    """The parent side: one checker process, restarted after it dies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        atexit.register(self.close)

    def _process(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:
                self._proc.stdin.close()
                self._proc.stdout.close()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "clusterwire.transports.verbs.address_check"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"})
        return self._proc

    def start(self) -> None:
        """Start the checker process now, so the first hello does not wait for it."""
        with self._lock:
            self._process()

    def usable(self, address: bytes) -> bool:
        """True when UCX can unpack ``address`` (checked in the child process)."""
        if not address or len(address) > MAX_ADDRESS_BYTES:
            return False
        with self._lock:
            proc = self._process()
            try:
                proc.stdin.write(_LENGTH.pack(len(address)) + address)
                proc.stdin.flush()
                answer = proc.stdout.read(1)
            except (BrokenPipeError, OSError):
                answer = b""
            if answer != b"\x01":
                if answer == b"":
                    proc.kill()
                    proc.wait()
                return False
            return True

    def close(self) -> None:
        """Stop the checker process."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.stdin.close()
                self._proc.wait(10)
                self._proc.stdout.close()


def main() -> None:
    """The child side: answer for each address whether UCX can unpack it."""
    # UCX logs (UCX_PROTO_INFO, warnings) go to fd 1: keep the answer pipe for answers only.
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    u, _ = _import_ucxx()
    context = u.UCXContext(feature_flags=(u.Feature.TAG,))
    worker = u.UCXWorker(context)
    stdin = sys.stdin.buffer
    while True:
        header = stdin.read(_LENGTH.size)
        if len(header) < _LENGTH.size:
            return
        (length,) = _LENGTH.unpack(header)
        address = stdin.read(length)
        try:
            remote = u.UCXAddress.create_from_buffer(address)
            endpoint = u.UCXEndpoint.create_from_worker_address(worker, remote, False)
            endpoint.close()
            ok = True
        except Exception:
            ok = False
        # The endpoint opened a connection to the peer, which UCX closes only while the
        # worker progresses: without this, every hello left one open in the client.
        while worker.progress_once():
            pass
        answers.write(b"\x01" if ok else b"\x00")


if __name__ == "__main__":
    main()
