"""The built-in grpc+verbs transport passes the conformance kit (real UCX, no GPU needed)."""

import pytest

from clusterwire.testing import TransportSuite

pytest.importorskip("ucxx", reason="the verbs extra is not installed: pip install '.[verbs]'")


class TestVerbsConformance(TransportSuite):
    protocol = "grpc+verbs"
