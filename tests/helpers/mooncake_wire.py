"""What MooncakeConnectorV2's tests build and throw at it: worker metadata, handles, hostile handles."""

from __future__ import annotations

from connectors.mooncake import messages as m
from connectors.mooncake import tokens

V = m.PROTOCOL_VERSION
TOKEN = "A" * 43
OTHER = "B" * 43
KEY = b"k" * tokens.KEY_BYTES
"""A prefill engine's token key (the scheduler's, handed to its workers)."""


def issued(request_id: str) -> str:
    """A token that prefill engine (KEY) issued for `request_id` just now."""
    return tokens.issue(KEY, request_id)


BLOCK = 16 * 576 * 4


def layer(name, base, owner=None, num_blocks=64, block_len=BLOCK, stride=BLOCK):
    return m.LayerDesc(name=name, base_addr=base, num_blocks=num_blocks, block_len=block_len,
                       block_stride=stride, owner=owner)


def meta(tp_rank, layers, tp_size=2, kvpp=False, **kw):
    fields = dict(version=V, engine_id="pre", tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                  te_host="127.0.0.1", te_rpc_port=20000 + tp_rank, model="DeepseekV2ForCausalLM/layers=4",
                  dtype="float32", block_size=16, kvpp=kvpp, kv_heads=None, layers=layers)
    fields.update(kw)
    return m.WorkerMeta(**fields)


def names(n):
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def worker_meta(engine: str = "pre") -> m.WorkerMeta:
    layer = m.LayerDesc(name="model.layers.0.self_attn.attn", base_addr=4096, num_blocks=8, block_len=64,
                        block_stride=64)
    return m.WorkerMeta(version=V, engine_id=engine, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                        te_host="127.0.0.1", te_rpc_port=12345, model="M/layers=1", dtype="float32",
                        block_size=16, kvpp=False, kv_heads=None, layers=[layer])


def handle_params(**over):
    p = dict(remote_engine_id="pre", remote_request_id="cmpl-1-0-abcd", remote_token=TOKEN,
             remote_host="127.0.0.1", remote_kv_port=37000, remote_tp_size=2, remote_block_ids=[3, 4, 5],
             remote_num_tokens=40, do_remote_prefill=True)
    p.update(over)
    return p


HOSTILE_HANDLES = [
    ({"remote_host": "127.0.0.1; touch /tmp/x"}, "remote_host"),
    ({"remote_host": "evil.example\n"}, "remote_host"),
    ({"remote_host": "host name"}, "remote_host"),
    ({"remote_host": "a\x00b"}, "remote_host"),
    ({"remote_host": "tcp://1.2.3.4:5"}, "remote_host"),
    ({"remote_host": "-lead.example"}, "remote_host"),
    ({"remote_host": "a..b"}, "remote_host"),
    ({"remote_host": "x" * 254}, "remote_host"),
    ({"remote_host": ""}, "remote_host"),
    ({"remote_host": "fe80::1%eth0 x"}, "remote_host"),
    ({"remote_host": 12}, "remote_host"),
    ({"remote_kv_port": 0}, "remote_kv_port"),
    ({"remote_kv_port": 65536}, "remote_kv_port"),
    ({"remote_kv_port": -1}, "remote_kv_port"),
    ({"remote_kv_port": 65535}, "beyond 65535"),  # the derived range of 2 workers + control port
    ({"remote_kv_port": 65000, "remote_dp_size": 300}, "beyond 65535"),
    ({"remote_tp_size": 1025}, "remote_tp_size"),
    ({"remote_tp_size": 64, "remote_pp_size": 32}, "more than 1024"),
    ({"remote_tp_size": 0}, "remote_tp_size"),
    ({"remote_dp_rank": 2, "remote_dp_size": 2}, "remote_dp_rank 2 outside"),
    ({"remote_engine_id": ""}, "remote_engine_id"),
    ({"remote_engine_id": "e" * 257}, "remote_engine_id"),
    ({"remote_engine_id": "pre\nFAKE LOG LINE"}, "remote_engine_id"),
    ({"remote_request_id": "r 1"}, "remote_request_id"),
    ({"remote_request_id": "r\x1b[31m"}, "remote_request_id"),
    ({"remote_request_id": "r\u00e9"}, "remote_request_id"),
    ({"remote_token": "short"}, "remote_token"),
    ({"remote_token": TOKEN + "\n"}, "remote_token"),
    ({"remote_token": "A" * 42 + "!"}, "remote_token"),
    ({"remote_token": None}, "remote_token"),
    ({"remote_block_ids": [1, 2 ** 31]}, "remote_block_ids"),
    ({"remote_block_ids": [1, 2 ** 70]}, "remote_block_ids"),
    ({"remote_curve_key": "x" * 39}, "remote_curve_key"),
    ({"remote_curve_key": "x" * 39 + " "}, "remote_curve_key"),
]
