"""The two requests llm-d's P/D sidecar makes of vLLM for one client request, in its NIXL protocol v2
(`--kv-connector nixlv2`, the one it keeps; llm-d/llm-d-inference-scheduler, cmd/pd-sidecar and
pkg/sidecar/proxy/connector_nixlv2.go, read at commit 520af47896e5). The sidecar is a Go binary beside the
decode; the tests send its shapes themselves, to the real engines.

Prefill: the client's body with `kv_transfer_params` set to NIXL's nulls, `stream: false`, no
`stream_options`, and both `max_tokens` and `max_completion_tokens` set to 1 (chat and plain completions
alike). Decode: the client's body unchanged but for `kv_transfer_params`, the prefill answer's, verbatim
(null when the answer has none). Both legs carry one fresh `x-request-id`.
"""

from __future__ import annotations

import uuid

NIXL_NULLS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")


def request_headers() -> dict[str, str]:
    return {"x-request-id": str(uuid.uuid1())}  # uuid.NewUUID in Go: a version 1 UUID


def prefill_leg(request: dict) -> dict:
    body = {**request, "kv_transfer_params": dict(NIXL_NULLS), "stream": False}
    body.pop("stream_options", None)
    return {**body, **{field: 1 for field in TOKEN_LIMITS}}


def decode_leg(request: dict, prefill_answer: dict) -> dict:
    return {**request, "kv_transfer_params": prefill_answer.get("kv_transfer_params")}
