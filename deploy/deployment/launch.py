"""The launch builders that `deploy.deployment.resolved.resolve` composes: the rendered config files and
the path type that names them, the pool's service command and config files, the P/D front's command,
and the launchers an engine is started with.

The resolution calls the spec's builders here once per spec; `kvpp check`, `kvpp render` and Engine read
what it resolved, so none of them works a fact out again.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

import msgspec

from kvpp_core.platforms import VLLM_CPU
from connectors.common.hosts import host_url, wildcard

from connectors.store.backends.settings import MooncakeSettings

from deploy.deployment.spec import Proxy, Spec

CONFIG_DIR = "/etc/kvpp"
MOONCAKE_CONFIG = "mooncake.json"
MEMCACHE_CONFIG = "mmc-local.conf"
MEMCACHE_META_CONFIG = "mmc-meta.conf"
POOL_SERVICE = "kvpp-pool"
"""The Kubernetes Service of the pool."""


class ConfigFile(str):
    """A path to one of the rendered config files (`/etc/kvpp/<file>`, where Kubernetes mounts them).

    Its own type, so a shell script can point it at the script's directory instead, without
    mistaking a user's value that merely looks like a config path for one of ours.
    """

    file: str

    def __new__(cls, file: str) -> ConfigFile:
        path = super().__new__(cls, f"{CONFIG_DIR}/{file}")
        path.file = file
        return path

    def __reduce__(self):  # copies and pickles rebuild it from the file name, not the full path
        return ConfigFile, (self.file,)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` with `override` merged in; nested objects merge, other values from `override` win."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def replace_flag(args: Sequence[str], flag: str, value: str) -> list[str]:
    """`args` with the value after the first `flag` replaced (a flag the launch builders set themselves)."""
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def flag_value(args: Sequence[str], flag: str, default: str | None = None) -> str | None:
    """The value of `flag` in extra_args (`--flag v` or `--flag=v`, `_` or `-`; the last one wins, as in vLLM)."""
    value = default
    for i, arg in enumerate(args):
        name, eq, rest = arg.partition("=")
        if name.replace("_", "-") != flag:
            continue
        if eq:
            value = rest
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def switch(args: Sequence[str], flag: str) -> bool | None:
    """A vLLM on/off flag in extra_args: True for `--flag`, False for `--no-flag`, None when absent (the last wins)."""
    value = None
    for arg in args:
        name = arg.partition("=")[0].replace("_", "-")
        if name in (flag, "--no-" + flag.removeprefix("--")):
            value = name == flag
    return value


LAUNCHERS = ("vllm-serve", "api-server")
"""How an engine is started: `vllm serve` (GPU and Ascend installs), or `python3 -m
vllm.entrypoints.openai.api_server` for builds whose `vllm` command does not start (vllm-cpu 0.32.0
looks up a distribution named "vllm" and fails); the flags are the same."""


def default_launcher(platform: str) -> str:
    """The launcher of a spec's platform: the api-server module on vllm-cpu, whose `vllm` command does not
    start, `vllm serve` elsewhere."""
    return "api-server" if platform == VLLM_CPU.name else "vllm-serve"


def mooncake_store_config(spec: Spec, master: str | None = None) -> dict[str, Any]:
    """The Mooncake store client config file shared by every pooled node (pool.settings win);
    `master` overrides where engines find mooncake_master (in Kubernetes: the pool's Service)."""
    base = MooncakeSettings(master_server_address=master or spec.pool.address, metadata_server="P2PHANDSHAKE",
                            protocol="tcp")
    return msgspec.structs.replace(base, **spec.pool.mooncake.explicit()).explicit()


def memcache_local_config(spec: Spec) -> str:
    """mmc-local.conf: `ock.mmc.<key> = value` lines; the meta service URL comes from pool.address."""
    settings = {"meta_service_url": f"tcp://{spec.pool.address}", **spec.pool.settings}
    return "".join(f"ock.mmc.{k} = {_conf_value(v)}\n" for k, v in settings.items())


def memcache_meta_config(spec: Spec, bind_host: str | None = None) -> str:
    """mmc-meta.conf for the MetaService; `bind_host` overrides the host it listens on."""
    keys = ("meta_service_url", "meta_service.config_store_url", "meta_service.metrics_url", "log_level")
    settings = {"meta_service_url": host_url("tcp", bind_host or spec.pool.host, spec.pool.port), **spec.pool.settings}
    store = settings.get("local_service.config_store_url")
    if store:
        settings.setdefault("meta_service.config_store_url", store)
    return "".join(f"ock.mmc.{k} = {_conf_value(settings[k])}\n" for k in keys if k in settings)


def config_files(spec: Spec, bind_any: bool = False) -> dict[str, str]:
    """Pool client/service config files; `bind_any` is the Kubernetes variant: the service listens on
    its pod's addresses and engines reach the Mooncake master through the pool's Service."""
    if spec.pool.backend == "mooncake":
        master = f"{POOL_SERVICE}.{spec.kubernetes.namespace}.svc:{spec.pool.port}" if bind_any else None
        return {MOONCAKE_CONFIG: json.dumps(mooncake_store_config(spec, master), indent=2, sort_keys=True) + "\n"}
    return {MEMCACHE_CONFIG: memcache_local_config(spec),
            MEMCACHE_META_CONFIG: memcache_meta_config(spec, wildcard([spec.pool.host]) if bind_any else None)}


def _conf_value(value: Any) -> str:
    """One mmc config value (`kvpp check` has refused anything but one-line text and numbers)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def pool_command(spec: Spec) -> tuple[list[str], dict[str, str]]:
    """The pool service process (Mooncake master or memcache MetaService) and its environment."""
    pool = spec.pool
    if pool.backend == "mooncake":
        # The master plus a segment holder that owns the pool's memory, so pooled prefixes outlive
        # every engine (engines contribute no segment); `kvpp pool serve` supervises both.
        argv = ["kvpp", "pool", "serve", "--host", pool.host, "--port", str(pool.port),
                "--segment-size", pool.segment_size]
        if pool.metrics_port is not None:
            argv += ["--metrics-port", str(pool.metrics_port)]
        return argv, {}
    code = "import sys, memcache_hybrid; sys.exit(memcache_hybrid.MetaService.main())"
    return ["python3", "-c", code], {"MMC_META_CONFIG_PATH": ConfigFile(MEMCACHE_META_CONFIG)}


def vllm_router_args(prefill_urls: list[str], decode_urls: list[str], host: str, port: int, metrics_port: int,
                     extra_args: tuple[str, ...] | list[str] = (), events: list[str] | None = None) -> list[str]:
    """`vllm-router` in its vLLM P/D mode, whose NIXL-shaped `kv_transfer_params` MooncakeConnectorV2 speaks
    (its prefill leg asks for `do_remote_decode`, and the prefill's answer goes to the decode verbatim); with
    `events` (each prefill's KV event endpoint) its `kv_aware` prefill policy reads them."""
    argv = ["vllm-router", "--vllm-pd-disaggregation"]
    for url in prefill_urls:
        argv += ["--prefill", url]
    for url in decode_urls:
        argv += ["--decode", url]
    if events is not None:
        argv += ["--prefill-policy", "kv_aware"]
        for url, endpoint in zip(prefill_urls, events, strict=True):
            argv += ["--pd-kv-events", f"{url}={endpoint}"]
    return argv + ["--host", host, "--port", str(port), "--prometheus-host", host,
                   "--prometheus-port", str(metrics_port), *extra_args]


def proxy_args(proxy: Proxy, host: str, metrics_port: int | None, urls: dict[str, list[str]],
               events: list[tuple[str, str]] | None = None, block_size: int | None = None) -> list[str]:
    """The P/D front's argv (`kvpp proxy` or `vllm-router`, proxy.router) on `host` for the P/D instances at
    their base URLs; `metrics_port`: vllm-router's Prometheus port; `events`: each prefill's KV event endpoint and
    its replay endpoint, for the cache-aware prefill choice (proxy.cache_aware; vllm-router reads no replay), with
    the prefills' `block_size` where the spec names one."""
    listen = wildcard([host])
    if proxy.router == "vllm-router":
        return vllm_router_args(urls["prefill"], urls["decode"], listen, proxy.port, metrics_port, proxy.extra_args,
                                None if events is None else [live for live, _ in events])
    argv = ["kvpp", "proxy", "--prefill", ",".join(urls["prefill"]), "--decode", ",".join(urls["decode"]),
            "--host", listen, "--port", str(proxy.port)]
    if proxy.max_in_flight is not None:
        argv += ["--max-in-flight", str(proxy.max_in_flight)]
    if events is not None:
        argv += kv_events_flags(events, block_size)
    return argv + list(proxy.extra_args)


def kv_events_flags(events: Sequence[tuple[str, str]], block_size: int | None = None) -> list[str]:
    """`kvpp proxy`'s flags for each prefill's (live, replay) KV event endpoints, in the order of its --prefill, and
    the prefills' block size where known (events of another size are then refused, never learned)."""
    return ["--kv-events", ",".join(live for live, _ in events), "--kv-events-replay",
            ",".join(replay for _, replay in events), *(["--kv-events-block-size", str(block_size)] if block_size else [])]
