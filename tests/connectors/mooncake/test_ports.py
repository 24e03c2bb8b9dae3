"""MooncakeConnectorV2 side-channel ports: the brief's formula, uniqueness, overlap detection."""

import itertools

import pytest

from connectors.mooncake.ports import PortLayout, overlaps

pytestmark = pytest.mark.unit


def test_handshake_ports_follow_the_formula_and_are_unique():
    layout = PortLayout(kv_port=37000, tp=4, pp=2, pcp=2, dp=2)
    seen = set()
    for dp, pp, pcp, tp in itertools.product(range(2), range(2), range(2), range(4)):
        port = layout.handshake_port(dp, pp, pcp, tp)
        assert port == 37000 + dp * (4 * 2 * 2) + (pp * 2 + pcp) * 4 + tp
        seen.add(port)
    assert len(seen) == layout.num_workers == 32
    assert seen == set(range(37000, 37032))


def test_control_ports_follow_the_worker_range():
    layout = PortLayout(kv_port=37000, tp=8, dp=2)
    assert layout.control_port(0) == 37016 and layout.control_port(1) == 37017
    assert layout.ports == range(37000, 37018)


def test_seed_example_prefill_and_decode_do_not_overlap():
    prefill, decode = PortLayout(37000, tp=2), PortLayout(37010, tp=2)
    assert overlaps([("prefill", prefill), ("decode", decode)]) == []


def test_overlap_is_reported_with_the_shared_range():
    prefill, decode = PortLayout(37000, tp=16), PortLayout(37010, tp=2)
    assert overlaps([("prefill", prefill), ("decode", decode)]) == [("prefill", "decode", range(37010, 37013))]  # decode: 2 workers + control


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: PortLayout(37000, tp=0), "tp must be >= 1"),
        (lambda: PortLayout(65530, tp=8), "beyond 65535; choose a lower kv_port"),
        (lambda: PortLayout(0), "beyond 65535"),
        (lambda: PortLayout(37000, tp=2).handshake_port(tp_rank=2), "tp_rank 2 outside 0..1"),
        (lambda: PortLayout(37000, dp=2).control_port(2), "dp_rank 2 outside 0..1"),
    ],
)
def test_bad_layouts(call, message):
    with pytest.raises(ValueError, match=message):
        call()
