"""Which timeout a barrier waits: the call's when given, else the Session's (as TF's
RunOptions.timeout_in_ms overrides the session's operation_timeout_in_ms)."""

from __future__ import annotations

import time

import pytest

from clusterwire.errors import DeadlineExceededError
from clusterwire.session import Session

#: Far under the 30 s default, far over what a loaded machine adds to a short wait.
_SLACK_S = 15.0


def _waited(session: Session, name: str, **kwargs) -> float:
    """Seconds a barrier of worker 0 alone waited before it named worker 1 as missing."""
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match=r"waiting for task\(s\) \[1\]"):
        session.barrier(name, **kwargs)
    return time.monotonic() - started


def test_a_barrier_without_a_timeout_waits_the_sessions(cluster3):
    with Session(cluster3.target("worker", 0), timeout=1.5) as session:
        waited = _waited(session, "session-timeout")
    assert 1.5 <= waited < 1.5 + _SLACK_S


def test_a_barriers_own_timeout_applies_over_a_longer_sessions(cluster3):
    with Session(cluster3.target("worker", 0), timeout=30) as session:
        waited = _waited(session, "shorter-call", timeout=1)
    assert 1 <= waited < 1 + _SLACK_S


def test_a_barriers_own_timeout_applies_over_a_shorter_sessions(cluster3):
    with Session(cluster3.target("worker", 0), timeout=1) as session:
        waited = _waited(session, "longer-call", timeout=4)
    assert 4 <= waited < 4 + _SLACK_S
