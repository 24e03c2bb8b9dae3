"""Hostile specs: what `kvpp check` accepts, `kvpp render` turns into scripts and manifests that run
exactly the spec's commands and nothing else.

The property test (hypothesis) puts hostile strings into every spec field. A refused spec must name
the bad value's path. An accepted one is rendered for the shell into a directory whose own name is
hostile, and every script is RUN with stub `vllm`, `python3`, `mooncake_master` and `kvpp` as the
only commands on PATH: each stub records its argv and environment, which must equal what the spec
says; bash's command-not-found hook records anything else that tries to run, and a canary file
shows any redirection. The Kubernetes render of the same spec is validated against the 1.33
schemas and expanded the way the kubelet expands `$(VAR)`, which must give back the literal values.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest

from tests.helpers.paths import REPO
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deploy.deployment import launch
from deploy.deployment.check import check_spec
from deploy.cli.main import main
from deploy.deployment.render import MARKER, render, write_files
from deploy.deployment.resolved import resolve
from deploy.deployment.spec import SpecError, parse_spec

pytestmark = pytest.mark.unit

K8S_VERSION = "1.33.0"
CANARY = "kvpp-canary"
STUBS = ("vllm", "python3", "mooncake_master", "kvpp")
PAYLOADS = [
    f"$(touch {CANARY})", f"`touch {CANARY}`", f"; touch {CANARY} #", f"x' ; touch {CANARY} ; '",
    f'"$(touch {CANARY})"', f"$KVPP_CONFIG_DIR/$(touch {CANARY})", f"\ntouch {CANARY}\n", f"a\ntouch {CANARY}",
    f"${{IFS}}touch${{IFS}}{CANARY}", "$(LWS_LEADER_ADDRESS)", "$$(x)", f"$(echo pwned>{CANARY})",
    f"x>{CANARY}", f"x >> {CANARY}", "-", "--help", "~root", "*", "!!", "\\", "'", '"', "#", "%s", "é€😀", "\t",
    "\r", "\x1b[2J", "$", "$(", ")", "${HOME}", "$HOME", "\\$(x)", "a b", "", " ", "\x00", "\ud800", "h\n",
    "10.0.0.1\ntouch x", "host.example.com", "127.0.0.1", "::1", "x" * 70, ".".join(["x" * 60] * 3),
]
HOSTILE = st.one_of(
    st.sampled_from(PAYLOADS),
    st.sampled_from(PAYLOADS),  # twice: whole payloads are the sharpest inputs
    st.builds(lambda a, b, c: a + b + c, st.text(max_size=4), st.sampled_from(PAYLOADS), st.text(max_size=4)),
    st.text(alphabet="$()`'\"\\;&|<>#*?~!{}[] \n\tabc-=/.:", max_size=16),
)
# Fields and whether any string must be accepted there (free text, quoted by the renderer) or only
# some (names, hosts, identifiers, ...: refused with their path when they do not fit). Connector and
# KVPP configs ("config") get hostile keys too, which their validation may refuse as unknown.
FREE_TEXT = "free"
FIELDS = {
    "model.path": "arg", "model.served_name": "arg", "prefill[0].name": "name", "prefill[0].hosts[0]": "host",
    "prefill[0].hosts[1]": "host", "decode[0].hosts[0]": "host", "prefill[0].env.KEY": "env-key",
    "prefill[0].env.VALUE": FREE_TEXT, "decode[0].env.VALUE": FREE_TEXT, "prefill[0].extra_args": FREE_TEXT,
    "decode[0].extra_args": FREE_TEXT, "prefill[0].additional_config": "config",
    "prefill[0].kv_transfer_config": "config", "pool.address": "address", "pool.settings": "settings",
    "pool.extra_config": "config", "proxy.host": "host", "kubernetes.image": "image",
    "kubernetes.namespace": "name", "kubernetes.device_resource": "resource", "kubernetes.proxy_image": "image",
}


SETTINGS = {"mooncake": {"protocol": "tcp"}, "memcache": {"log_level": "error"}}
"""Valid pool.settings: a Mooncake client setting (mooncake.json), an mmc config key (mmc-local.conf)."""
TEXT_SETTING = {"mooncake": "rdma_devices", "memcache": "log_level"}
"""A free-text setting of each backend's typed settings group."""


def base_spec(backend: str) -> dict:
    """P/D with a two-node prefill (LeaderWorkerSet in k8s) and a pool of `backend`."""
    return {
        "model": {"path": "/models/m", "preset": "deepseek-v3", "served_name": "m"},
        "prefill": [{"name": "p", "hosts": ["10.0.0.1", "10.0.0.2"], "tp": 4, "pp": 2, "kv_port": 37000,
                     "enable_kvpp": True, "enforce_eager": True, "env": {"A": "1"}, "extra_args": ["--seed", "0"]}],
        "decode": [{"name": "d", "hosts": ["10.0.0.3"], "tp": 4, "port": 8001, "kv_port": 37010}],
        "pool": {"backend": backend, "address": "10.0.0.9:50051", "lookup_rpc_port": 5600,
                 "extra_config": {"load_async": True}, "settings": SETTINGS[backend]},
        "proxy": {"host": "10.0.0.1", "port": 8000},
    }


def put(spec: dict, field: str, value: str) -> None:
    """Set `field` (a FIELDS key) of `spec` to the hostile `value`."""
    if field.endswith(".env.KEY"):
        spec[field.split(".")[0][:-3]][0].setdefault("env", {})[value] = "v"
        return
    if field.endswith(".env.VALUE"):
        spec[field.split(".")[0][:-3]][0].setdefault("env", {})["HOSTILE"] = value
        return
    parts = re.findall(r"[a-z_]+|\[\d+\]", field)
    target = spec
    for part in parts[:-1]:
        target = target[int(part[1:-1])] if part.startswith("[") else target.setdefault(part, {})
    last = parts[-1]
    if last.startswith("["):
        target[int(last[1:-1])] = value
    elif last == "extra_args":
        target[last] = target.get(last, []) + ["--hostile", value, value]
    elif last in ("additional_config", "kv_transfer_config"):
        target[last] = {**target.get(last, {}), "hostile": value, value: [value]}
    elif last == "extra_config":  # the pool's keys are typed (unknown ones are refused): text goes where text is
        backend = spec["pool"]["backend"]
        target[last] = {**target.get(last, {}), "stats_file": value, backend: {TEXT_SETTING[backend]: value}}
    elif last == "settings" and spec["pool"]["backend"] == "mooncake":  # typed as well
        target[last] = {**target.get(last, {}), TEXT_SETTING["mooncake"]: value}
    elif last == "settings":  # mmc config keys: any key that fits the file's syntax
        target[last] = {**target.get(last, {}), "hostile": value}
    else:
        target[last] = value


def must_be_accepted(kind: str, value: str) -> bool:
    """Values `kvpp check` may not refuse (it could otherwise pass this test by refusing everything)."""
    if "\x00" in value or any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        return False
    return kind == FREE_TEXT


# ---- running the rendered scripts ----------------------------------------------------------------
@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """A PATH holding only recording stubs (and dirname, which the scripts' preamble uses)."""
    root = tmp_path_factory.mktemp("stubs")
    bindir, log = root / "bin", root / "calls.jsonl"
    bindir.mkdir()
    for name in STUBS:
        stub = bindir / name
        stub.write_text(f"#!{sys.executable} -IS\n"
                        "import json, os, sys\n"
                        f"with open({str(log)!r}, 'a') as f:\n"
                        "    f.write(json.dumps({'argv': [os.path.basename(sys.argv[0])] + sys.argv[1:], "
                        "'env': dict(os.environ)}) + '\\n')\n")
        stub.chmod(0o755)
    (bindir / "dirname").symlink_to("/usr/bin/dirname")
    return bindir, log


def run_scripts(out: Path, workdir: Path, stubs) -> dict[str, dict]:
    """Run every script in `out` with the stubs; the record of each one's single command."""
    bindir, log = stubs
    hook = f"() {{ printf 'UNEXPECTED %s\\n' \"$*\" >> {log}.unexpected; return 127; }}"
    calls = {}
    for script in sorted(out.glob("*.sh")):
        log.write_text("")
        env = {"PATH": str(bindir), "HOME": str(workdir), "BASH_FUNC_command_not_found_handle%%": hook}
        proc = subprocess.run(["/bin/bash", str(script)], cwd=workdir, env=env, capture_output=True, timeout=30)
        assert proc.returncode == 0, (script.name, proc.stderr)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(records) == 1, (script.name, records)
        calls[script.name] = records[0]
    unexpected = Path(f"{log}.unexpected")
    assert not unexpected.exists(), unexpected.read_text()
    return calls


def expected_commands(spec, out: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Per script: the argv and the environment entries the spec asks for."""
    def resolved(env):
        return {k: str(out / v.file) if isinstance(v, launch.ConfigFile) else v for k, v in env.items()}

    expected, spec_resolved = {}, resolve(spec)
    for instance in spec_resolved.instances:
        for node in instance.nodes:
            expected[f"{instance.instance.name}-node{node.rank}.sh"] = (["vllm", "serve", *node.args],
                                                                        resolved(node.env))
    expected["pool.sh"] = (list(spec_resolved.pool.argv), resolved(spec_resolved.pool.env))
    def url(host, port):  # an IPv6 literal is bracketed before its port
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    urls = {role: [url(i.hosts[0], i.port) for i in getattr(spec, role)] for role in ("prefill", "decode")}
    proxy = spec_resolved.proxy
    expected["proxy.sh"] = (launch.proxy_args(spec.proxy, proxy.host, proxy.metrics_port, urls), {})
    return expected


# ---- kubernetes ------------------------------------------------------------------------------------
def kube_expand(text: str, defined: set[str]) -> str:
    """Kubernetes' $(VAR) expansion of command, args and env values (third_party/forked/golang/expansion)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
            elif nxt == "(" and ")" in text[i + 2:]:
                end = text.index(")", i + 2)
                name = text[i + 2:end]
                out.append(f"<{name}>" if name in defined else f"$({name})")
                i = end + 1
            else:
                out.append("$" + nxt)
                i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def test_kube_expand_matches_the_kubelet_rules():
    defined = {"A"}
    assert kube_expand("$(A)-$$(A)-$(B)-$-$$-x$", defined) == "<A>-$(A)-$(B)-$-$-x$"
    assert kube_expand("$(A", defined) == "$(A" and kube_expand("$$$(A)", defined) == "$<A>"


def check_k8s(spec) -> None:
    try:
        files = render(spec, "k8s")
    except ValueError as exc:  # a host name longer than a Kubernetes label value: refused for k8s only
        assert "is not a Kubernetes label value" in str(exc)
        return
    for text in files.values():
        for obj in yaml.safe_load_all(text):
            pods = [obj["spec"]["template"]] if obj["kind"] == "Deployment" else []
            if obj["kind"] == "LeaderWorkerSet":
                lws = obj["spec"]["leaderWorkerTemplate"]
                pods = [lws["leaderTemplate"], lws["workerTemplate"]]
                for i, tpl in enumerate(pods):
                    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod",
                                                  "metadata": {"name": f"p{i}", **tpl["metadata"]},
                                                  "spec": tpl["spec"]}, K8S_VERSION, strict=True)
            elif obj["kind"] != "ConfigMap":
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            for pod in pods:
                for c in pod["spec"]["containers"]:
                    check_container(spec, obj["metadata"]["name"], pod["metadata"]["labels"].get("role"), c)


def check_container(spec, name: str, role: str | None, c: dict) -> None:
    defined = {"LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX"}
    argv = [kube_expand(a, defined) for a in c["command"]]
    env = {e["name"]: kube_expand(e["value"], defined) for e in c.get("env", []) if "value" in e}
    instance = next((i for i in resolve(spec).instances if i.instance.name == name), None)
    if instance is None:
        return  # pool and proxy: their argv holds no user strings but hosts, names and numbers
    inst = instance.instance
    expected = ["vllm", "serve", *instance.nodes[0].args]
    if len(inst.hosts) > 1:
        expected[expected.index("--master-addr") + 1] = "<LWS_LEADER_ADDRESS>"
        if role == "worker":
            expected[expected.index("--node-rank") + 1] = "<LWS_WORKER_INDEX>"
            expected.insert(len(expected) - len(inst.extra_args), "--headless")
    assert argv == expected
    for key, value in instance.env.items():
        assert env[key] == value


# ---- the property test ----------------------------------------------------------------------------
COUNTS = {"specs": 0, "accepted": 0, "scripts_run": 0}


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@example("mooncake", [("prefill[0].env.VALUE", f"$KVPP_CONFIG_DIR/$(touch {CANARY})")])  # the reported cases
@example("memcache", [("prefill[0].env.KEY", f"X; touch {CANARY} #")])
@example("memcache", [("proxy.host", f"10.0.0.1\ntouch {CANARY}")])
@example("memcache", [("pool.settings", "x\nock.mmc.evil = 1"), ("prefill[0].extra_args", f"$(touch {CANARY})")])
@example("mooncake", [("prefill[0].extra_args", "$(LWS_LEADER_ADDRESS)"), ("model.path", "/m/$(x) 'y'")])
@given(st.sampled_from(["mooncake", "memcache"]),
       st.lists(st.tuples(st.sampled_from(sorted(FIELDS)), HOSTILE), min_size=1, max_size=3))
def test_hostile_specs_render_to_exactly_the_spec(stubs, tmp_path_factory, backend, edits):
    spec_data = base_spec(backend)
    for field, value in edits:
        put(spec_data, field, value)
    COUNTS["specs"] += 1
    try:
        spec = parse_spec(spec_data)
        errors = [f for f in check_spec(spec) if f.severity == "error"]
    except SpecError as exc:
        spec, errors = None, exc.problems
    if errors:
        assert not all(must_be_accepted(FIELDS[f], v) for f, v in edits), (edits, errors)
        for problem in map(str, errors):
            assert re.match(r"(error: )?[\w(\[]", problem) and ": " in problem, problem  # a path, then why
        return
    COUNTS["accepted"] += 1
    work = tmp_path_factory.mktemp("run")
    out = work / f"out $(touch {CANARY}) 'q\""
    write_files(render(spec, "shell"), out)
    calls = run_scripts(out, work, stubs)
    assert not list(work.rglob(CANARY)) and not (Path.cwd() / CANARY).exists()
    for script, (argv, env) in expected_commands(spec, out).items():
        got = calls.pop(script)
        assert got["argv"] == argv, script
        for key, value in env.items():
            assert got["env"].get(key) == value, (script, key)
        COUNTS["scripts_run"] += 1
    assert not calls
    if spec.pool.backend == "memcache":  # one `ock.mmc.key = value` line per setting, nothing injected
        conf = dict(ln.split(" = ", 1) for ln in (out / launch.MEMCACHE_CONFIG).read_text().splitlines())
        settings = {"meta_service_url": f"tcp://{spec.pool.address}", **spec.pool.settings}
        assert conf == {f"ock.mmc.{k}": str(v) for k, v in settings.items()}
    if (out / launch.MOONCAKE_CONFIG).exists():
        assert json.loads((out / launch.MOONCAKE_CONFIG).read_text())["master_server_address"] == spec.pool.address
    check_k8s(spec)


def test_zz_property_test_tried_enough():
    """Runs after the property test (file order): it tried hostile specs and ran accepted ones."""
    print(f"hostile specs: {COUNTS['specs']} tried, {COUNTS['accepted']} accepted and rendered, "
          f"{COUNTS['scripts_run']} scripts run with stubs")
    assert COUNTS["specs"] >= 100 and COUNTS["accepted"] >= 20 and COUNTS["scripts_run"] >= 100


# ---- the reported cases, and the class each stands for ------------------------------------------------
@pytest.mark.parametrize("field, value, path", [
    ("prefill[0].env.KEY", "X; touch /tmp/p #", "prefill[0].env: key 'X; touch /tmp/p #'"),
    ("proxy.host", "10.0.0.1\ntouch /tmp/p", "proxy.host: "),
    ("prefill[0].hosts[0]", "h $(id)", "prefill[0].hosts[0]: "),
    ("decode[0].hosts[0]", "fe80::1%eth0", "decode[0].hosts[0]: 'fe80::1%eth0': a scoped IPv6 address"),
    ("decode[0].hosts[0]", "[fd00::1]", "decode[0].hosts[0]: '[fd00::1]': write a host without brackets"),
    ("pool.address", "fd00::9:50051", "pool.address: 'fd00::9:50051' an IPv6 address takes brackets before the "
     "port: [fd00::9]:50051"),
    ("prefill[0].name", "p\n", "prefill[0].name: "),
    ("pool.address", "10.0.0.9:50051\n", "pool.address: "),
    ("pool.address", "h:99999", "pool.address: "),
    ("pool.settings", "x\nock.mmc.evil = 1", "pool.settings.hostile: "),
    ("model.path", "--help", "model.path: "),
    ("kubernetes.namespace", "Default", "kubernetes.namespace: "),
    ("prefill[0].env.VALUE", "a\x00b", "prefill[0].env.HOSTILE: contains a NUL"),
])
def test_check_refuses_with_the_path(field, value, path):
    data = base_spec("memcache")
    put(data, field, value)
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    assert any(p.startswith(path) for p in info.value.problems), info.value.problems


def test_yaml_that_is_not_json_is_refused_with_paths():
    data = base_spec("mooncake")
    data["prefill"][0]["additional_config"] = {1: "x", "when": __import__("datetime").date(2020, 1, 1),
                                               "n": float("nan")}
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    assert sorted(p.split(":")[0] for p in info.value.problems) == [
        "prefill[0].additional_config", "prefill[0].additional_config.n", "prefill[0].additional_config.when"]


def test_alias_bomb_is_refused(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]"
              for i in range(1, 12)]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\n")
    assert main(["check", str(tmp_path / "bomb.yaml")]) == 1


def test_the_env_value_from_the_issue_reaches_vllm_literally(stubs, tmp_path):
    data = base_spec("mooncake")
    value = f"$KVPP_CONFIG_DIR/$(touch {CANARY})"
    data["prefill"][0]["env"]["EVIL"] = value
    data["decode"][0]["extra_args"] = ["--chat-template", f"{{{{ x }}}}\n$(touch {CANARY})"]
    spec = parse_spec(data)
    write_files(render(spec, "shell"), tmp_path / "out")
    calls = run_scripts(tmp_path / "out", tmp_path, stubs)
    assert calls["p-node0.sh"]["env"]["EVIL"] == value
    assert calls["d-node0.sh"]["argv"][-1] == f"{{{{ x }}}}\n$(touch {CANARY})"
    assert not (tmp_path / CANARY).exists()


# ---- --out ------------------------------------------------------------------------------------------------
EXAMPLE = REPO / "deploy" / "deployment" / "examples" / "pd-one-host.yaml"


def test_out_refuses_a_foreign_directory_and_leaves_it_alone(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    assert main(["render", str(EXAMPLE), "--out", str(out)]) == 2
    assert "not written by kvpp render" in capsys.readouterr().err
    assert os.listdir(out) == ["notes.txt"]


def test_out_never_follows_symlinks(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "link").symlink_to(victim)
    assert main(["render", str(EXAMPLE), "--out", str(tmp_path / "link")]) == 2
    assert "symbolic link" in capsys.readouterr().err and os.listdir(victim) == []
    out = tmp_path / "out"
    assert main(["render", str(EXAMPLE), "--out", str(out)]) == 0
    target = tmp_path / "target.txt"
    target.write_text("precious")
    (out / "proxy.sh").unlink()
    (out / "proxy.sh").symlink_to(target)  # planted where a file of the earlier render was
    assert main(["render", str(EXAMPLE), "--out", str(out)]) == 2
    assert "no longer the regular file" in capsys.readouterr().err
    assert target.read_text() == "precious"


def test_rerender_replaces_its_own_files_only(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["render", str(EXAMPLE), "--out", str(out)]) == 0
    (out / "notes.txt").write_text("keep")
    assert main(["render", str(EXAMPLE), "--format", "k8s", "--out", str(out)]) == 0
    names = sorted(os.listdir(out))
    assert names == sorted([MARKER, "notes.txt", "prefill.yaml", "decode.yaml", "proxy.yaml", "grafana-dashboard.yaml"])
    assert (out / "notes.txt").read_text() == "keep"
    assert json.loads((out / MARKER).read_text())["files"] == ["decode.yaml", "grafana-dashboard.yaml", "prefill.yaml",
                                                              "proxy.yaml"]
    (out / "prefill.yaml").unlink()
    (out / "prefill.yaml").mkdir()
    assert main(["render", str(EXAMPLE), "--out", str(out)]) == 2
    capsys.readouterr()
    assert stat.S_ISDIR(os.lstat(out / "prefill.yaml").st_mode)
