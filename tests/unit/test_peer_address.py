"""The one rule for the address this host's peers reach (pdkv.peer_address), on fixture tables: pure."""

from __future__ import annotations

import pytest

from pdkv.errors import StartError
from pdkv.peer_address import advertised_address, advertised_candidates, choose_address, is_candidate, local_addresses

# interface -> its addresses, as psutil lists the interfaces that are up (scopes already cut)
MULTI = {"lo": ["127.0.0.1", "::1"], "ib0": ["192.168.50.5"], "eth0": ["10.1.0.5", "fe80::1"], "docker0": ["172.17.0.1"]}


def test_candidates_are_routable_ipv4_by_interface_name():
    assert advertised_candidates(MULTI) == [("docker0", "172.17.0.1"), ("eth0", "10.1.0.5"), ("ib0", "192.168.50.5")]
    assert choose_address(MULTI) == "172.17.0.1"
    assert advertised_address(MULTI) == "172.17.0.1"  # with a table given, nothing of this host is read


@pytest.mark.parametrize(("address", "allowed"), [
    ("10.0.0.1", True), ("198.18.0.2", True), ("127.0.0.1", False), ("127.0.1.1", False), ("169.254.9.9", False),
    ("0.0.0.0", False), ("2001:db8::1", False), ("fe80::1", False), ("::1", False), ("not-an-ip", False),
])
def test_what_the_rule_lets_pdkv_advertise(address: str, allowed: bool):
    assert is_candidate(address) is allowed


def test_a_route_to_a_known_peer_picks_its_source_when_it_is_a_candidate_or_loopback():
    assert choose_address(MULTI, route_source="192.168.50.5") == "192.168.50.5"
    assert choose_address(MULTI, route_source="127.0.0.1") == "127.0.0.1"  # a peer on this host
    assert choose_address(MULTI, route_source="169.254.9.9") == "172.17.0.1"  # not a candidate: the first one
    assert choose_address(MULTI, route_source=None) == "172.17.0.1"


def test_no_candidate_is_a_start_error_that_names_host_ip():
    for table in ({}, {"lo": ["127.0.0.1", "::1"]}, {"eth0": ["169.254.3.4", "2001:db8::5"]}):
        with pytest.raises(StartError) as info:
            choose_address(table)
        assert "--host-ip" in (info.value.hint or "")


def test_local_addresses_are_every_address_of_the_table():
    assert local_addresses(MULTI) == ["127.0.0.1", "::1", "192.168.50.5", "10.1.0.5", "fe80::1", "172.17.0.1"]
