"""Deployment specs: one YAML file describing a (possibly disaggregated) KVPP deployment.

The schema is checked with JSON Schema and every violation is reported with its path
(`prefill[0].tp: ...`), so a spec is fixed in one pass. Defaults are filled in here, once, so that
`kvpp render` and `kvpp check` read the same values.

Every value ends up in a shell script, a config file or a manifest. What each target cannot carry
safely is refused here (hosts that are not host names, env keys that are not identifiers, NUL,
non-finite numbers, ...); everything else is quoted by the renderer for its target.
"""

from __future__ import annotations

import copy
import json
import math
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpp_core.config import parse_struct
from kvpp_core.files import read_small_file
from connectors.hosts import host_problem, split_host_port

from connectors.store.config import MooncakeSettings

from deploy.args import MAX_LAYERS, MAX_PARALLEL, shown

MAX_SPEC_BYTES = 1 << 20
# Values in a spec after YAML aliases are expanded, and nesting depth: far above any real spec,
# low enough that an alias bomb or a recursive alias is refused instead of expanded.
MAX_VALUES = 100_000
MAX_DEPTH = 64
INT64_MAX = (1 << 63) - 1
MAX_INSTANCES = 1024  # per role; port checks compare instances pairwise per host

PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
POS_INT = {"type": "integer", "minimum": 1, "maximum": INT64_MAX}
PARALLEL = {"type": "integer", "minimum": 1, "maximum": MAX_PARALLEL}
NAME = {"type": "string", "maxLength": 40}  # a DNS label: checked by _label_problem
STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RESOURCE = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_CONF_KEY = re.compile(r"[A-Za-z0-9_.]+")
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
        "block_size": {"type": "integer", "minimum": 1, "maximum": 1 << 20},
    },
}

INSTANCE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "hosts", "tp"],
    "properties": {
        "name": NAME,
        "hosts": {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL, "items": {"type": "string"}},
        "port": PORT,
        "tp": PARALLEL,
        "pp": PARALLEL,
        "pp_layers": {"oneOf": [{"type": "null"}, {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL,
                                                  "items": {**PARALLEL, "maximum": MAX_LAYERS}}]},
        "pcp": PARALLEL,
        "dcp": PARALLEL,
        "dp": PARALLEL,
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
                "mtp_layers": {"type": "integer", "minimum": 0, "maximum": 64},
            },
        },
        "prefill": {"type": "array", "minItems": 1, "maxItems": MAX_INSTANCES, "items": INSTANCE},
        "decode": {"type": "array", "maxItems": MAX_INSTANCES, "items": INSTANCE},
        "pool": {
            "type": "object",
            "additionalProperties": False,
            "required": ["backend", "address", "lookup_rpc_port"],
            "properties": {
                "backend": {"enum": ["mooncake", "memcache"]},
                "address": {"type": "string"},
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
            "properties": {"host": {"type": "string"}, "port": PORT},
        },
        "kubernetes": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "namespace": NAME,
                "image": {"type": "string", "minLength": 1},
                "device_resource": {"type": "string", "minLength": 1},
                "devices_per_node": PARALLEL,
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
    """memcache: mmc config keys (`local_service.protocol: host_tcp`); mooncake: read into `mooncake`."""
    mooncake: MooncakeSettings | None = None
    """The Mooncake store client settings of the rendered mooncake.json (pool.settings, typed)."""

    @property
    def host(self) -> str:
        """The bare host (an IPv6 literal without its brackets)."""
        return split_host_port(self.address)[0]

    @property
    def port(self) -> int:
        return split_host_port(self.address)[1]


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
    problems = _data_problems(data)
    if problems:  # not plain JSON data: the schema validator cannot be trusted with it
        return problems
    for err in sorted(_validator().iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path]):
        problems.append(f"{_path(err.absolute_path)}: {_message(err)}")
    if isinstance(data, dict):
        problems += _text_problems(data)
    if not problems:
        problems += _semantic_problems(data)
    return problems


def _validator():
    from jsonschema import Draft202012Validator, validators

    # JSON Schema counts 8.0 as an integer; a rendered `--tensor-parallel-size 8.0` would not be one.
    checker = Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool))
    return validators.extend(Draft202012Validator, type_checker=checker)(SCHEMA)


def _data_problems(data: Any) -> list[str]:
    """Values YAML can hold but no target can carry: non-string keys, dates, NaN, NUL, unpaired
    surrogates; and alias bombs (more than MAX_VALUES values once aliases are expanded)."""
    problems: list[str] = []
    budget = [MAX_VALUES]
    too_deep = []

    def visit(value: Any, path: list, depth: int) -> None:
        budget[0] -= 1
        if depth > MAX_DEPTH:
            too_deep.append(path)
        if budget[0] < 0 or too_deep:
            return
        where = _path(path)
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    problems.append(f"{where}: key {shown(key)} must be a string (quote it)")
                    continue
                problems.extend(f"{_path([*path, key])}: key {p}" for p in _string_problems(key))
                visit(item, [*path, key], depth + 1)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                visit(item, [*path, i], depth + 1)
        elif isinstance(value, str):
            problems.extend(f"{where}: {p}" for p in _string_problems(value))
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{where}: {value} is not a finite number")
        elif value is not None and not isinstance(value, (bool, int, float)):
            problems.append(f"{where}: a {type(value).__name__} is not a JSON value (string, number, boolean, "
                            "null, list or mapping); quote it")

    visit(data, [], 0)
    if budget[0] < 0:
        problems.append(f"(top level): more than {MAX_VALUES} values (YAML aliases are expanded); a deployment "
                        "spec is far smaller")
    elif too_deep:
        problems.append(f"{_path(too_deep[0][:3])}: nested deeper than {MAX_DEPTH} levels")
    return problems


def _string_problems(text: str) -> list[str]:
    problems = []
    if "\0" in text:
        problems.append("contains a NUL character, which no command line, environment or file name can carry")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        problems.append("contains an unpaired UTF-16 surrogate (not valid Unicode text)")
    return problems


def _has_control(text: str) -> bool:
    return any(unicodedata.category(c) == "Cc" for c in text)


def _text_problems(data: dict) -> list[str]:
    """String fields whose target syntax is narrower than "any string": hosts, names, identifiers."""
    problems: list[str] = []

    def check(value: Any, where: str, test) -> None:
        if isinstance(value, str):
            problem = test(value)
            if problem:
                problems.append(f"{where}: {problem}")

    def section(value: Any, kind: type) -> Any:  # the schema reports wrong types; skip them here
        return value if isinstance(value, kind) else kind()

    model = section(data.get("model"), dict)
    for key in ("path", "served_name", "preset"):
        check(model.get(key), f"model.{key}", _argument_problem)
    for role in ("prefill", "decode"):
        for i, inst in enumerate(section(data.get(role), list)):
            inst = section(inst, dict)
            check(inst.get("name"), f"{role}[{i}].name", _label_problem)
            for j, host in enumerate(section(inst.get("hosts"), list)):
                check(host, f"{role}[{i}].hosts[{j}]", host_problem)
            for key in section(inst.get("env"), dict):
                if not _ENV_KEY.fullmatch(key):
                    problems.append(f"{role}[{i}].env: key {shown(key)} is not an environment variable name (letters, "
                                    "digits and '_', not starting with a digit)")
    check(section(data.get("proxy"), dict).get("host"), "proxy.host", host_problem)
    pool = section(data.get("pool"), dict)
    check(pool.get("address"), "pool.address", _address_problem)
    if pool.get("backend") == "memcache" and isinstance(pool.get("settings"), dict):
        for key, value in pool["settings"].items():
            if not _CONF_KEY.fullmatch(key):
                problems.append(f"pool.settings: key {shown(key)} is not an mmc config key (letters, digits, '_', '.')")
            elif not isinstance(value, (str, int, float)) or isinstance(value, str) and _has_control(value):
                problems.append(f"pool.settings.{key}: an mmc config value is one line of text or a number, got "
                                f"{shown(value)}")
    k8s = section(data.get("kubernetes"), dict)
    check(k8s.get("namespace"), "kubernetes.namespace", _label_problem)
    for key in ("image", "proxy_image"):
        check(k8s.get(key), f"kubernetes.{key}", lambda v: (
            f"{shown(v)} is not an image reference (no whitespace or control characters)"
            if not v or any(c.isspace() or _has_control(c) for c in v) else None))
    check(k8s.get("device_resource"), "kubernetes.device_resource", lambda v: None if _RESOURCE.fullmatch(v) else (
        f"{shown(v)} is not a Kubernetes resource name (e.g. huawei.com/ascend-1980)"))
    return problems


def _argument_problem(value: str) -> str | None:
    if not value or _has_control(value):
        return f"{shown(value)} must be non-empty and free of control characters"
    if value.startswith("-"):
        return f"{shown(value)} starts with '-', so vllm would read it as an option"
    return None


def _label_problem(value: str) -> str | None:
    if _DNS_LABEL.fullmatch(value):
        return None
    return f"{shown(value)} must be a lowercase DNS label (a-z, 0-9, '-'; it names Kubernetes objects)"


def _address_problem(value: str) -> str | None:
    try:
        host, _ = split_host_port(value)
    except ValueError as exc:
        return f"{shown(value)} {exc} (e.g. 10.0.0.9:50051 or [fd00::9]:50051)"
    problem = host_problem(host)
    return f"host {problem}" if problem else None


def _path(parts) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not re.fullmatch(r"[A-Za-z0-9_.\-]+", part):
            out += f"[{shown(part)}]"  # odd keys quoted, so a message stays one unambiguous line
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


def _message(err) -> str:
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        return f"{err.message}; allowed keys: {', '.join(allowed)}"
    if err.validator in ("maxItems", "maxLength"):
        return f"has {len(err.instance)} {'items' if err.validator == 'maxItems' else 'characters'}, more than " \
               f"the {err.validator_value} allowed"
    message = err.message  # it quotes the value, which may be long: keep the line short
    return message if len(message) <= 300 else message[:300] + "..."


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
    mooncake = None
    if not problems and (data.get("pool") or {}).get("backend") == "mooncake":
        parsed = parse_struct(data["pool"].get("settings"), MooncakeSettings, "pool.settings")
        problems += [f"{option}: {message}" for option, message in parsed.problems]
        mooncake = parsed.value
    if problems:
        raise SpecError(source, problems)
    data = copy.deepcopy(data)
    model = data["model"]
    pool = None
    if data.get("pool"):
        pool = Pool(**{**POOL_DEFAULTS, **data["pool"]}, mooncake=mooncake)
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


def read_spec_data(path: str | Path) -> Any:
    """The YAML document at `path`; OSError when it is not a readable regular file of at most 1 MiB
    (a command-line problem), SpecError when it is not YAML (a spec problem)."""
    text = read_small_file(path, MAX_SPEC_BYTES)
    try:
        return yaml.safe_load(text.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SpecError(str(path), [f"not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    except yaml.YAMLError as exc:
        raise SpecError(str(path), [f"not valid YAML: {' '.join(str(exc).split())}"]) from None
    except RecursionError:
        raise SpecError(str(path), [f"nested deeper than {MAX_DEPTH} levels"]) from None


def load_spec(path: str | Path) -> Spec:
    return parse_spec(read_spec_data(path), str(path))


def compact_json(value: Any) -> str:
    """JSON as vLLM flags take it: compact and with stable key order (for golden files)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)
