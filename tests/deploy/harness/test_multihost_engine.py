"""A rendered deployment run unchanged across five hosts (network namespaces on a bridge, as root).

The spec puts a prefill (TP=2, KVPP, MooncakeConnectorV2 + pool) on host "prefill", a decode on
"decode", the Mooncake pool (`kvpp pool serve`: master + segment holder) on "pool", `kvpp proxy` on
"proxy", and a second KVPP prefill (TP=2) on "prefill2". `kvpp check` must accept it, `kvpp render --format shell
--launcher api-server` writes the scripts, and each script runs as written inside its host. Answers
through the proxy must equal the decode engine computing the prompts itself; the ports each host
listens on must be the ones `kvpp ports` predicts; a prefix pooled by the first prefill must be hit by
the second after the first is restarted; and a host whose link goes down costs a bounded recompute,
never a wrong answer, with traffic resuming when the link returns. The same spec rendered with
vllm-router as its P/D front runs on a sixth host, in front of the same instances.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from connectors.store.lookup import lookup_path
from deploy.harness.engines import engine_metrics, metric_total
from deploy.harness.multihost import HOSTS, HTTP_PORT, KV_PORT, LOOKUP_PORT, POOL_PORT, PROXY_PORT, ROUTER_HOST, \
    TRANSFER_TIMEOUT_S, RenderedStack, cpu_spec, router_spec
from deploy.harness.testbed import Testbed, unavailable_reason
from deploy.harness.tiny_model import sample_prompt
from tests.helpers.paths import REPO
from tests.helpers.pd_http import post, wait_for

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

KVPP = [sys.executable, "-m", "deploy.cli.main"]
MAX_TOKENS = 6


def metric(base_url: str, name: str) -> float:
    """A counter's total on a server, 0 before it is first exported."""
    return metric_total(engine_metrics(base_url), name)


def answer(resp: dict) -> tuple[list[str], list[float]]:
    lp = resp["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def same_answer(got: dict, ref: dict) -> bool:
    (tokens, lps), (ref_tokens, ref_lps) = answer(got), answer(ref)
    return tokens == ref_tokens and max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4


def listening_ports(bed: Testbed, host: str) -> set[int]:
    out = bed.run(host, ["ss", "-ltnH"]).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    with Testbed([*HOSTS, ROUTER_HOST]) as bed:
        spec = cpu_spec(bed, tiny_model)
        stack = RenderedStack(bed, spec, tmp)
        # What an operator runs: the CLI accepts the spec that was rendered.
        check = subprocess.run([*KVPP, "check", tmp / "spec.yaml"], capture_output=True, text=True, cwd=REPO)
        assert check.returncode == 0 and "error" not in check.stdout, check.stdout + check.stderr
        stack.start_all()
        yield {"bed": bed, "stack": stack, "proxy": stack.url("proxy"), "model": tiny_model, "spec": spec, "tmp": tmp}


@pytest.fixture(scope="module")
def reference(stack):
    """The decode engine computing each prompt itself (no connector involved)."""
    decode = stack["stack"].url("decode")
    return {n: post(f"{decode}/v1/completions", completion_body(stack, n)) for n in (40, 130, 200)}


def completion_body(stack, n: int, **extra) -> dict:
    return {"model": stack["model"], "prompt": sample_prompt(n, seed=n), "max_tokens": MAX_TOKENS,
            "temperature": 0, "logprobs": 1, **extra}


def test_hosts_listen_on_the_ports_kvpp_ports_predicted(stack):
    bed = stack["bed"]
    for name, tp in (("prefill", 2), ("decode", 1), ("prefill2", 2)):
        predicted = json.loads(subprocess.run([*KVPP, "ports", "--kv-port", str(KV_PORT[name]), "--tp", str(tp),
                                               "--json"], capture_output=True, text=True, cwd=REPO).stdout)
        handshake = {w["port"] for w in predicted["workers"]}
        listening = listening_ports(bed, name)
        assert handshake <= listening, f"{name}: handshake ports {sorted(handshake)} not all in {sorted(listening)}"
        assert HTTP_PORT[name] in listening
    assert POOL_PORT in listening_ports(bed, "pool")
    assert PROXY_PORT in listening_ports(bed, "proxy")
    # Each prefill's pool lookup channel is its own, at the lookup_rpc_port the spec gave it.
    for port in LOOKUP_PORT.values():
        assert Path(lookup_path(port, 0).removeprefix("ipc://")).is_socket(), f"no lookup socket for {port}"


def test_answers_through_the_proxy_equal_the_decode_computing_them(stack, reference):
    decode = stack["stack"].url("decode")
    pulls = metric(decode, "vllm:mooncake_v2_pulls_total")
    pulled = metric(decode, "vllm:mooncake_v2_pulled_bytes_total")
    read_s = metric(decode, "vllm:mooncake_v2_transfer_seconds_total")
    seconds = []
    for n, ref in reference.items():
        for _ in range(2):  # the proxy alternates the two prefill instances
            started = time.monotonic()
            got = post(f"{stack['proxy']}/v1/completions", completion_body(stack, n))
            seconds.append(time.monotonic() - started)
            assert same_answer(got, ref), f"{n}-token prompt through the proxy"
    assert metric(decode, "vllm:mooncake_v2_pulls_total") - pulls >= 2 * len(reference) - 1
    assert metric(decode, "vllm:mooncake_v2_failed_pulls_total") == 0
    moved = metric(decode, "vllm:mooncake_v2_pulled_bytes_total") - pulled
    took = metric(decode, "vllm:mooncake_v2_transfer_seconds_total") - read_s
    print(f"multi-host: {len(seconds)} requests through the proxy, {min(seconds):.2f}-{max(seconds):.2f} s each; "
          f"pulls across the bridge {moved / 1e6:.1f} MB in {took:.3f} s ({moved / max(took, 1e-9) / 1e6:.0f} MB/s)")


def test_vllm_router_on_its_own_host_answers_like_the_decode_and_spreads_the_prefills(stack, reference):
    """The same spec with `proxy.router: vllm-router` on a sixth host: `kvpp check` accepts it, its rendered
    proxy.sh runs as written there, and answers through it equal the decode's own, each a pull across the
    bridge (a fresh cache_salt: no host has the prompt cached, pool included), its prefill legs round-robin
    over both KVPP prefills, and a prefix the router's first prefill leg pooled is loaded by the second's,
    on the other prefill."""
    bed, s = stack["bed"], stack["stack"]
    (stack["tmp"] / "vllm-router").mkdir()
    front = RenderedStack(bed, router_spec(stack["spec"], bed), stack["tmp"] / "vllm-router")
    check = subprocess.run([*KVPP, "check", front.workdir / "spec.yaml"], capture_output=True, text=True, cwd=REPO)
    assert check.returncode == 0 and "error" not in check.stdout, check.stdout + check.stderr
    assert "exec vllm-router" in (front.scripts / "proxy.sh").read_text()
    decode = s.url("decode")
    counters = ("vllm:mooncake_v2_pulls_total", "vllm:mooncake_v2_failed_pulls_total")
    before = {name: metric(decode, name) for name in counters}
    prefill_legs = {host: metric(s.url(host), "vllm:request_success_total") for host in ("prefill", "prefill2")}
    front.start(ROUTER_HOST)
    try:
        front.wait_ready([ROUTER_HOST], timeout=120)
        router = front.url(ROUTER_HOST)
        for n, ref in reference.items():
            for _ in range(2):
                got = post(f"{router}/v1/completions", completion_body(stack, n, cache_salt=uuid.uuid4().hex))
                assert same_answer(got, ref), f"{n}-token prompt through vllm-router"
        requests = 2 * len(reference)
        spread = {host: metric(s.url(host), "vllm:request_success_total") - prefill_legs[host] for host in prefill_legs}
        assert spread == {"prefill": requests / 2, "prefill2": requests / 2}, spread
        hit_tokens, attempts = _pooled_prefix_through(router, stack)
    finally:
        front.stop(ROUTER_HOST)
    pulls = requests + 2 * attempts
    wait_for(lambda: metric(decode, counters[0]) - before[counters[0]] >= pulls, 30, "pulls counted")
    assert metric(decode, counters[0]) - before[counters[0]] == pulls
    assert metric(decode, counters[1]) == before[counters[1]]
    print(f"vllm-router on host {bed.address(ROUTER_HOST)}: {pulls} requests answered like the decode, as "
          f"many pulls, prefill legs {spread}; a prefix pooled by one prefill was loaded by the other ({hit_tokens} "
          f"tokens, attempt {attempts})")


SAVE_ATTEMPTS = 3
PREFILL_RANKS = 2  # both prefills are TP=2 KVPP: a block's save is one owner-shard object on each rank


def save_counts(url: str) -> tuple[float, float]:
    return metric(url, "vllm:kv_pool_saved_blocks_total"), metric(url, "vllm:kv_pool_save_failures_total")


def whole_save(url: str, before: tuple[float, float], blocks: int, what: str) -> bool:
    """Wait until the instance at `url` settled the save of `blocks` blocks on every rank: True if every object
    was saved, False if any was counted as failed (a store call past its bound on this starved host: a dropped
    save, which the product reports and later answers as a miss)."""
    def settled() -> tuple[float, float]:
        saved, failed = save_counts(url)
        return saved - before[0], failed - before[1]

    wait_for(lambda: sum(settled()) >= PREFILL_RANKS * blocks, 60, what)
    if not settled()[1]:
        return True
    print(f"{what}: the save was counted as failed; pooling a fresh prompt")
    return False


def pooled_in_attempts(attempt_once):
    """`attempt_once(attempt)`'s first result that is not None (a prompt it pooled), and that attempt's number."""
    for attempt in range(SAVE_ATTEMPTS):
        result = attempt_once(attempt)
        if result is not None:
            return result, attempt + 1
    raise AssertionError(f"no prefix was pooled in {SAVE_ATTEMPTS} attempts: every save was counted as failed")


def _pooled_prefix_through(router: str, stack) -> tuple[int, int]:
    """One prompt twice through the round-robin router: its first prefill leg saves the prefix to the pool, the
    second, on the other prefill, loads it from there; both answers equal the decode's own. The tokens hit, and
    the attempt that pooled them (each attempt is two requests)."""
    s, n = stack["stack"], 250
    hosts = ("prefill", "prefill2")

    def attempt_once(_attempt: int) -> int | None:
        body = completion_body(stack, n, prompt=sample_prompt(n, seed=11 * n), cache_salt=uuid.uuid4().hex)
        reference = post(f"{s.url('decode')}/v1/completions", body)
        served = {h: metric(s.url(h), "vllm:request_success_total") for h in hosts}
        hits = {h: metric(s.url(h), "vllm:kv_pool_hit_tokens_total") for h in hosts}
        saves = {h: save_counts(s.url(h)) for h in hosts}
        assert same_answer(post(f"{router}/v1/completions", body), reference)
        first = next(h for h in hosts if metric(s.url(h), "vllm:request_success_total") > served[h])
        other = hosts[1 - hosts.index(first)]
        pooled = whole_save(s.url(first), saves[first], n // 16, f"the prefix saved to the pool by {first}")
        assert same_answer(post(f"{router}/v1/completions", body), reference)
        if not pooled:
            return None
        hit = metric(s.url(other), "vllm:kv_pool_hit_tokens_total") - hits[other]
        assert hit == (n // 16) * 16, f"{other} loaded {hit} pooled tokens"
        return int(hit)

    return pooled_in_attempts(attempt_once)


def test_a_prefix_pooled_on_one_host_is_hit_on_another_after_the_first_restarts(stack):
    s, n = stack["stack"], 250
    prefill, prefill2, decode = s.url("prefill"), s.url("prefill2"), s.url("decode")

    def attempt_once(attempt: int) -> tuple[dict, dict] | None:
        # A prompt no earlier test (or attempt) sent.
        body = {**completion_body(stack, n), "prompt": sample_prompt(n, seed=10 * n + attempt)}
        reference = post(f"{decode}/v1/completions", body)
        before = save_counts(prefill)
        post(f"{prefill}/v1/completions", {**body, "max_tokens": 1})
        return (body, reference) if whole_save(prefill, before, n // 16, "the prefix saved to the pool") else None

    (body, reference), _ = pooled_in_attempts(attempt_once)
    s.stop("prefill")  # the writer is gone: the segment holder on the pool host keeps the data
    s.start("prefill")
    hits = metric(prefill2, "vllm:kv_pool_hit_tokens_total")
    got = post(f"{prefill2}/v1/completions", body)
    assert metric(prefill2, "vllm:kv_pool_hit_tokens_total") - hits == (n // 16) * 16
    assert same_answer(got, reference)
    s.wait_ready(["prefill"])


def test_a_downed_link_costs_a_bounded_recompute_and_traffic_resumes(stack, reference):
    bed, s, n = stack["bed"], stack["stack"], 130
    prefill, decode = s.url("prefill"), s.url("decode")
    first = post(f"{prefill}/v1/completions", completion_body(stack, n, max_tokens=1,
                                                             kv_transfer_params={"do_remote_decode": True}))
    failed = metric(decode, "vllm:mooncake_v2_failed_pulls_total")
    bed.set_link("prefill", up=False)
    try:
        started = time.monotonic()
        got = post(f"{decode}/v1/completions",
                   completion_body(stack, n, kv_transfer_params=first["kv_transfer_params"]))
        elapsed = time.monotonic() - started
    finally:
        bed.set_link("prefill", up=True)
    assert same_answer(got, reference[n]), "the decode's recompute after a failed pull"
    assert metric(decode, "vllm:mooncake_v2_failed_pulls_total") == failed + 1
    # Liveness: 9x the 5 s transfer timeout (the failed pull is counted above); a pull without it waits 30 s or more.
    assert elapsed < 3 * TRANSFER_TIMEOUT_S + 30, f"recompute took {elapsed:.0f}s"
    # With the link back, the same path works again end to end.
    for m, ref in reference.items():
        assert same_answer(post(f"{stack['proxy']}/v1/completions", completion_body(stack, m)), ref)
    for name in ("prefill", "decode", "prefill2"):
        wait_for(lambda: metric(s.url(name), "vllm:kv_cache_usage_perc") == 0, 60, f"{name} KV usage back to 0")
