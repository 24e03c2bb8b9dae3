"""Hosts and addresses (connectors/hosts.py): IPv6 literals bracketed wherever a port or scheme follows
them, one host spelled two ways is one host, and Mooncake put in the family of its host."""

from __future__ import annotations

import pytest

from connectors.common.hosts import (MOONCAKE_IPV6, address_problem, canonical_host, host_url, join_host_port,
                             mooncake_family, split_host_port, wildcard)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("host, port, joined", [
    ("fd00::1", 8000, "[fd00::1]:8000"), ("::1", 1, "[::1]:1"), ("10.0.0.1", 80, "10.0.0.1:80"),
    ("node-1.example.com", 443, "node-1.example.com:443"),
])
def test_join_and_split_round_trip(host, port, joined):
    assert join_host_port(host, port) == joined
    assert split_host_port(joined) == (host, port)
    assert host_url("tcp", host, port) == f"tcp://{joined}"


@pytest.mark.parametrize("address, message", [
    ("fd00::1:8000", "an IPv6 address takes brackets before the port: [fd00::1]:8000"),
    ("[node]:80", "[node] is not a bracketed IPv6 address"),
    ("[::1]", "must be host:port"), ("h:0", "must be host:port"), ("h:65536", "must be host:port"),
    ("h", "must be host:port"),
])
def test_split_refuses_ambiguous_or_broken_addresses(address, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        split_host_port(address)


def test_one_host_spelled_two_ways_is_one_host():
    assert canonical_host("FD00:0:0::11") == canonical_host("fd00::11") == "fd00::11"
    assert canonical_host("Node-1.Example.com.") == "node-1.example.com"


def test_listen_on_both_families_when_a_host_is_ipv6():
    assert wildcard(["10.0.0.1", "fd00::1"]) == "::" and wildcard(["10.0.0.1", "h"]) == "0.0.0.0"


def test_mooncake_is_put_in_the_family_of_its_host():
    env: dict[str, str] = {}
    mooncake_family("10.0.0.1", env)
    assert env == {}
    mooncake_family("fd00::1", env)
    assert env == {MOONCAKE_IPV6: "1"}
    mooncake_family("node-1", env)  # a name may resolve to either: left to the user's setting
    with pytest.raises(ValueError, match="cannot reach IPv4 peers, but this process's address is 10.0.0.1"):
        mooncake_family("10.0.0.1", env)


@pytest.mark.parametrize("address, problem", [
    ("10.0.0.9:50051", None), ("[fd00::9]:50051", None), ("pool-0.kvpp.svc:50051", None),
    ("fd00::9", "an IPv6 address takes brackets and a port: [fd00::9]:PORT"),
    ("::1:50051", "an IPv6 address takes brackets before the port: [::1]:50051"),
    ("10.0.0.9", "must be host:port"), ("[::1]", "must be host:port"),
    ("h 1:5", "host 'h 1' is neither an IP address nor a DNS name"),
])
def test_address_problem_checks_the_port_and_then_the_host(address, problem):
    found = address_problem(address)
    assert found == problem if problem is None else problem in found
