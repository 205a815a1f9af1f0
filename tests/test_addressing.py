"""Which task addresses a client dials: a host no name service could ever resolve is refused
at once (InvalidArgumentError naming it and the fix), before any connection or retry; every
form of host a cluster spec may name is dialed."""

from __future__ import annotations

import time

import pytest

import clusterwire
from clusterwire import errors
from clusterwire.addressing import check_dialable


@pytest.mark.parametrize("address", [
    "localhost:2222", "127.0.0.1:0", "ps-0.trainer_svc.default.svc.cluster.local:2222",
    "[::1]:2222", "[fe80::1%eth0]:2222", "10.0.0.1:65535"])
def test_every_form_of_host_a_cluster_spec_names_is_dialed(address):
    check_dialable(address)


@pytest.mark.parametrize("address", [
    "bad name:1", "\x1b[2J:1", "host/path:1", "user@host:1", "[not-v6]:1", "h\u202eost:1",
    "t\u00e4sk:1"])
def test_a_host_no_name_service_resolves_is_refused_naming_it(address):
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"has a host, .*, that no name service resolves.*Fix the address"):
        check_dialable(address)


def test_a_session_to_such_a_host_fails_at_once_without_retrying():
    started = time.monotonic()
    with pytest.raises(errors.InvalidArgumentError, match="'bad name:1' has a host"):
        clusterwire.Session("grpc://bad name:1", timeout=30).status()
    assert time.monotonic() - started < 10  # not the 30 s retry window
