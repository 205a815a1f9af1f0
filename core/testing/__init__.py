"""clusterwire.testing: the kits every transport plugin and every server surface run
against themselves.

**Transports.** A plugin's whole test file can be::

    from clusterwire.testing import Capabilities, TransportSuite

    class TestMyTransport(TransportSuite):
        protocol = "myproto"
        capabilities = Capabilities(raw_tcp_port=True)

pytest then runs every conformance check (payload shapes up to 256 MiB,
concurrency, deadlines, cancellation, killed peers, stop with calls in
flight, closed ports, size limits, malformed input, port 0, the peer a
handler sees in ``Frame.peer``, and a real 3-process cluster over the
protocol) against that transport. Capability
flags switch off the checks for what a transport does not support.

**Server surfaces** (a task's port, a metrics endpoint, membership, a dispatcher, a worker,
and every surface added later) run the hostile-input kit. Start the surface's server in its own
process with the cluster token set, and describe it in a ``surface`` fixture::

    from clusterwire.testing import Surface, SurfaceSuite

    class TestMySurface(SurfaceSuite):
        @pytest.fixture(scope="class")
        def surface(self, my_server_process):
            return Surface(
                "my surface", my_server_process.address, my_server_process.pid,
                {"new widget": make_a_widget},      # a token holder's work, each < 1 s
                TOKEN, requests=[WidgetRequest(name="w")], response_type=WidgetResponse,
                show=print_a_widget_named,          # plant a string, return what prints
                log=my_server_process.stderr)

pytest then runs, each check bounded in time and against a stated bound (the constants of
``clusterwire.testing.surfaces``): tokenless floods from another process (against
127.0.0.1, from another peer address: 127.0.0.2)
(``FLOOD_CONNECTIONS`` silent, reconnecting, garbage-sending, HTTP/2-preface and gRPC health
Watch connections, and Watch streams on 4 MiB invented service names), during which every
operation succeeds within ``OPERATION_SECONDS`` (on a busy machine more: ``allowed_for``)
and the server's RSS grows by less than
``Surface.max_rss_growth_bytes``; each request without the token and with a wrong one
(``UnauthenticatedError``); every field of every request at its extremes
(``malformed_variants``: 1 MiB strings, negative and 2^63 / 2^64-1 numbers, NaN, 65,536
items, extreme map keys, wrong wire types, bad UTF-8), answered within ``ANSWER_SECONDS``
with OK or an error that blames the request, never a crash, a hang or a traceback in the
server's log; and every ``HOSTILE_STRINGS`` through ``show``, whose output must pass
``assert_terminal_safe``. The class says what applies: ``floods`` picks the floods it runs
(``TCP_FLOODS`` for a port that is not gRPC), ``takes_requests = False`` and
``prints_strings = False`` leave out the request and terminal checks; what does not apply
is not collected (never skipped), and a check that applies without what it needs (no
``requests``, no ``show``) fails. ``known_failures`` runs the checks that fail for a known
reason as ``xfail``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusterwire.testing.suite import Capabilities, TransportSuite
    from clusterwire.testing.surfaces import (
        HOSTILE_STRINGS,
        TCP_FLOODS,
        Surface,
        SurfaceSuite,
        assert_terminal_safe,
        malformed_variants,
    )

# The kits import pytest: loaded on first use, so that the modules that do not need it
# (hosts, ports, certs...) import where pytest is not installed.
_KITS = {"Capabilities": "suite", "TransportSuite": "suite", "HOSTILE_STRINGS": "surfaces",
         "TCP_FLOODS": "surfaces", "Surface": "surfaces", "SurfaceSuite": "surfaces",
         "assert_terminal_safe": "surfaces", "malformed_variants": "surfaces"}

__all__ = ["HOSTILE_STRINGS", "TCP_FLOODS", "Capabilities", "Surface", "SurfaceSuite",
           "TransportSuite",
           "assert_terminal_safe", "malformed_variants"]


def __getattr__(name: str) -> Any:
    if name not in _KITS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_KITS[name]}"), name)
