"""A trace captured from this project's own engine (bench/sim_capture.py: the tiny MLA model on AMX_MLA, prefix cache
and chunked prefill on, closed-loop multi-turn conversations stepped by hand) replayed step for step: every request
finds the prefix hits vLLM reported for it (`num_cached_tokens`)."""

from __future__ import annotations

import json

import msgspec
import pytest

from deploy.simulation.cluster import Simulation
from deploy.simulation.costs import CostModel
from deploy.simulation.formats import read_trace
from deploy.simulation.state import EngineConfig
from tests.helpers.paths import REPO

pytestmark = pytest.mark.unit

CAPTURED = REPO / "tests" / "data" / "traces" / "captured.jsonl"


def test_a_trace_captured_from_the_engine_replays_hit_for_hit():
    meta = json.loads(CAPTURED.with_suffix(".json").read_text())
    engine = meta["engine"]
    config = EngineConfig(engine["num_gpu_blocks"], engine["block_size"], engine["max_num_batched_tokens"],
                          engine["max_num_seqs"], engine["max_model_len"], False, async_scheduling=False)
    log: list[dict] = []
    result = Simulation(config, 1, "round-robin", msgspec.convert(meta["replay_costs"], CostModel), "off",
                        log=log).run(read_trace(CAPTURED, engine["block_size"]))
    simulated = [x["hit_tokens"] for x in sorted(log, key=lambda x: x["index"])]
    captured = [r["vllm_cached_tokens"] for r in meta["requests"]]
    assert len(simulated) == len(captured) == result.answered
    assert simulated == captured
    assert result.evictions > 0 and 0 < sum(captured) < sum(r["prompt_tokens"] for r in meta["requests"]), \
        "the histories outgrew the cache: some hit, some were evicted"
    arrivals = {x["index"]: x["arrival_s"] for x in log}
    assert [arrivals[i] for i in range(len(captured))] == [r["arrival"] for r in meta["requests"]], \
        "each request arrived at the step it was added to the engine"
