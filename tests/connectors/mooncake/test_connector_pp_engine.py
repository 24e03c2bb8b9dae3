"""P/D with a pipeline-parallel prefill: the prefill server runs TP2 x PP2 with KVPP (the tiny model split
7 + 9, four workers, each stage's TP ranks one cache-replica group), the decode server TP=1. The decode
pulls every layer from its stage's owner (four peers) over MooncakeConnectorV2, and must answer with the
tokens it gives when it serves the prompt by itself."""

from __future__ import annotations

import json

import pytest

from deploy.services.ports import free_port, free_port_range
from deploy.services.processes import ManagedProcess, VllmServer, start_servers
from deploy.harness.tiny_model import sample_prompt
from testbed.pd_servers import kv_config, pd_server
from tests.helpers.pd_http import completion, metric, post, tokens_and_logprobs, wait_for

pytestmark = pytest.mark.engine

SPLIT = (7, 9)
LAYERS = 16
PAGE_BYTES = 16 * 576 * 4
PROMPT_WORDS = (170, 45)


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd-pp")
    started: list[ManagedProcess] = []
    try:
        prefill = VllmServer(
            "prefill", tiny_model, free_port(), tmp / "prefill.log", tp=2, log_stats=True,
            env={"MC_LOG_LEVEL": "ERROR", "VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1",
                 "VLLM_PP_LAYER_PARTITION": ",".join(map(str, SPLIT))},
            extra_args=["--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp",
                        "--kv-transfer-config", kv_config("kv_producer", free_port_range(6), hold_timeout_s=60),
                        "--additional-config", json.dumps({"enable_kvpp": True, "kvpp_staging_buffers": 2})])
        decode = pd_server("decode", tiny_model, tmp, tp=1, cores=[1], role="kv_consumer", kv_port=free_port_range(2),
                           policy="recompute", transfer_timeout_s=10)
        start_servers((prefill, decode), started, timeout=600)
        yield {"prefill": prefill, "decode": decode, "model": tiny_model}
    finally:
        for proc in reversed(started):
            proc.stop()


@pytest.mark.parametrize("words", PROMPT_WORDS)
def test_decode_reads_every_stages_owners_and_answers_like_a_colocated_engine(pd, words):
    prefill, decode, model = pd["prefill"], pd["decode"], pd["model"]
    prompt = sample_prompt(words, seed=words)
    colocated = tokens_and_logprobs(completion(decode.url, model, prompt))
    bytes_before = metric(decode.url, "vllm:mooncake_v2_pulled_bytes_total")
    pulls_before = metric(decode.url, "vllm:mooncake_v2_pulls_total")
    first = post(f"{prefill.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                   "kv_transfer_params": {"do_remote_decode": True}})
    params = first["kv_transfer_params"]
    assert params["remote_pp_size"] == 2 and params["remote_tp_size"] == 2
    tokens, lps = tokens_and_logprobs(completion(decode.url, model, prompt, kv_transfer_params=params))
    assert tokens == colocated[0]
    assert max(abs(a - b) for a, b in zip(lps, colocated[1])) <= 1e-4
    wait_for(lambda: metric(decode.url, "vllm:mooncake_v2_pulls_total") >= pulls_before + 1, 30, "pull counted")
    pages = -(-params["remote_num_tokens"] // 16)
    # Every one of the 16 layers, each from the one rank of its stage that owns it.
    assert metric(decode.url, "vllm:mooncake_v2_pulled_bytes_total") - bytes_before == LAYERS * pages * PAGE_BYTES
    assert metric(decode.url, "vllm:mooncake_v2_failed_pulls_total") == 0
