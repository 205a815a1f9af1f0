"""A transport listener in its own process, for the conformance kit's cross-process checks.

``python -m clusterwire.testing.peer PROTOCOL [HOST]`` listens on port 0, prints
``CLUSTERWIRE_READY <address>`` and serves ``echo_handler`` until SIGTERM or
stdin closes.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import numpy as np

from clusterwire.plugins import get_plugin_manager
from clusterwire.ready_line import say_ready
from clusterwire.testing.child import stop_on_stdin_close
from clusterwire.transport import Frame, ListenOptions

#: Request headers with a special meaning to ``echo_handler``; anything else is echoed.
SLEEP = b"sleep:"      # sleep:<seconds>, then echo
ANNOUNCE = b"announce:"  # announce:<n>: print ENTERED on stdout, then reply with n bytes
FAIL = b"fail"         # the handler raises
PEER = b"peer"         # reply with the request's Frame.peer as the header


def echo_handler(frame: Frame) -> Frame:
    """The kit's handler: echo, or act on a special header."""
    header = bytes(frame.header)
    if header.startswith(SLEEP):
        time.sleep(float(header[len(SLEEP):]))
    elif header.startswith(ANNOUNCE):
        print("ENTERED", flush=True)
        return Frame(b"ok", [np.full(int(header[len(ANNOUNCE):]), 7, np.uint8)])
    elif header == FAIL:
        raise RuntimeError("handler failure requested by the conformance kit")
    elif header == PEER:
        return Frame(frame.peer.encode(), [])
    return Frame(frame.header, list(frame.buffers))


def main(argv: list[str]) -> int:
    protocol = argv[0]
    host = argv[1] if len(argv) > 1 else "127.0.0.1"
    transport = get_plugin_manager().transport(protocol)
    listener = transport.listen(f"{host}:0", echo_handler, ListenOptions())
    listener.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop_on_stdin_close(stop)
    say_ready(listener.address)
    stop.wait()
    listener.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
