"""P/D end to end with real servers: a prefill (`vllm serve`-equivalent, TP=2, KVPP on) and a decode
(TP=1) joined by MooncakeConnectorV2 over Mooncake TE (tcp, loopback), driven through `kvpp proxy`.
Every server decodes with MTP (the tiny model with one MTP layer, one speculative token): the prefill
keeps the MTP cache on both ranks, and a decode reads it from one of them and each target layer from
its owner.

One pair of servers serves every assertion, `kvpp chaos` attached to them included; the lease test
adds a decode it kills, and the fault test kills the prefill, so they run last. The prefill's KV budget
(PREFILL_KV_BYTES) is one KVPP off could not fill with the full-capacity test's held prompts.
"""

from __future__ import annotations

import http.server
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from deploy.harness.engines import engine_num_blocks
from deploy.harness.pd_servers import pd_server
from deploy.services.processes import ManagedProcess, free_port, free_port_range, run_in_group, start_servers
from deploy.services.proxy import start_proxy
from deploy.harness.tiny_model import sample_prompt
from tests.helpers.mtp_tp2 import plan
from tests.helpers.pd_http import MAX_TOKENS, completion, metric, post, tokens_and_logprobs, wait_for

pytestmark = pytest.mark.engine

LAYERS = 16
MTP = ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1}))
PAGE_BYTES = 16 * 576 * 4  # block size 16 x MLA head 576 x fp32
HOLD_TIMEOUT_S = 20  # initial lease: a request no decode claims is freed after this
LEASE_S = 4  # a claimed request's blocks are freed this long after its decode stops renewing
PROMPT_WORDS = (300, 45, 170)
PREFILL_KV_BYTES = 64 << 20  # per rank: KVPP off 107 blocks, on 165 (MTP model, TP2)
HELD_WORDS = (250,) * 8  # 8 x 16 blocks held at once: past KVPP off's 107


@pytest.fixture(scope="module")
def pd(mtp_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    started: list[ManagedProcess] = []
    try:
        prefill = pd_server("prefill", mtp_model, tmp, tp=2, cores=[0, 1], role="kv_producer",
                         kv_port=free_port_range(3), hold_timeout_s=HOLD_TIMEOUT_S, lease_s=LEASE_S,
                         server={"kv_cache_bytes": PREFILL_KV_BYTES}, extra_args=["--additional-config", json.dumps({"enable_kvpp": True}), *MTP])
        decode = pd_server("decode", mtp_model, tmp, tp=1, cores=[1], role="kv_consumer", kv_port=free_port_range(2),
                        policy="recompute", transfer_timeout_s=5, extra_args=MTP)
        start_servers((prefill, decode), started, timeout=400)
        proxy, proxy_url = start_proxy([prefill.url], [decode.url], tmp / "proxy.log")
        started.append(proxy)
        yield {"prefill": prefill, "decode": decode, "proxy": proxy_url,
               "model": mtp_model, "tmp": tmp, "started": started}
    finally:
        for proc in reversed(started):
            proc.stop()


@pytest.fixture(scope="module")
def colocated(pd):
    """Reference answers: the decode engine serving each prompt by itself (prefill and decode in one
    engine, no connector involved: no kv_transfer_params)."""
    return {n: completion(pd["decode"].url, pd["model"], sample_prompt(n, seed=n)) for n in PROMPT_WORDS}


def test_proxy_completions_equal_colocated_engine(pd, colocated):
    for n in PROMPT_WORDS:
        got = completion(pd["proxy"], pd["model"], sample_prompt(n, seed=n))
        ref_tokens, ref_lps = tokens_and_logprobs(colocated[n])
        tokens, lps = tokens_and_logprobs(got)
        assert len(tokens) == MAX_TOKENS and tokens == ref_tokens, f"{n}-token prompt"
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4, f"{n}-token prompt: {lps} vs {ref_lps}"


def test_decode_really_loaded_the_prefill_kv(pd, colocated):
    """Swap the first word of the decode's prompt: the answer must follow the prefill's KV (prompt A),
    not the decode's own text (prompt B) - impossible unless the KV was pulled - and the connector's
    counters and the engine's external-cache-hit count must account for exactly the prompt's pages."""
    decode, n = pd["decode"], 170
    prompt_a = sample_prompt(n, seed=n)
    words = prompt_a.split()
    prompt_b = " ".join(["water" if words[0] != "water" else "city", *words[1:]])
    own_b = completion(decode.url, pd["model"], prompt_b)
    assert tokens_and_logprobs(own_b)[1] != tokens_and_logprobs(colocated[n])[1]  # B alone differs from A

    bytes_before = metric(decode.url, "vllm:mooncake_v2_pulled_bytes_total")
    pulls_before = metric(decode.url, "vllm:mooncake_v2_pulls_total")
    hits_before = metric(decode.url, "vllm:external_prefix_cache_hits_total")
    failed_before = metric(decode.url, "vllm:mooncake_v2_failed_pulls_total")
    first = post(f"{pd['prefill'].url}/v1/completions",
                 {"model": pd["model"], "prompt": prompt_a, "max_tokens": 1, "temperature": 0,
                  "kv_transfer_params": {"do_remote_decode": True}})
    params = first["kv_transfer_params"]
    assert params["remote_tp_size"] == 2 and params["remote_num_tokens"] == n
    got = completion(decode.url, pd["model"], prompt_b, kv_transfer_params=params)
    tokens, lps = tokens_and_logprobs(got)
    ref_tokens, ref_lps = tokens_and_logprobs(colocated[n])
    assert tokens == ref_tokens and max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4
    # vLLM reports the prefill's own cache hits in usage.prompt_tokens_details (0 here); the engine's
    # count of prompt tokens that came through the connector is this counter.
    assert metric(decode.url, "vllm:external_prefix_cache_hits_total") - hits_before == n

    pages = -(-n // 16)
    wait_for(lambda: metric(decode.url, "vllm:mooncake_v2_pulls_total") >= pulls_before + 1, 30, "pull counted")
    # The 16 target layers, each from its owner, and the MTP layer once.
    assert metric(decode.url, "vllm:mooncake_v2_pulled_bytes_total") - bytes_before == (LAYERS + 1) * pages * PAGE_BYTES
    assert metric(decode.url, "vllm:mooncake_v2_failed_pulls_total") == failed_before


def test_forged_side_channel_requests_are_refused_by_a_real_prefill(pd, colocated):
    """An attacker who knows a held request's id but not its token: its done-notices, metadata
    requests and lease renewals to every prefill worker are refused and counted, the blocks stay
    held, and the real decode still pulls them and answers like the colocated engine."""
    from connectors.mooncake import messages as m
    from connectors.mooncake.channel import ChannelError, call
    from connectors.mooncake.puller import prefill_ports

    prefill, n = pd["prefill"], 45
    refused_before = metric(prefill.url, "vllm:mooncake_v2_side_channel_refused_total")
    params = post(f"{prefill.url}/v1/completions",
                  {"model": pd["model"], "prompt": sample_prompt(n, seed=n), "max_tokens": 1, "temperature": 0,
                   "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]
    handle = m.parse_handle(params)
    forged = "f" * 43
    hostile = [
        m.DoneNotice(version=m.PROTOCOL_VERSION, request_id=handle.remote_request_id, token=forged,
                     consumer="attacker", num_consumers=1, success=True),
        m.MetaRequest(version=m.PROTOCOL_VERSION, request_id=handle.remote_request_id, token=forged),
        m.LeaseRenewal(version=m.PROTOCOL_VERSION,
                       claims=[m.LeaseClaim(request_id=handle.remote_request_id, token=forged)]),
    ]
    for _, _, port in prefill_ports(handle):
        for message in hostile:
            with pytest.raises(ChannelError, match="unauthorized"):
                call(handle.remote_host, port, message, 10.0, m.Released)
    tried = len(hostile) * handle.remote_tp_size
    wait_for(lambda: metric(prefill.url, "vllm:mooncake_v2_side_channel_refused_total") >= refused_before + tried,
             20, "refusals counted")
    assert metric(prefill.url, "vllm:kv_cache_usage_perc") > 0  # still held for the real decode
    got = completion(pd["decode"].url, pd["model"], sample_prompt(n, seed=n), kv_transfer_params=params)
    assert tokens_and_logprobs(got)[0] == tokens_and_logprobs(colocated[n])[0]
    print(f"forged side-channel requests sent to the real prefill: {tried}, all refused and counted")


def test_prefill_at_full_capacity_holds_blocks_past_kvpp_off_and_decodes_pull_them(pd):
    """Prefill legs holding more blocks than KVPP off has, all at once (block ids past its count among
    them, read from the handles; usage from vLLM's gauge, no preemption); the decode then pulls each and
    answers like itself serving the prompt alone."""
    prefill, decode, model = pd["prefill"], pd["decode"], pd["model"]
    off_blocks = plan(model, PREFILL_KV_BYTES).blocks_off
    on_blocks = engine_num_blocks(prefill.url)
    prompts = [sample_prompt(n, seed=1000 + i) for i, n in enumerate(HELD_WORDS)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        reference = list(pool.map(lambda p: completion(decode.url, model, p), prompts))
        preempted = metric(prefill.url, "vllm:num_preemptions_total")
        handles = list(pool.map(lambda p: _prefill_leg(pd, p), prompts))
        held = round(metric(prefill.url, "vllm:kv_cache_usage_perc") * (on_blocks - 1))
        assert metric(prefill.url, "vllm:num_preemptions_total") == preempted
        got = list(pool.map(lambda ph: completion(decode.url, model, ph[0], kv_transfer_params=ph[1]),
                            zip(prompts, handles)))
    high = max(b for h in handles for b in h["remote_block_ids"])
    print(f"prefill held {held}/{on_blocks} blocks at once (KVPP off: {off_blocks}); highest block id pulled {high}")
    assert held > off_blocks and high >= off_blocks
    for want, have in zip(reference, got):
        tokens, lps = tokens_and_logprobs(have)
        ref_tokens, ref_lps = tokens_and_logprobs(want)
        assert tokens == ref_tokens and max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4


def test_no_blocks_leak_after_pulls(pd):
    for s in (pd["prefill"], pd["decode"]):
        wait_for(lambda: metric(s.url, "vllm:kv_cache_usage_perc") == 0, 20, f"{s.name} KV usage back to 0")


def _chaos_attached(pd, reference: str, engines: str, seconds: int) -> tuple[dict | None, object]:
    """`kvpp chaos` pointed at this module's running proxy and engines; (its report or None, the process)."""
    report = pd["tmp"] / f"chaos-attached-{time.monotonic_ns()}.json"
    proc = run_in_group([sys.executable, "-m", "deploy.cli.main", "chaos", "--proxy", pd["proxy"], "--engines", engines,
                         "--reference", reference, "--model", pd["model"], "--seconds", str(seconds),
                         "--clients", "2", "--report", str(report)], timeout=600)
    return (json.loads(report.read_text()) if report.exists() else None), proc


class _WrongReference(http.server.BaseHTTPRequestHandler):
    """A "reference" whose answers are not the model's (another model, a stale deployment)."""

    def do_GET(self):
        self._send({})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send({"choices": [{"logprobs": {"tokens": ["wrong"] * MAX_TOKENS}}], "usage": {"prompt_tokens": 8}})

    def _send(self, body: dict):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_chaos_attached_to_running_instances(pd):
    """`kvpp chaos --proxy/--engines/--reference/--model` against this module's servers (the decode,
    serving prompts alone, is the colocated reference): every answer equals the reference's, both
    client cancellations end on every engine, nothing is left running or held, and the decode pulled
    once per P/D request. A reference answering otherwise fails the run; an unreachable engine is
    refused, by its option, before any load."""
    engines = f"prefill={pd['prefill'].url},decode={pd['decode'].url}"
    report, proc = _chaos_attached(pd, pd["decode"].url, engines, 24)
    assert report is not None, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    totals = report["totals"]
    assert proc.returncode == 0 and report["ok"] and not report["problems"], report["problems"]
    assert totals["answered"] >= 10 and totals["wrong"] == totals["error"] == 0, totals
    assert report["proxy_paths"]["pd"] >= totals["answered"] and report["proxy_paths"]["failed"] == 0
    assert [p["label"] for p in report["cancel_probes"]] == ["cancel stream", "cancel plain"]
    assert all(p["idle"] and p["idle_after_s"] <= 5 and p["tokens_generated"] < 600 for p in report["cancel_probes"])
    assert all(s == {"running": 0, "waiting": 0, "kv_cache_usage": 0} for s in report["drain"]["engines"].values())
    counters = report["counters"]
    assert counters["consistent"] and counters["pulls"] == counters["proxy_pd"] == counters["requests"] == 8
    assert "verdict            PASS" in proc.stdout

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _WrongReference)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wrong, proc = _chaos_attached(pd, f"http://127.0.0.1:{server.server_address[1]}", engines, 6)
    finally:
        server.shutdown()
    assert proc.returncode == 1 and not wrong["ok"] and "verdict            FAIL" in proc.stdout
    assert wrong["totals"]["wrong"] > 0 and wrong["totals"]["answered"] == 0
    assert any("wrong" in problem for problem in wrong["problems"]), wrong["problems"]

    dead = f"http://127.0.0.1:{free_port()}"
    refused, proc = _chaos_attached(pd, pd["decode"].url, f"prefill={pd['prefill'].url},decode={dead}", 6)
    assert refused is None and proc.returncode == 2
    assert f"kvpp: error: --engines decode={dead}: {dead}/metrics unreachable" in proc.stderr, proc.stderr


def test_prefill_frees_blocks_when_decode_never_pulls(pd):
    prefill = pd["prefill"]
    post(f"{prefill.url}/v1/completions",
         {"model": pd["model"], "prompt": sample_prompt(200, seed=5), "max_tokens": 1, "temperature": 0,
          "kv_transfer_params": {"do_remote_decode": True}})
    answered = time.monotonic()
    wait_for(lambda: metric(prefill.url, "vllm:kv_cache_usage_perc") > 0, 10, "prefill holds the blocks")
    wait_for(lambda: metric(prefill.url, "vllm:kv_cache_usage_perc") == 0, HOLD_TIMEOUT_S + 15,
             "prefill frees unpulled blocks")
    assert time.monotonic() - answered >= HOLD_TIMEOUT_S - 2  # freed by the timeout, not right away
    assert "no decode claimed them within hold_timeout_s" in prefill.log_path.read_text()


def _prefill_leg(pd, prompt: str) -> dict:
    return post(f"{pd['prefill'].url}/v1/completions",
                {"model": pd["model"], "prompt": prompt, "max_tokens": 1, "temperature": 0,
                 "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]


def _occupy(url: str, model: str) -> urllib.request.addinfourl:
    """A streamed long generation holding the decode's only run slot until the stream is closed."""
    body = {"model": model, "prompt": sample_prompt(8, seed=1), "max_tokens": 1900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120)  # returns with the headers, queued or running


def _in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except Exception as exc:  # reported by the caller's assertion
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_leases_keep_a_queued_decode_s_blocks_and_free_a_killed_one_s(pd, colocated):
    """A decode with one run slot: a P/D request waits in its queue far longer than the initial lease;
    the decode's renewals keep its blocks (the prefill counts renewals and no lapse) and it pulls and
    answers right when it runs. Then a request queued on that decode when it is SIGKILLed: the prefill
    frees its blocks about one lease later, counted as lapsed, not after the initial lease.

    Each prefill leg runs before the decode is busy: its long generation shares a core with the
    prefill's second rank (2 cores here), and a prefill leg run beside it took 70 s instead of 1 s,
    so the P/D request reached the decode only after the queue had drained."""
    prefill, model, n = pd["prefill"], pd["model"], 170
    workers = 2  # prefill TP ranks: each counts its own renewals and lapses
    queue = pd_server("decode-queue", model, pd["tmp"], tp=1, cores=[1], role="kv_consumer",
                      kv_port=free_port_range(2), transfer_timeout_s=5, extra_args=["--max-num-seqs", "1", *MTP])
    pd["started"].append(queue.start())
    queue.wait_ready(timeout=400)

    def prefill_count(what: str) -> float:
        return metric(prefill.url, f"vllm:mooncake_v2_{what}_total")

    lapsed, renewed = prefill_count("lapsed_holds"), prefill_count("lease_renewals")
    pulls = metric(queue.url, "vllm:mooncake_v2_pulls_total")
    params = _prefill_leg(pd, sample_prompt(n, seed=n))
    slots = [_occupy(queue.url, model), _occupy(queue.url, model)]  # one runs, one waits: a long queue
    time.sleep(1)
    thread, out = _in_thread(completion, queue.url, model, sample_prompt(n, seed=n), kv_transfer_params=params)
    time.sleep(HOLD_TIMEOUT_S + 3)
    assert thread.is_alive(), f"the P/D request should still be queued behind the long generations: {out}"
    assert metric(prefill.url, "vllm:kv_cache_usage_perc") > 0  # kept past the initial lease: renewed
    assert prefill_count("lapsed_holds") == lapsed
    # A heartbeat every LEASE_S / 3 on each worker; far fewer would not have kept the blocks.
    assert prefill_count("lease_renewals") - renewed >= workers * HOLD_TIMEOUT_S / LEASE_S
    for slot in slots:
        slot.close()  # the client goes away: vLLM aborts the long generations
    thread.join(timeout=120)
    assert "value" in out, out.get("error")
    tokens, lps = tokens_and_logprobs(out["value"])
    ref_tokens, ref_lps = tokens_and_logprobs(colocated[n])
    assert tokens == ref_tokens and max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4
    wait_for(lambda: metric(queue.url, "vllm:mooncake_v2_pulls_total") >= pulls + 1, 30, "pull counted")
    assert metric(queue.url, "vllm:mooncake_v2_failed_pulls_total") == 0
    wait_for(lambda: metric(prefill.url, "vllm:kv_cache_usage_perc") == 0, 20, "prefill freed the pulled blocks")
    assert prefill_count("lapsed_holds") == lapsed  # freed by the decode's done-notice

    params = _prefill_leg(pd, sample_prompt(200, seed=6))
    slot = _occupy(queue.url, model)
    renewed = prefill_count("lease_renewals")
    _in_thread(completion, queue.url, model, sample_prompt(200, seed=6), kv_transfer_params=params)
    wait_for(lambda: prefill_count("lease_renewals") >= renewed + workers, 10, "the queued request's lease renewed")
    assert metric(prefill.url, "vllm:kv_cache_usage_perc") > 0
    queue._signal_group(signal.SIGKILL)
    killed = time.monotonic()
    freed = wait_for(lambda: metric(prefill.url, "vllm:kv_cache_usage_perc") == 0, HOLD_TIMEOUT_S + 10,
                     "prefill frees a killed decode's blocks")
    slot.close()
    assert freed < LEASE_S + 4, f"freed {freed:.1f} s after the decode died (lease {LEASE_S} s)"
    assert time.monotonic() - killed < HOLD_TIMEOUT_S
    wait_for(lambda: prefill_count("lapsed_holds") >= lapsed + workers, 10, "lapse counted")
    assert prefill_count("lapsed_holds") == lapsed + workers  # this request, on each worker
    print(f"blocks kept {HOLD_TIMEOUT_S + 3} s past a {HOLD_TIMEOUT_S} s initial lease by renewals; "
          f"a killed decode's blocks freed {freed:.1f} s after SIGKILL (lease {LEASE_S} s)")


def test_prefill_killed_before_pull(pd, colocated):
    """The prefill dies between its answer and the decode's pull: the recompute-policy decode still
    answers correctly (it recomputes the prompt), a fail-policy decode returns an error, both within
    bounded time, and both keep serving."""
    tmp, model = pd["tmp"], pd["model"]
    decode_fail = pd_server("decode-fail", model, tmp, tp=1, cores=[1], role="kv_consumer",
                         kv_port=free_port_range(2), policy="fail", transfer_timeout_s=5, extra_args=MTP)
    pd["started"].append(decode_fail.start())
    decode_fail.wait_ready(timeout=400)

    n = 45
    prompt = sample_prompt(n, seed=n)
    params = [post(f"{pd['prefill'].url}/v1/completions",
                   {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"] for _ in range(2)]
    pd["prefill"].stop()

    start = time.monotonic()
    recomputed = completion(pd["decode"].url, model, prompt, kv_transfer_params=params[0])
    assert time.monotonic() - start < 60
    assert tokens_and_logprobs(recomputed) == tokens_and_logprobs(colocated[n])
    assert metric(pd["decode"].url, "vllm:mooncake_v2_failed_pulls_total") >= 1

    start = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as failed:
        completion(decode_fail.url, model, prompt, kv_transfer_params=params[1])
    assert time.monotonic() - start < 60
    assert failed.value.code >= 400

    for s in (pd["decode"], decode_fail):
        assert tokens_and_logprobs(completion(s.url, model, prompt)) == tokens_and_logprobs(colocated[n])
        wait_for(lambda: metric(s.url, "vllm:kv_cache_usage_perc") == 0, 20, f"{s.name} KV usage back to 0")
