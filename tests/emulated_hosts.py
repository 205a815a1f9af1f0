"""The skip marker of the tests on emulated hosts (clusterwire.testing.hosts)."""

import pytest

from clusterwire.testing.hosts import netns_available

_AVAILABLE, _REASON = netns_available()
#: Skips a test where emulated hosts cannot be made (not root, no ``ip``, no veth or bridge).
requires_netns = pytest.mark.skipif(not _AVAILABLE, reason=_REASON)
