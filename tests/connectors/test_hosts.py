"""IPv6 literals in deployments: bracketed wherever a port or scheme follows them, bare where a component
takes a host, and refused (saying which component and why) only where one cannot use them."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml

from connectors.hosts import (MOONCAKE_IPV6, address_problem, canonical_host, host_url, join_host_port,
                             mooncake_family, split_host_port, wildcard)

from deploy.deployment.check import check_spec
from deploy.deployment.render import render
from deploy.deployment.spec import SpecError, parse_spec

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


def test_free_ports_on_an_ipv6_host():
    import socket

    from deploy.services.processes import free_port

    port = free_port("::1")
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", port))


# ---- specs ------------------------------------------------------------------------------------------
def _spec(backend="mooncake", prefill_hosts=("fd00::11", "fd00::12"), decode_host="fd00::21",
          pool="[fd00::9]:50051", proxy="fd00::40"):
    return {
        "model": {"path": "/models/m", "preset": "deepseek-v3"},
        "prefill": [{"name": "p", "hosts": list(prefill_hosts), "tp": 4, "pp": 2, "port": 8100, "kv_port": 37000,
                     "enable_kvpp": True, "enforce_eager": True}],
        "decode": [{"name": "d", "hosts": [decode_host], "tp": 4, "port": 8200, "kv_port": 37010}],
        "pool": {"backend": backend, "address": pool, "lookup_rpc_port": 5600, "extra_config": {"load_async": True}},
        "proxy": {"host": proxy, "port": 8000},
    }


def _argv(script: str) -> list[str]:
    return shlex.split(script.split("\nexec ", 1)[1].replace("\\\n", " "))


def _exports(script: str) -> dict[str, str]:
    return dict(shlex.split(line[len("export "):])[0].split("=", 1) for line in script.splitlines()
                if line.startswith("export "))


def test_an_ipv6_spec_checks_clean_and_renders_bracketed_addresses():
    spec = parse_spec(_spec())
    assert [str(f) for f in check_spec(spec) if f.severity == "error"] == []
    files = render(spec, "shell")
    proxy = _argv(files["proxy.sh"])
    assert proxy[proxy.index("--prefill") + 1] == "http://[fd00::11]:8100"
    assert proxy[proxy.index("--decode") + 1] == "http://[fd00::21]:8200"
    assert proxy[proxy.index("--host") + 1] == "::"
    worker = _argv(files["p-node1.sh"])
    assert _exports(files["p-node1.sh"])["VLLM_HOST_IP"] == "fd00::12"  # hosts travel bare
    assert all(_exports(files[f"{name}.sh"])[MOONCAKE_IPV6] == "1" for name in ("p-node0", "p-node1", "d-node0"))
    assert worker[worker.index("--master-addr") + 1] == "fd00::11"  # vLLM brackets it itself
    assert worker[worker.index("--host") + 1] == "::"
    assert json.loads(files["mooncake.json"])["master_server_address"] == "[fd00::9]:50051"
    pool = _argv(files["pool.sh"])
    assert pool[pool.index("--host") + 1:pool.index("--host") + 4] == ["fd00::9", "--port", "50051"]


def test_memcache_urls_bracket_the_pool_host():
    files = render(parse_spec(_spec("memcache")), "shell")
    assert "ock.mmc.meta_service_url = tcp://[fd00::9]:50051\n" in files["mmc-local.conf"]
    assert "ock.mmc.meta_service_url = tcp://[fd00::9]:50051\n" in files["mmc-meta.conf"]
    configmap = next(yaml.safe_load_all(render(parse_spec(_spec("memcache", decode_host="n")), "k8s")["pool.yaml"]))
    assert "ock.mmc.meta_service_url = tcp://[::]:50051\n" in configmap["data"]["mmc-meta.conf"]  # the pod's addresses


def test_kubernetes_names_nodes_not_addresses():
    """A single-node instance is pinned by kubernetes.io/hostname, a label value, which cannot hold ':'."""
    spec = parse_spec(_spec())
    with pytest.raises(ValueError, match=r"decode\[0\] \(d\): host 'fd00::21' is not a Kubernetes label value .*"
                                         "an IPv6 address cannot be one: give the node's name"):
        render(spec, "k8s")
    files = render(parse_spec(_spec(decode_host="decode-node")), "k8s")  # the LeaderWorkerSet needs no node name
    configmap = next(yaml.safe_load_all(files["pool.yaml"]))
    assert json.loads(configmap["data"]["mooncake.json"])["master_server_address"] == "kvpp-pool.default.svc:50051"


@pytest.mark.parametrize("change, where, message", [
    ({"decode_host": "10.0.0.21"}, "decode[0] (d): hosts", "10.0.0.21 is IPv4 but fd00::11 (prefill[0] (p)) is IPv6"),
    ({"pool": "10.0.0.9:50051"}, "pool: pool.address", "10.0.0.9 is IPv4 but fd00::11 (prefill[0] (p)) is IPv6"),
])
def test_mooncake_peers_of_both_families_are_refused(change, where, message):
    errors = [str(f) for f in check_spec(parse_spec(_spec(**change))) if f.severity == "error"]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"error: {where}: {message}: Mooncake runs in one family per deployment "
                                f"({MOONCAKE_IPV6}=1 for IPv6, in which mode it cannot reach IPv4 peers)")


def test_mixed_families_are_fine_where_no_mooncake_traffic_joins_them():
    spec = _spec("memcache", decode_host="10.0.0.21", pool="10.0.0.9:5000")
    spec["decode"] = []  # no P/D: the pool's memcache traffic is the only one joining the instances
    del spec["prefill"][0]["kv_port"]
    spec["prefill"].append({**spec["prefill"][0], "name": "q", "hosts": ["10.0.0.31"]})
    assert [str(f) for f in check_spec(parse_spec(spec)) if f.severity == "error"] == []
    assert MOONCAKE_IPV6 not in render(parse_spec(spec), "shell")["p-node0.sh"]  # memcache: Mooncake not used


def test_one_host_written_two_ways_shares_its_ports():
    spec = _spec()
    spec["decode"][0]["hosts"] = ["FD00:0::11"]
    spec["decode"][0]["kv_port"] = 37001
    errors = [str(f) for f in check_spec(parse_spec(spec)) if f.severity == "error"]
    assert any(e.startswith("error: decode[0] (d): kv_port: on host fd00::11 its handshake/control ports overlap")
               for e in errors), errors


@pytest.mark.parametrize("host, message", [
    ("fe80::1%eth0", "a scoped IPv6 address (%zone) names an interface of one host"),
    ("[fd00::1]", "write a host without brackets"),
])
def test_hosts_no_component_can_use_are_refused(host, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_spec(_spec(decode_host=host))


def test_spec_yaml_with_ipv6_round_trips(tmp_path):
    from deploy.deployment.check import run_check

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec()))
    findings, code = run_check(str(path))
    assert code == 0, [str(f) for f in findings]


# ---- the Mooncake side channel ------------------------------------------------------------------------
def test_side_channel_addresses_bracket_ipv6():
    from connectors.mooncake.channel import endpoint
    from connectors.mooncake.messages import WorkerMeta, check_host

    assert endpoint("fd00::1", 37000) == "tcp://[fd00::1]:37000"
    meta = WorkerMeta(version=2, engine_id="e", tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, te_host="fd00::1",
                      te_rpc_port=15000, model="m", dtype="bfloat16", block_size=16, kvpp=False, layers=[])
    assert meta.te_session == "[fd00::1]:15000"
    check_host("fd00::1", "remote_host")
    with pytest.raises(ValueError, match="scoped IPv6 address"):
        check_host("fe80::1%eth0", "remote_host")
    with pytest.raises(ValueError, match="neither an IP address nor a DNS name"):
        check_host("[fd00::1]", "remote_host")


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
