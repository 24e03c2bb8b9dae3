"""KV-pool benchmark: the connector's save/load path against raw Mooncake batch calls moving the same
bytes on the same pool, and time to first token of a long prompt with a pool hit vs without.

    python -m bench.pool --json                 # throughput only (no engine)
    flock /tmp/kvpp-engine.lock python -m bench.pool --ttft --model /path/to/tiny16 --json

Throughput: a real `mooncake_master` plus the pool's segment holder (`kvpp pool up`); caches shaped like
the tiny MLA model's ([blocks, 16, 576] fp32 per layer). "connector" runs `ShardIO.save/load` (key
derivation, the skip-if-pooled existence check, the copy through a staging slot, multi-page zero-copy
put/get of the slot, status normalisation, bounded calls); "raw" calls
`batch_put_from_multi_buffers`/`batch_get_into_multi_buffers` on the pages themselves with the same batch
size. Runs alternate and the median is reported; ratio = connector / raw.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

POOL_ENV = {"MC_LOG_LEVEL": "ERROR"}


def throughput(blocks: int, batch: int, layers: int, repeats: int) -> dict:
    os.environ.update(POOL_ENV)
    import torch

    from connectors.store.backends import Status, open_backend
    from connectors.store.keys import CacheLayout, ShardKey, block_hashes
    from connectors.store.staging import SLOT_BYTES, Staging
    from connectors.store.transfer import BlockPages, ShardIO
    from deploy.services.pool import pool_down, pool_up

    src = [torch.randn(blocks, 16, 576) for _ in range(layers)]
    dst = [torch.zeros(blocks, 16, 576) for _ in range(layers)]
    src_pages, dst_pages = BlockPages(src), BlockPages(dst)
    total = blocks * src_pages.object_bytes
    # Room for every pass's objects with the master's eviction watermark far away.
    segment = 4 * repeats * total + (64 << 20)
    state = Path(tempfile.mkdtemp(prefix="kvpp-bench-pool-"))
    pool = pool_up("mooncake", state, segment)
    try:
        backend = open_backend(pool.store_config, call_timeout_s=60)
        staging = Staging(max(SLOT_BYTES, src_pages.object_bytes))
        for t in src + dst + staging.tensors:
            backend.register(t.data_ptr(), t.numel() * t.element_size())
        raw = backend.raw()
        layout = CacheLayout("bench", "float32", 16, src_pages.page_bytes)
        batches = [list(range(i, min(i + batch, blocks))) for i in range(0, blocks, batch)]
        results = {"save": {"connector": [], "raw": []}, "load": {"connector": [], "raw": []}}
        for rep in range(repeats):
            tokens = [random.Random(rep).randrange(1 << 20) for _ in range(16 * blocks)]
            hashes = block_hashes(tokens, 16)
            io = ShardIO(backend, ShardKey(layout.fingerprint(range(layers)), 0, rep), src_pages, staging)
            raw_keys = [f"bench/raw/{rep}/{h}" for h in hashes]
            order = ("connector", "raw") if rep % 2 == 0 else ("raw", "connector")
            for who in order:
                start = time.perf_counter()
                for ids in batches:
                    if who == "connector":
                        res = io.save(ids, [hashes[i] for i in ids])
                        assert res.saved == len(ids), res
                    else:
                        codes = raw.batch_put_from_multi_buffers([raw_keys[i] for i in ids],
                                                                 [src_pages.ptrs(i) for i in ids],
                                                                 [src_pages.sizes()] * len(ids))
                        assert all(c == 0 for c in codes), codes
                results["save"][who].append(total / (time.perf_counter() - start))
            load_io = ShardIO(backend, io.shard, dst_pages, staging)
            for who in order:
                for t in dst:
                    t.zero_()
                start = time.perf_counter()
                for ids in batches:
                    if who == "connector":
                        got = load_io.load(ids, [hashes[i] for i in ids])
                        assert got == [Status.OK] * len(ids), got
                    else:
                        codes = raw.batch_get_into_multi_buffers([raw_keys[i] for i in ids],
                                                                 [dst_pages.ptrs(i) for i in ids],
                                                                 [dst_pages.sizes()] * len(ids))
                        assert all(c == dst_pages.object_bytes for c in codes), codes
                results["load"][who].append(total / (time.perf_counter() - start))
                assert all(torch.equal(s, d) for s, d in zip(src, dst)), f"{who} load corrupted bytes"
        backend.close()
    finally:
        pool_down(state)
    out = {"bytes_per_pass": total, "blocks": blocks, "batch_blocks": batch, "layers": layers, "repeats": repeats,
           "object_bytes": src_pages.object_bytes}
    for op, runs in results.items():
        conn, base = statistics.median(runs["connector"]), statistics.median(runs["raw"])
        out[op] = {"connector_GBps": round(conn / 1e9, 3), "raw_GBps": round(base / 1e9, 3),
                   "ratio": round(conn / base, 3), "target": 0.9}
    return out


def ttft(model: str, prompt_tokens: int, suffix_tokens: int) -> dict:
    from deploy.services.pool import pool_down, pool_up
    from testbed.engine import EngineSettings
    from testbed.engine_run import Job, run_engine
    from testbed.prompts import token_draws
    from testbed.script import Script

    os.environ.update(POOL_ENV)
    draw = token_draws(model, 11)
    prefix, cold, warm = draw(prompt_tokens), draw(prompt_tokens + suffix_tokens), draw(20)
    hot = prefix + draw(suffix_tokens)
    state = Path(tempfile.mkdtemp(prefix="kvpp-bench-ttft-"))
    pool = pool_up("mooncake", state, 256 << 20)
    try:
        def run(tag, actions):
            extra = {**pool.kv_connector_extra_config, "load_async": True, "stats_file": str(state / f"stats-{tag}")}
            ktc = {"kv_connector": "AscendStoreConnector", "kv_connector_module_path": "connectors.store.connector",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
            job = Job(EngineSettings(model=model, kv_transfer_config=ktc),
                      msgspec.convert({"actions": actions, "max_tokens": 1}, Script))
            return run_engine(job)

        run("save", [["gen", "prefix", prefix]])
        # A fresh engine: warm up, then the same-length prompt without and with a pooled prefix.
        res = run("serve", [["gen", "warmup", warm], ["gen", "miss", cold], ["gen", "hit", hot],
                            ["gen", "miss2", draw(prompt_tokens + suffix_tokens)], ["gen", "hit2", hot[:-1] + draw(1)]])
    finally:
        pool_down(state)
    miss = statistics.mean([res["miss"]["seconds"], res["miss2"]["seconds"]])
    hit = statistics.mean([res["hit"]["seconds"], res["hit2"]["seconds"]])
    return {"prompt_tokens": prompt_tokens + suffix_tokens, "pooled_tokens": res["hit"]["num_cached_tokens"],
            "ttft_miss_s": round(miss, 4), "ttft_hit_s": round(hit, 4), "speedup": round(miss / hit, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="blocks per save/load call (one request's blocks)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ttft", action="store_true", help="also time first tokens in real engines (needs --model)")
    ap.add_argument("--model", help="tiny model directory (kvpp tiny-model)")
    ap.add_argument("--prompt-tokens", type=int, default=960)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = {"backend": "mooncake", "throughput": throughput(args.blocks, args.batch, args.layers, args.repeats)}
    if args.ttft:
        if not args.model:
            ap.error("--ttft needs --model (build one with `kvpp tiny-model`)")
        report["ttft"] = ttft(args.model, args.prompt_tokens, 32)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
