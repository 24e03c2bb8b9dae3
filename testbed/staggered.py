"""The runtime tests' workload: requests arriving in two waves, so that later steps mix fresh prefills with
decodes that need history (the steps where KVPP broadcasts); tests compare two runs of it (KVPP off and on),
each an engine of its own.

After the waves the same engine can answer further prompts, each alone (`references`: the reference answers
another test needs from an engine of this shape, without starting one more), and serve a capacity load
(`load`: every prompt at once, vLLM's own scheduler gauges read after every step, so a test sees how many ran
together and how many blocks they held). With `corrupt_above` N the load is served a second time while every
worker zeroes each KV block numbered N or higher after every step: the negative control of a capacity test
(answers that depended on blocks past N must change).

Before the waves, `probe` prompts can be served twice, at once each time: on the fresh cache, then after `churn`
(prompts decoding together, so that each one's blocks interleave with the others', then finishing in groups) has
left the free blocks scattered and full of stale histories. Each pass reports its answers, its requests'
block ids and every worker's KVPP counters over it: what a bytes test compares. Between the probe and the waves,
`multi_turn` conversations (testbed/multi_turn.py) can take their turns: what a prefix-hit-rate test compares.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from testbed.engine import Stepper, greedy, llm_metric, tokens_and_logprobs
from testbed.multi_turn import MultiTurn

Count = Annotated[int, msgspec.Meta(ge=0)]
Tokens = Annotated[int, msgspec.Meta(ge=1)]


class Staggered(msgspec.Struct, tag="staggered", forbid_unknown_fields=True, frozen=True):
    prompts: list[list[int]]
    first_wave: Count = 2
    """Prompts submitted before the first step; the rest join after `steps_between_waves` steps."""
    steps_between_waves: Count = 3
    max_tokens: Tokens = 8
    repeats: Count = 0
    """Further passes over the same prompts after the waves, all submitted at once: where vLLM's prefix cache is
    on, they find the prompts' blocks cached (each output's `cached_tokens`)."""
    references: dict[str, list[int]] = {}
    reference_max_tokens: Tokens = 8
    load: list[list[int]] = []
    load_max_tokens: Tokens = 8
    corrupt_above: Count | None = None
    probe: list[list[int]] = []
    churn: list[list[int]] = []
    churn_max_tokens: list[Tokens] = []
    """One per churn prompt."""
    multi_turn: MultiTurn | None = None

    def __post_init__(self) -> None:
        if len(self.churn_max_tokens) != len(self.churn):
            raise ValueError(f"churn_max_tokens: one per churn prompt, got {len(self.churn_max_tokens)} for "
                             f"{len(self.churn)}")
        if self.churn and not self.probe:
            raise ValueError("churn: runs between the probe's passes, so it needs probe prompts")

    @property
    def block_zeroing(self) -> bool:
        return self.corrupt_above is not None

    def serve(self, llm) -> dict:
        """{"outputs": {index: {"token_ids", "logprobs"}}, "workers": each worker's kvpp_stats, "step_seconds"
        of the waves, "references": {name: {"tokens", "logprobs"}}, "load": {"clean", "corrupted"},
        "probe": {"fresh", "churned"}, "multi_turn": MultiTurn.serve's (None without it)}."""
        probe = {}
        if self.probe:
            probe["fresh"] = self._probe(llm)
            churn = Stepper(llm)
            for i, (ids, tokens) in enumerate(zip(self.churn, self.churn_max_tokens)):
                churn.add(f"churn-{i}", ids, greedy(tokens))
            churn.finish()
            probe["churned"] = self._probe(llm)
        multi_turn = None if self.multi_turn is None else self.multi_turn.serve(llm)
        waves = Stepper(llm)
        params = greedy(self.max_tokens)
        for i in range(min(self.first_wave, len(self.prompts))):
            waves.add(str(i), self.prompts[i], params)
        for _ in range(self.steps_between_waves):
            waves.step()
        for i in range(self.first_wave, len(self.prompts)):
            waves.add(str(i), self.prompts[i], params)
        outputs = _outputs(waves, waves.finish())
        repeats = []
        for k in range(1, self.repeats + 1):
            again = Stepper(llm)
            for i, ids in enumerate(self.prompts):
                again.add(f"{k}/{i}", ids, params)
            repeats.append({key.partition("/")[2]: value for key, value in _outputs(again, again.finish()).items()})
        reports = llm.collective_rpc("kvpp_stats")
        references = {name: self._alone(llm, name, ids) for name, ids in self.references.items()}
        load = {}
        if self.load:
            load["clean"] = self._serve_load(llm, "load-")
            if self.corrupt_above is not None:
                load["corrupted"] = self._serve_load(llm, "corrupt-", self.corrupt_above)
        return {"outputs": outputs, "repeats": repeats, "workers": reports, "step_seconds": waves.step_seconds,
                "references": references, "load": load, "probe": probe, "multi_turn": multi_turn,
                "prefix_cache": {"hits": llm_metric(llm, "vllm:prefix_cache_hits"),
                                 "queries": llm_metric(llm, "vllm:prefix_cache_queries")},
                "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}

    def _probe(self, llm) -> dict:
        """The probe prompts at once: answers, each request's block ids after its prefill, and each worker's
        KVPP broadcast counters over the pass (empty with KVPP off)."""
        before = llm.collective_rpc("kvpp_stats")
        stepper = Stepper(llm)
        for i, ids in enumerate(self.probe):
            stepper.add(str(i), ids, greedy(self.max_tokens))
        stepper.step()  # every probe prompt fits the first step: all are prefilled and hold their blocks
        block_ids = {str(i): stepper.block_ids(str(i)) for i in range(len(self.probe))}
        outputs = _outputs(stepper, stepper.finish())
        after = llm.collective_rpc("kvpp_stats")
        counters = [{key: value - b["broadcast"][key] for key, value in a["broadcast"].items()
                     if isinstance(value, int)} if "broadcast" in a else {} for b, a in zip(before, after)]
        return {"outputs": outputs, "block_ids": block_ids, "workers": counters, "step_seconds": stepper.step_seconds}

    def _alone(self, llm, name: str, ids: list[int]) -> dict:
        stepper = Stepper(llm)
        stepper.add(f"reference-{name}", ids, greedy(self.reference_max_tokens))
        (out,) = stepper.finish().values()
        tokens, logprobs = tokens_and_logprobs(out)
        return {"tokens": tokens, "logprobs": logprobs}

    def _serve_load(self, llm, tag: str, corrupt_above: int | None = None) -> dict:
        """Every load prompt at once, stepped to the end: outputs plus the peaks of vLLM's own gauges and the
        preemptions its counter added meanwhile."""
        peaks = {"vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.0}

        def after_step(_stepper: Stepper) -> None:
            if corrupt_above is not None:
                llm.collective_rpc("zero_blocks_from", args=(corrupt_above,))
            for name, peak in peaks.items():
                peaks[name] = max(peak, llm_metric(llm, name))

        preempted_before = llm_metric(llm, "vllm:num_preemptions")
        stepper = Stepper(llm, after_step)
        params = greedy(self.load_max_tokens)
        for i, ids in enumerate(self.load):
            stepper.add(f"{tag}{i}", ids, params)
        outputs = {key.removeprefix(tag): value for key, value in _outputs(stepper, stepper.finish()).items()}
        return {"outputs": outputs, "peak_running": peaks["vllm:num_requests_running"],
                "peak_kv_usage": peaks["vllm:kv_cache_usage_perc"],
                "preemptions": llm_metric(llm, "vllm:num_preemptions") - preempted_before}


def _outputs(stepper: Stepper, finished: dict) -> dict:
    """Each finished request's tokens and logprobs, the prompt tokens vLLM's prefix cache (or a connector)
    supplied, and the steps it took to its first token."""
    outputs = {}
    for request_id, out in finished.items():
        token_ids, logprobs = tokens_and_logprobs(out)
        outputs[request_id] = {"token_ids": token_ids, "logprobs": logprobs, "cached_tokens": out.num_cached_tokens,
                               "prefill_steps": stepper.prefill_steps[request_id]}
    return outputs


def assert_same_outputs(ref: dict, got: dict, num_prompts: int, max_tokens: int, logprob_tol: float = 1e-5) -> None:
    """Two runs answered every prompt with the same tokens, and logprobs equal within `logprob_tol` (fp32)."""
    assert sorted(ref["outputs"]) == sorted(got["outputs"]) == sorted(str(i) for i in range(num_prompts))
    for req, want in ref["outputs"].items():
        have = got["outputs"][req]
        assert len(want["token_ids"]) == max_tokens
        assert have["token_ids"] == want["token_ids"], f"request {req}"
        worst = max(abs(a - b) for a, b in zip(have["logprobs"], want["logprobs"]))
        assert worst <= logprob_tol, f"request {req}: logprobs differ by {worst}"


def assert_bit_identical(ref: dict, got: dict) -> dict:
    """Every logprob bit-identical (and so every token): the ranks' latents are bit-identical with KVPP off
    (measured), and KVPP attends over those very bytes, copied (staging) or read in place (zero-copy), with the
    engine core in process batching alike; so KVPP must change nothing at all."""
    agreement = logprob_agreement(ref, got)
    assert agreement["bit_identical"] == agreement["total"] > 0, agreement
    return agreement


def logprob_agreement(ref: dict, got: dict) -> dict:
    """How closely two runs' logprobs agree: how many are bit-identical out of all, and the largest gap."""
    pairs = [(a, b) for req, want in ref["outputs"].items()
             for a, b in zip(want["logprobs"], got["outputs"][req]["logprobs"])]
    return {"bit_identical": sum(a == b for a, b in pairs), "total": len(pairs),
            "max_abs_diff": max((abs(a - b) for a, b in pairs), default=0.0)}
