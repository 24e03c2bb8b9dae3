"""`kvpp ports`: per-rank ports from connectors.mooncake.ports and overlap detection between instances."""

from __future__ import annotations

import json

import pytest

from deploy.cli.main import main
from deploy.cli.ports import parse_node
from connectors.mooncake.ports import PortLayout

pytestmark = pytest.mark.unit


def test_single_instance_lists_every_rank(capsys):
    assert main(["ports", "--kv-port", "37000", "--tp", "2", "--pp", "2", "--dp", "2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    layout = PortLayout(37000, tp=2, pp=2, dp=2)
    assert [w["port"] for w in info["workers"]] == [
        layout.handshake_port(w["dp"], w["pp"], w["pcp"], w["tp"]) for w in info["workers"]]
    assert sorted(w["port"] for w in info["workers"]) == list(range(37000, 37008))
    assert [c["port"] for c in info["control"]] == [37008, 37009]
    assert (info["first"], info["last"]) == (37000, 37009)


def test_seed_example_ranges_do_not_overlap(capsys):
    assert main(["ports", "--node", "prefill=37000:2", "--node", "decode=37010:1"]) == 0
    out = capsys.readouterr().out
    assert "prefill: 37000-37002" in out and "decode: 37010-37011" in out and "no overlaps" in out


def test_overlap_is_reported_with_shared_range(capsys):
    assert main(["ports", "--node", "prefill=37000:4", "--node", "decode=37003:1", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["overlaps"] == [{"host": "(this host)", "a": "prefill", "b": "decode", "first": 37003, "last": 37004}]


def test_spec_instances_are_checked_per_host(capsys):
    assert main(["ports", "--spec", "deploy/deployment/examples/pd-one-host.yaml"]) == 0
    assert "no overlaps" in capsys.readouterr().out


@pytest.mark.parametrize("text, fragment", [
    ("prefill", "expected NAME=KV_PORT:TP"),
    ("prefill=37000", "expected NAME=KV_PORT:TP"),
    ("prefill=37000:x", "must be integers"),
    ("prefill=37000:0", "tp must be >= 1"),
    ("prefill=65535:2", "beyond 65535"),
])
def test_bad_node_is_a_clear_error(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_node(text)


def test_exactly_one_mode(capsys):
    assert main(["ports"]) == 2
    assert "exactly one of --kv-port" in capsys.readouterr().err
