"""A minimal third-party-style plugin, loaded by name from plugins.toml in the tests."""

from __future__ import annotations

from clusterwire import TransportSpec, hookimpl


class DummyTransport:
    """Records the options its factory was given."""

    def __init__(self, options):
        self.options = dict(options)


@hookimpl
def clusterwire_add_transports():
    return [TransportSpec("dummy", DummyTransport, "test transport")]
