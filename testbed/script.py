"""A scripted sequence of named actions on one engine: the pool tests' workload and the anchor benchmark's.

Each action is a JSON list whose first element names its kind:

  ["gen", name, token_ids, options?]            one prompt, served alone
  ["batch", [[name, token_ids, options?], ...], batch_options?]
                                                several at once, admitted in this order (looked up and loaded
                                                concurrently); batch_options {"zero_blocks_of": name} zeroes
                                                that request's KV blocks after every engine step from its
                                                first schedule until it ends: a negative control
  ["kill", pid]                                 SIGKILL a process (the pool's master) mid-run
  ["decode", name, [token_ids, ...], max_tokens]
                                                a batch decoding together: the median of its last steps
  ["waves", name, [[token_ids, ...], ...]]      waves of one-token prompts, each after the previous: seconds
  ["pause", name, seconds]                      let the pool's background saves land
  ["settle", name]                              step the engine until its scheduler holds no request: every
                                                pool save of the requests served so far reported (and, with KV
                                                events on, the pool's events of them published); the steps taken
  ["remove", name, kv_connector_extra_config, [key, ...]]
                                                remove pool objects through a store client of the engine's pool,
                                                between requests of one engine: each key's status

A request's options may hold "cache_salt" and "kv_transfer_params" (e.g. {"do_remote_decode": true}, as a
P/D proxy sends a prefill); it generates the script's max_tokens. Each served request records its tokens and
their logprobs, how many prompt tokens came from outside the engine (num_cached_tokens), its seconds, and the
KV block ids the scheduler gave it (block_ids: its first KV cache group's when first scheduled, loaded blocks
included), so a test reads where a load landed. "kv_usage_after" holds vLLM's own `vllm:kv_cache_usage_perc`
after each gen or batch (blocks a P/D prefill still holds for its decode count as used), "kvpp_workers" each
worker's `kvpp_stats` report.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from typing import Annotated, Union

import msgspec

from testbed.engine import Stepper, greedy, llm_metric, tokens_and_logprobs

Tokens = Annotated[int, msgspec.Meta(ge=1)]


class Options(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None


class Request(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    name: str
    ids: list[int]
    opts: Options = Options()


class Gen(Request, tag="gen"):
    pass


class BatchOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    zero_blocks_of: str | None = None


class Batch(msgspec.Struct, tag="batch", array_like=True, forbid_unknown_fields=True, frozen=True):
    requests: list[Request]
    opts: BatchOptions = BatchOptions()


class Kill(msgspec.Struct, tag="kill", array_like=True, forbid_unknown_fields=True, frozen=True):
    pid: Annotated[int, msgspec.Meta(ge=1)]


class Decode(msgspec.Struct, tag="decode", array_like=True, forbid_unknown_fields=True, frozen=True):
    name: str
    prompts: list[list[int]]
    max_tokens: Tokens


class Waves(msgspec.Struct, tag="waves", array_like=True, forbid_unknown_fields=True, frozen=True):
    name: str
    waves: list[list[list[int]]]


class Pause(msgspec.Struct, tag="pause", array_like=True, forbid_unknown_fields=True, frozen=True):
    name: str
    seconds: Annotated[float, msgspec.Meta(ge=0)]


class Settle(msgspec.Struct, tag="settle", array_like=True, forbid_unknown_fields=True, frozen=True):
    name: str


class Remove(msgspec.Struct, tag="remove", array_like=True, forbid_unknown_fields=True, frozen=True):
    name: str
    pool: dict
    """The pool's kv_connector_extra_config (`kvpp pool up` prints it)."""
    keys: list[str]


Action = Union[Gen, Batch, Kill, Decode, Waves, Pause, Settle, Remove]


class Script(msgspec.Struct, tag="script", forbid_unknown_fields=True, frozen=True):
    actions: list[Action]
    max_tokens: Tokens = 6

    @property
    def block_zeroing(self) -> bool:
        return any(isinstance(a, Batch) and a.opts.zero_blocks_of is not None for a in self.actions)

    def serve(self, llm) -> dict:
        block_ids = record_block_ids(llm)
        results: dict = {"kv_usage_after": []}
        for i, action in enumerate(self.actions):
            print(f"[script] {i + 1}/{len(self.actions)} {action.__struct_config__.tag} "
                  f"{getattr(action, 'name', '')}", file=sys.stderr, flush=True)
            if isinstance(action, (Gen, Batch)):
                requests, zero_blocks_of = ([action], None) if isinstance(action, Gen) else \
                    (action.requests, action.opts.zero_blocks_of)
                results.update(self._serve(llm, block_ids, requests, zero_blocks_of))
                results["kv_usage_after"].append(llm_metric(llm, "vllm:kv_cache_usage_perc"))
            elif isinstance(action, Kill):
                os.kill(action.pid, signal.SIGKILL)
            elif isinstance(action, Decode):
                results[action.name] = _decode(llm, action)
            elif isinstance(action, Waves):
                results[action.name] = _waves(llm, action)
            elif isinstance(action, Settle):
                results[action.name] = _settle(llm)
            elif isinstance(action, Remove):
                results[action.name] = _remove(action)
            else:
                time.sleep(action.seconds)
        results["kvpp_workers"] = llm.collective_rpc("kvpp_stats")
        return results

    def _serve(self, llm, block_ids: dict[str, list[int]], requests: list[Request],
               zero_blocks_of: str | None) -> dict[str, dict]:
        """The requests under their names, stepped to the end (what LLM.generate does)."""
        block_ids.clear()
        start = time.perf_counter()

        def zero(stepper: Stepper) -> None:
            if zero_blocks_of in block_ids and zero_blocks_of not in stepper.finished:  # then they are someone else's
                llm.collective_rpc("zero_blocks", args=(block_ids[zero_blocks_of],))

        stepper = Stepper(llm, zero if zero_blocks_of is not None else None)
        for r in requests:
            extra = None if r.opts.kv_transfer_params is None else {"kv_transfer_params": r.opts.kv_transfer_params}
            stepper.add(r.name, r.ids, greedy(self.max_tokens, extra), r.opts.cache_salt)
        finished = stepper.finish()
        records = {}
        for r in requests:
            out = finished[r.name]
            tokens, logprobs = tokens_and_logprobs(out)
            records[r.name] = {"tokens": tokens, "logprobs": logprobs, "num_cached_tokens": out.num_cached_tokens,
                               "seconds": time.perf_counter() - start, "block_ids": block_ids.get(r.name)}
        return records


def _decode(llm, action: Decode) -> dict:
    stepper = Stepper(llm)
    params = greedy(action.max_tokens)
    for j, ids in enumerate(action.prompts):
        stepper.add(f"{action.name}-{j}", ids, params)
    finished = stepper.finish()
    steps = stepper.step_seconds
    # The first steps load and prefill; the last half of max_tokens are decode steps only.
    return {"step_seconds": statistics.median(steps[-(action.max_tokens // 2):]), "steps": len(steps),
            "tokens": [list(finished[f"{action.name}-{j}"].outputs[0].token_ids) for j in range(len(action.prompts))]}


def _waves(llm, action: Waves) -> dict:
    started, pooled, prompt_tokens = time.perf_counter(), 0, 0
    for w, wave in enumerate(action.waves):
        stepper = Stepper(llm)
        for j, ids in enumerate(wave):
            stepper.add(f"{action.name}-{w}-{j}", ids, greedy(1))
        pooled += sum(out.num_cached_tokens for out in stepper.finish().values())
        prompt_tokens += sum(len(ids) for ids in wave)
    return {"seconds": time.perf_counter() - started, "prompt_tokens": prompt_tokens, "pooled_tokens": pooled}


def _settle(llm) -> int:
    """Steps until the scheduler holds no request: a finished request whose pool saves are still running stays
    in it (its blocks held) until the workers report them, and LLM.generate stops stepping before that."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # the engine core runs in this process
    steps = 0
    while scheduler.has_requests():
        llm.llm_engine.step()
        steps += 1
    return steps


def _remove(action: Remove) -> list[str]:
    from connectors.store.backends import open_backend
    from connectors.store.settings import parse_store_settings

    backend = open_backend(parse_store_settings(action.pool))  # bounded as those settings say (a removal: the floor)
    try:
        return [status.name for status in backend.remove(action.keys)]
    finally:
        backend.close()


def record_block_ids(llm) -> dict[str, list[int]]:
    """Each request's block ids (first KV cache group) when the scheduler first schedules it, by the request id
    its output carries (vLLM appends 8 random characters inside the engine), as the workers receive them."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # the engine core runs in this process
    seen: dict[str, list[int]] = {}
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for req in out.scheduled_new_reqs:
            seen.setdefault(req.req_id.rsplit("-", 1)[0], list(req.block_ids[0]))
        return out

    scheduler.schedule = recording
    return seen
