"""Deployment specs: one YAML file describing a (possibly disaggregated) KVPP deployment.

The schema is checked with JSON Schema and every violation is reported with its path
(`prefill[0].tp: ...`), so a spec is fixed in one pass. Defaults are filled in here, once, so that
`kvpp render` and `kvpp check` read the same values.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
POS_INT = {"type": "integer", "minimum": 1}
NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 40}
STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# Flags the renderer owns: giving them in extra_args would silently fight the merged values.
MANAGED_FLAGS = (
    "--additional-config", "--kv-transfer-config", "--tensor-parallel-size", "-tp",
    "--pipeline-parallel-size", "-pp", "--prefill-context-parallel-size", "-pcp",
    "--decode-context-parallel-size", "-dcp", "--data-parallel-size", "-dp", "--enforce-eager",
    "--port", "--host", "--kv-events-config", "--nnodes", "--node-rank", "--master-addr", "--headless",
)

MEMORY = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "gpu_memory_utilization": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "kv_cache_memory_bytes": POS_INT,
        "max_model_len": POS_INT,
        "max_num_batched_tokens": POS_INT,
        "max_num_seqs": POS_INT,
        "block_size": POS_INT,
    },
}

INSTANCE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "hosts", "tp"],
    "properties": {
        "name": NAME,
        "hosts": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        "port": PORT,
        "tp": POS_INT,
        "pp": POS_INT,
        "pp_layers": {"oneOf": [{"type": "null"}, {"type": "array", "minItems": 1, "items": POS_INT}]},
        "pcp": POS_INT,
        "dcp": POS_INT,
        "dp": POS_INT,
        "ep": {"type": "boolean"},
        "runner": {"enum": ["v1", "v2"]},
        "kv_port": PORT,
        "enable_kvpp": {"type": "boolean"},
        "enforce_eager": {"type": "boolean"},
        "kv_events": {"type": "boolean"},
        "uses_pool": {"type": "boolean"},
        "lookup_rpc_port": PORT,
        "memory": MEMORY,
        "additional_config": {"type": "object"},
        "kv_transfer_config": {"type": "object"},
        "extra_args": {"type": "array", "items": {"type": "string"}},
        "env": STR_MAP,
    },
}

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["model", "prefill"],
    "properties": {
        "model": {
            "type": "object",
            "additionalProperties": False,
            "required": ["path"],
            "properties": {
                "path": {"type": "string", "minLength": 1},
                "preset": {"type": "string", "minLength": 1},
                "served_name": {"type": "string", "minLength": 1},
                "mtp_layers": {"type": "integer", "minimum": 0},
            },
        },
        "prefill": {"type": "array", "minItems": 1, "items": INSTANCE},
        "decode": {"type": "array", "items": INSTANCE},
        "pool": {
            "type": "object",
            "additionalProperties": False,
            "required": ["backend", "address", "lookup_rpc_port"],
            "properties": {
                "backend": {"enum": ["mooncake", "memcache"]},
                "address": {"type": "string", "pattern": r"^[^\s:]+:[0-9]{1,5}$"},
                "lookup_rpc_port": PORT,
                "kv_role": {"enum": ["kv_producer", "kv_consumer", "kv_both"]},
                "metrics_port": PORT,
                "segment_size": {"type": "string", "pattern": r"^[0-9]+ ?([KMG]?B)?$"},
                "extra_config": {"type": "object"},
                "settings": {"type": "object"},
            },
        },
        "proxy": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"host": {"type": "string", "minLength": 1}, "port": PORT},
        },
        "kubernetes": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "namespace": NAME,
                "image": {"type": "string", "minLength": 1},
                "device_resource": {"type": "string", "minLength": 1},
                "devices_per_node": POS_INT,
                "proxy_image": {"type": "string", "minLength": 1},
            },
        },
    },
}

INSTANCE_DEFAULTS: dict[str, Any] = {
    "port": 8000, "pp": 1, "pp_layers": None, "pcp": 1, "dcp": 1, "dp": 1, "ep": False, "runner": "v1",
    "kv_port": None, "enable_kvpp": False, "enforce_eager": False, "kv_events": False, "uses_pool": None,
    "lookup_rpc_port": None, "memory": {}, "additional_config": {}, "kv_transfer_config": {},
    "extra_args": [], "env": {},
}
POOL_DEFAULTS: dict[str, Any] = {"kv_role": "kv_both", "metrics_port": None, "segment_size": "8GB",
                                 "extra_config": {}, "settings": {}}
PROXY_DEFAULTS: dict[str, Any] = {"host": None, "port": 8000}
K8S_DEFAULTS: dict[str, Any] = {
    "namespace": "default", "image": "vllm-ascend:latest", "device_resource": "huawei.com/ascend-1980",
    "devices_per_node": 8, "proxy_image": None,
}


class SpecError(ValueError):
    """A spec that does not match the schema; one line per problem, each with its path."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


@dataclass(frozen=True)
class Instance:
    """One vLLM serving instance (one or more nodes) after defaults."""

    role: str  # "prefill" or "decode"
    index: int
    name: str
    hosts: tuple[str, ...]
    port: int
    tp: int
    pp: int
    pp_layers: tuple[int, ...] | None
    pcp: int
    dcp: int
    dp: int
    ep: bool
    runner: str
    kv_port: int | None
    enable_kvpp: bool
    enforce_eager: bool
    kv_events: bool
    uses_pool: bool
    lookup_rpc_port: int | None
    memory: dict[str, Any]
    additional_config: dict[str, Any]
    kv_transfer_config: dict[str, Any]
    extra_args: tuple[str, ...]
    env: dict[str, str]

    @property
    def where(self) -> str:
        """Where the instance sits in the spec, for messages."""
        return f"{self.role}[{self.index}] ({self.name})"


@dataclass(frozen=True)
class Pool:
    backend: str
    address: str
    lookup_rpc_port: int
    kv_role: str
    metrics_port: int | None
    segment_size: str
    """Memory the pool's segment holder contributes (mooncake), e.g. 64GB."""
    extra_config: dict[str, Any]
    settings: dict[str, Any]

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


@dataclass(frozen=True)
class Spec:
    model_path: str
    model_preset: str | None
    served_name: str | None
    mtp_layers: int | None
    prefill: tuple[Instance, ...]
    decode: tuple[Instance, ...]
    pool: Pool | None
    proxy_host: str | None
    proxy_port: int
    kubernetes: dict[str, Any] = field(default_factory=dict)

    @property
    def instances(self) -> tuple[Instance, ...]:
        return self.prefill + self.decode

    @property
    def disaggregated(self) -> bool:
        return bool(self.decode)


def schema_problems(data: Any) -> list[str]:
    """Every schema violation, as `path: message`, in document order."""
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(SCHEMA)
    problems = []
    for err in sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path]):
        problems.append(f"{_path(err.absolute_path)}: {_message(err)}")
    if not problems:
        problems += _semantic_problems(data)
    return problems


def _path(parts) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _message(err) -> str:
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        return f"{err.message}; allowed keys: {', '.join(allowed)}"
    if err.validator == "pattern" and err.schema is NAME:
        return f"{err.instance!r} must be a lowercase DNS label (a-z, 0-9, '-'; it names Kubernetes objects)"
    return err.message


def _semantic_problems(data: dict) -> list[str]:
    """Structure the schema cannot express: unique names, flags owned by the renderer."""
    problems = []
    seen: dict[str, str] = {}
    for role in ("prefill", "decode"):
        for i, inst in enumerate(data.get(role) or []):
            where = f"{role}[{i}]"
            if inst["name"] in seen:
                problems.append(f"{where}.name: {inst['name']!r} is already used by {seen[inst['name']]}; "
                                "instance names must be unique")
            seen.setdefault(inst["name"], where)
            for j, arg in enumerate(inst.get("extra_args", [])):
                flag = arg.split("=", 1)[0]
                if flag in MANAGED_FLAGS:
                    problems.append(f"{where}.extra_args[{j}]: {flag} is set by kvpp render from the spec; use "
                                    f"the instance keys ({_managed_hint(flag)}) instead")
    return problems


def _managed_hint(flag: str) -> str:
    hints = {"--additional-config": "additional_config, enable_kvpp", "--kv-transfer-config":
             "kv_transfer_config, kv_port, pool", "--enforce-eager": "enforce_eager",
             "--kv-events-config": "kv_events", "--port": "port"}
    return hints.get(flag, "tp, pp, pcp, dcp, dp, hosts")


def parse_spec(data: Any, source: str = "spec") -> Spec:
    """Validate and fill defaults; raises SpecError with every problem."""
    problems = schema_problems(data)
    if problems:
        raise SpecError(source, problems)
    data = copy.deepcopy(data)
    model = data["model"]
    pool = None
    if data.get("pool"):
        pool = Pool(**{**POOL_DEFAULTS, **data["pool"]})
    instances = {}
    for role in ("prefill", "decode"):
        items = []
        for i, raw in enumerate(data.get(role) or []):
            values = {**copy.deepcopy(INSTANCE_DEFAULTS), **raw}
            if values["uses_pool"] is None:  # by default the pool serves the prefill side
                values["uses_pool"] = pool is not None and role == "prefill"
            values["hosts"] = tuple(values["hosts"])
            values["extra_args"] = tuple(values["extra_args"])
            if values["pp_layers"] is not None:
                values["pp_layers"] = tuple(values["pp_layers"])
            items.append(Instance(role=role, index=i, **values))
        instances[role] = tuple(items)
    proxy = {**PROXY_DEFAULTS, **(data.get("proxy") or {})}
    return Spec(
        model_path=model["path"], model_preset=model.get("preset"), served_name=model.get("served_name"),
        mtp_layers=model.get("mtp_layers"), prefill=instances["prefill"], decode=instances["decode"],
        pool=pool, proxy_host=proxy["host"], proxy_port=proxy["port"],
        kubernetes={**K8S_DEFAULTS, **(data.get("kubernetes") or {})},
    )


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(str(path), [f"cannot read the spec ({exc.strerror})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(str(path), [f"not valid YAML: {' '.join(str(exc).split())}"]) from None
    return parse_spec(data, str(path))


def compact_json(value: Any) -> str:
    """JSON as vLLM flags take it: compact and with stable key order (for golden files)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)
