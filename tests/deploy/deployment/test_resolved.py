"""The resolved spec: each instance's facts worked out once, and `kvpp check` and `kvpp render` reading the
same values."""

from __future__ import annotations

import copy
import shlex

import pytest

from connectors.mooncake.ports import PortLayout

from deploy.deployment import check, render, resolved
from deploy.deployment.launch import MOONCAKE_CONFIG
from deploy.deployment.spec import compact_json, load_spec, parse_spec
from tests.helpers.paths import REPO

pytestmark = pytest.mark.unit

EXAMPLES = REPO / "deploy" / "deployment" / "examples"
EXAMPLE_SPECS = sorted(EXAMPLES.glob("*.yaml"))


def _calls(monkeypatch, module, name: str) -> list:
    """Record the arguments of every call of `module.name` (which still runs)."""
    calls, real = [], getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return calls


@pytest.mark.parametrize("fmt", render.FORMATS)
def test_a_check_and_render_walk_works_out_each_instance_once(monkeypatch, fmt):
    spec = load_spec(EXAMPLES / "pd-multi-host-pool.yaml")
    resolves = _calls(monkeypatch, render, "resolve")
    kv_configs = _calls(monkeypatch, resolved, "_kv_transfer_config")
    extra_configs = _calls(monkeypatch, resolved, "_additional_config")
    render.render(spec, fmt)
    assert len(resolves) == 1
    names = [inst.name for inst in spec.instances]
    assert [inst.name for _, inst, _ in kv_configs] == names == ["prefill-a", "prefill-b", "decode"]
    assert [inst.name for (inst,) in extra_configs] == names


def test_render_writes_the_resolved_values_check_validated(monkeypatch):
    spec = load_spec(EXAMPLES / "pd-multi-host-pool.yaml")
    checked = _calls(monkeypatch, render, "check_resolved")
    written = _calls(monkeypatch, render, "render_shell")
    validated = _calls(monkeypatch, check, "validate")
    files = render.render(spec, "shell")
    [(resolved_spec,)] = checked
    assert written[0][0] is resolved_spec
    for instance, (setup, *_) in zip(resolved_spec.instances, validated, strict=True):
        kv_cfg = instance.kv_transfer_config
        assert (setup.kv_connector, setup.kv_role, setup.kv_extra) == (
            kv_cfg["kv_connector"], kv_cfg["kv_role"], kv_cfg.get("kv_connector_extra_config", {}))
        script = files[f"{instance.instance.name}-node0.sh"]
        assert f"--kv-transfer-config {shlex.quote(compact_json(kv_cfg))}" in script
        extra = instance.additional_config  # left out when empty (the decode's)
        assert (f"--additional-config {shlex.quote(compact_json(extra))}" in script) == bool(extra)


@pytest.mark.parametrize("example", EXAMPLE_SPECS, ids=[p.stem for p in EXAMPLE_SPECS])
def test_check_leaves_the_resolved_values_as_render_reads_them(example):
    resolved_spec = resolved.resolve(load_spec(example))
    before = copy.deepcopy(resolved_spec)
    check.check_resolved(resolved_spec)
    assert resolved_spec == before


def test_an_instance_holds_its_nodes_ports_and_pool_files():
    spec = resolved.resolve(load_spec(EXAMPLES / "pd-multi-host-pool.yaml"))
    prefill_a, _, decode = spec.instances
    assert prefill_a.kv_ports == PortLayout(37000, tp=8) and decode.kv_ports == PortLayout(37010, tp=8)
    assert prefill_a.kv_ports_problem is None
    assert (prefill_a.lookup_rpc_port, decode.lookup_rpc_port) == (5601, None)
    assert prefill_a.config_files == {MOONCAKE_CONFIG: spec.pool.files[MOONCAKE_CONFIG]} and decode.config_files == {}
    (node,) = prefill_a.nodes
    assert node.env == {"VLLM_HOST_IP": "198.51.100.11", **prefill_a.env}
    assert prefill_a.serve_command(0) == ["vllm", "serve", *node.args]
    assert spec.proxy.host == "198.51.100.40" and spec.proxy.metrics_port is None
    assert "--metrics-port" not in spec.pool.argv and spec.pool.files != spec.pool.cluster_files
    router = resolved.resolve(load_spec(EXAMPLES / "pd-vllm-router.yaml")).proxy
    assert router.metrics_port == 29000 and router.argv[router.argv.index("--prometheus-port") + 1] == "29000"


def test_colocated_spec_has_no_front_and_kv_ports_past_65535_are_a_problem_not_an_exception():
    spec = parse_spec({"model": {"path": "/m"},
                       "prefill": [{"name": "p", "hosts": ["h1"], "tp": 8, "kv_port": 65530}]})
    (instance,) = (r := resolved.resolve(spec)).instances
    assert r.proxy is None and r.pool is None and instance.kv_transfer_config is None
    assert instance.kv_ports is None and "beyond 65535" in instance.kv_ports_problem


def test_serve_command_listens_where_asked_and_api_server_starts_single_nodes_only():
    (one_node,) = resolved.resolve(load_spec(EXAMPLES / "pd-one-host.yaml")).instances[:1]
    default = one_node.serve_command(0, "api-server", python="py")
    loopback = one_node.serve_command(0, "api-server", python="py", listen="127.0.0.1")
    host = default.index("--host") + 1
    assert default[:4] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert loopback[host] == "127.0.0.1" and loopback[:host] + loopback[host + 1:] == default[:host] + default[host + 1:]
    with pytest.raises(ValueError, match="--launcher must be one of vllm-serve, api-server"):
        one_node.serve_command(0, "docker")
    two_nodes = load_spec(EXAMPLES / "two-node-tp8-pp2.yaml")
    with pytest.raises(ValueError, match="--launcher api-server starts single-node instances only"):
        render.render(two_nodes, "shell", launcher="api-server")
