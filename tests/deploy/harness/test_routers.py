"""deploy/harness/routers.py: the real vllm-router (the pinned release) in front of stub engines
(tests/helpers/stub_engine.py), recording the P/D wire contract that the engine tests
(tests/connectors/mooncake/test_connector_engine.py) and the docs' routers page (docs/routers.md) rely
on, so a release that changes it fails here first."""

from __future__ import annotations

import urllib.error

import pytest

from deploy.harness.engines import engine_metrics, metric_total
from deploy.harness.routers import start_vllm_router
from tests.helpers.llmd_sidecar import NIXL_NULLS
from tests.helpers.pd_http import post, post_stream
from tests.helpers.stub_engine import REQUEST, stubs_in_thread

pytestmark = pytest.mark.integration


@pytest.fixture
def stubs():
    with stubs_in_thread("prefill", "decode") as started:
        yield started


def test_vllm_router_pd_legs_and_no_retry(stubs, tmp_path):
    """Prefill leg: the client's body with max_tokens 1, min_tokens 1, stream false and NIXL's null
    kv_transfer_params; decode leg: the client's body with the prefill answer's kv_transfer_params verbatim,
    streamed when asked; one X-Request-Id on both. A prefill answering 500 is tried once, not retried
    (vllm-router's retry settings apply to its plain mode only), and the client gets a 500."""
    prefill, decode = stubs
    proc, url, metrics_url = start_vllm_router([prefill.url], [decode.url], tmp_path / "router.log")
    try:
        post(f"{url}/v1/completions", dict(REQUEST))
        post_stream(f"{url}/v1/completions", dict(REQUEST))
        legs = list(zip(prefill.requests, decode.requests))
        assert len(prefill.requests) == len(decode.requests) == 2
        for (first, second), stream in zip(legs, (False, True)):
            assert first["body"]["kv_transfer_params"] == NIXL_NULLS
            assert first["body"]["max_tokens"] == 1 and first["body"]["min_tokens"] == 1
            assert first["body"]["stream"] is False
            assert second["body"]["max_tokens"] == REQUEST["max_tokens"] and second["body"]["stream"] is stream
            assert second["body"]["kv_transfer_params"] == {
                "remote_host": "127.0.0.1", "remote_port": 37000, "remote_engine_id": "prefill",
                "remote_block_ids": [3, 4, 5], "remote_request_id": first["request_id"]}
            assert first["request_id"] == second["request_id"]
            assert first["request_id"].startswith(f"___prefill_addr_127.0.0.1:{prefill.port}___decode_addr_")

        prefill.mode = "fail"
        with pytest.raises(urllib.error.HTTPError) as failed:
            post(f"{url}/v1/completions", dict(REQUEST))
        assert failed.value.code == 500
        assert len(prefill.requests) == 3 and len(decode.requests) == 2  # one attempt, no decode leg
        assert metric_total(engine_metrics(metrics_url), "vllm_router_pd_prefill_errors_total") == 1
    finally:
        proc.stop()
