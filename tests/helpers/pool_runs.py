"""Offline engine runs against a real Mooncake KV pool (testbed/script.py's workload, in a process group of
its own), shared by the store connector's engine tests."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from connectors.store.backends import Backend, open_backend
from connectors.store.settings import StoreSettings
from testbed.engine import EngineSettings
from testbed.engine_run import Job, run_engine
from testbed.prompts import token_draws
from testbed.script import Script

BLOCK = 16
PAGE_BYTES = BLOCK * 576 * 4  # one layer's block: 16 tokens x (512 latent + 64 rope) fp32
LOGPROB_TOL = 2e-5  # loaded KV vs one whole-prompt forward: same tokens, last-bit logprob differences
POOL_ENV = {"MC_LOG_LEVEL": "ERROR", "MC_RPC_TIMEOUT_MS": "2000", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}
"""Every test store client's environment (test processes, the pools they start, pool engines): quiet, one setup
try, a 2 s master RPC bound, which the backend tests need short (what a stall turns into is their subject)."""
ENGINE_RPC_TIMEOUT_MS, CALL_BOUND_MS, LOOKUP_BOUND_MS = 10_000, 20_000, 25_000
"""The store timers of every pool engine run and of the tests' own clients beside them. Engine workers share 2
cores with the engine core and, under `make test`, with the other tiers: there a save's master RPC took over
2 s (the store PP module), and a put and a load over 4 s (the TP2 module's zero-copy engine, in CI and on a
2-core host beside four busy loops): counted failed, the saves were never announced and the load was
recomputed. The engine tests assert pool hits, so every store call of theirs is bounded by CALL_BOUND_MS alone
(floor and ceiling, `LONG_BOUNDS`), far above the connector's defaults (0.5-3 s), whose fault behaviour
tests/connectors/store/backends/test_mooncake.py covers; a killed master still fails each call in about 0-4 s
whatever these are (measured), and a lookup outlasts the store call it waits for."""
LONG_BOUNDS = {"lookup_timeout_ms": LOOKUP_BOUND_MS, "backend_timeout_ms": CALL_BOUND_MS,
               "backend_timeout_floor_ms": CALL_BOUND_MS}
"""The connector settings of those bounds (kv_connector_extra_config keys)."""
POOL_TIMERS = {"lease_ttl_ms": 10_000, "client_ttl_s": 10}
"""Test pools' master timers, Mooncake's defaults, as `kvpp pool up` runs. Both were shorter once and
both failed on this 2-core host under load: a read's lease of 0.5 s lapsed while a pool
engine's get was still transferring (LEASE_EXPIRED, the load failed), and a client TTL of 2 s dropped a
starved segment holder, whose segment the master unmounted with every pooled block in it (CI, the store
PP module; what that costs is test_mooncake's stalled-holder test). A lease does not stop a test's
removal: `remove` forces it."""
MAX_TOKENS = 6
OFF_SERVED = ("prefix_plus", "wrong_size", "after_kill", "salted_plus")
"""What the KVPP-off scenario's reference answers (its fresh engine serves them among others)."""
KVPP_SERVED = ("other_plus", "torn_plus", "wrong_size", "salted_plus", "prefix_plus")
"""What the KVPP scenario's fresh engine serves, in this order."""
KVPP_REFERENCED = (*KVPP_SERVED, "salted")
"""What the pool-free reference answers for the KVPP scenario: the fresh engine's prompts and the saved
"salted" prompt, the negative control's."""


def pool_prompts(model: str) -> dict[str, list[int]]:
    """The store engine test's prompts: saved prefixes, each with a 20-token continuation, and loners."""
    draw = token_draws(model, 7)
    prefix, other, torn, salted = draw(100), draw(100), draw(100), draw(100)  # 6 whole blocks + 4 tokens each
    return {
        "prefix": prefix, "prefix_plus": prefix + draw(20),
        "other": other, "other_plus": other + draw(20),
        "torn": torn, "torn_plus": torn + draw(20),
        "wrong_size": draw(70), "after_kill": draw(60),
        "salted": salted, "salted_plus": salted + draw(20),
    }


def store_config(pool, tmp: Path, tag: str, load_async: bool) -> dict:
    """The pool connector's kv_transfer_config, counting into stats-{tag} under `tmp`."""
    extra = {**pool.kv_connector_extra_config, **LONG_BOUNDS, "load_async": load_async,
             "stats_file": str(tmp / f"stats-{tag}")}
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def run_pool_engine(model: str, tmp: Path, tag: str, actions: list, env: dict[str, str] | None = None,
                    **settings) -> dict:
    """One engine of `settings` (EngineSettings fields) over `actions` (testbed/script.py's, checked here); its
    result. Its log is {tag}.log under `tmp`."""
    job = Job(EngineSettings(model=model, **settings),
              msgspec.convert({"actions": actions, "max_tokens": MAX_TOKENS}, Script))
    return run_engine(job, env={**POOL_ENV, "MC_RPC_TIMEOUT_MS": str(ENGINE_RPC_TIMEOUT_MS), **(env or {})},
                      log=tmp / f"{tag}.log")


def store_client(settings: StoreSettings) -> Backend:
    """A test's own store client beside the pool engines, bounded as they are."""
    return open_backend(settings, call_timeout_s=CALL_BOUND_MS / 1000)


def worker_stats(tmp: Path, tag: str, pp: int, tp: int) -> dict[str, int]:
    """The pool connector counters of one worker of run `tag`."""
    return json.loads((tmp / f"stats-{tag}.pp{pp}.tp{tp}.json").read_text())


def assert_same_output(got: dict, ref: dict) -> None:
    """Same tokens; logprobs within LOGPROB_TOL."""
    assert got["tokens"] == ref["tokens"]
    worst = max(abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"]))
    print(f"max |logprob(pool) - logprob(reference)| = {worst:.2e}")
    assert worst <= LOGPROB_TOL
