"""MooncakeConnectorV2's kv_connector_extra_config: defaults, and every problem named at once."""

from __future__ import annotations

import pytest

from kvpp_core.config import KvppConfigError

from connectors.mooncake.settings import parse_mooncake_v2_settings

pytestmark = pytest.mark.unit


def test_settings_defaults_and_errors():
    s = parse_mooncake_v2_settings(None)
    assert (s.protocol, s.stall_timeout_s, s.transfer_timeout_s, s.hold_timeout_s, s.lease_s) == ("tcp", 2.0, 30.0, 30.0, 5.0)
    assert (s.max_parallel_pulls, s.max_pulls_per_prefill) == (4, 2)
    with pytest.raises(KvppConfigError, match="lease_s: 40.0 exceeds hold_timeout_s 30.0"):
        parse_mooncake_v2_settings({"lease_s": 40})
    with pytest.raises(KvppConfigError, match="valid options: protocol"):
        parse_mooncake_v2_settings({"protocl": "tcp"})
    with pytest.raises(KvppConfigError, match="transfer_timeout_s: 2 does not exceed stall_timeout_s 2 rounded up"):
        parse_mooncake_v2_settings({"transfer_timeout_s": 2})
    with pytest.raises(KvppConfigError, match="transfer_timeout_s: 4 does not exceed stall_timeout_s 3.5 rounded up"):
        parse_mooncake_v2_settings({"stall_timeout_s": 3.5, "transfer_timeout_s": 4})
    with pytest.raises(KvppConfigError, match="stall_timeout_s: .*>= 1.0.*whole seconds, at least 1"):
        parse_mooncake_v2_settings({"stall_timeout_s": 0.5})
    assert parse_mooncake_v2_settings({"stall_timeout_s": 1, "transfer_timeout_s": 5}).stall_timeout_s == 1.0


def test_settings_report_every_problem_at_once():
    with pytest.raises(KvppConfigError) as info:
        parse_mooncake_v2_settings({"curve_secret_key": "/x", "hold_timout_s": 3, "transfer_timeout_s": 2,
                                    "handshake_timeout_s": "5", "protocol": "tcp"})
    text = str(info.value)
    for fragment in ("kv_connector_extra_config.curve_secret_key: unknown option; did you mean curve_secret_key_file?",
                     "kv_connector_extra_config.hold_timout_s: unknown option; did you mean hold_timeout_s?",
                     "kv_connector_extra_config.transfer_timeout_s:", "kv_connector_extra_config.handshake_timeout_s:",
                     "valid options: protocol, device_name"):
        assert fragment in text, text
    assert parse_mooncake_v2_settings({"protocol": "rdma", "hold_timeout_s": 9}).hold_timeout_s == 9
