"""A stand-in prefill worker without vLLM: seeded KV pages in registered memory, a real Mooncake
TransferEngine and the connector's own side channel and hold table.

The transfer benchmark and the integration tests run it as a separate process so that reads
cross a process boundary exactly as between a decode and a prefill worker. It prints one JSON
line when ready, one line per released/expired hold and per refused side-channel request, and exits
when stdin closes.

    python bench/mooncake_peer.py --port 37000 --layers 4 --blocks 64 --seed 1 [--owned 0,1 --tp-rank 0 --tp-size 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

import torch

from connectors.mooncake.channel import SideChannelServer
from connectors.mooncake.holds import HoldTable
from connectors.mooncake.messages import PROTOCOL_VERSION, LayerDesc, WorkerMeta
from connectors.mooncake.responder import PrefillResponder
from connectors.mooncake.transfer import MooncakeTransfer

BLOCK_SHAPE = (16, 576)  # block size 16 x MLA head 576, the tiny model's page
MODEL_KEY = "DeepseekV2ForCausalLM/peer"
TOKEN = "peer-token-" + "x" * 32
"""Token of holds given as --hold ID (a real prefill issues a random one per request)."""


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def pages(layers: int, blocks: int, seed: int) -> torch.Tensor:
    """The peer's KV content; a reader regenerates it from the seed to check bytes."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((layers, blocks, *BLOCK_SHAPE), generator=gen, dtype=torch.float32)


def local_meta(kv: torch.Tensor, engine_id: str, tp_rank: int, tp_size: int, te: MooncakeTransfer,
               owned: set[int] | None = None) -> WorkerMeta:
    """WorkerMeta of a [layers, blocks, 16, 576] tensor; `owned` publishes only those layers (KVPP)."""
    block_len = kv[0, 0].numel() * kv.element_size()
    layers = [
        LayerDesc(name=layer_name(i), base_addr=kv[i].data_ptr(), num_blocks=kv.shape[1], block_len=block_len,
                  block_stride=kv.stride(1) * kv.element_size(), owner=None if owned is None else tp_rank)
        for i in range(kv.shape[0]) if owned is None or i in owned
    ]
    return WorkerMeta(version=PROTOCOL_VERSION, engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size, pp_rank=0,
                      pp_size=1, te_host=te.host, te_rpc_port=te.rpc_port, model=MODEL_KEY, dtype="float32",
                      block_size=BLOCK_SHAPE[0], kvpp=owned is not None, layers=layers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True, help="side-channel (handshake) port")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-id", default="peer")
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--owned", default=None, help="comma-separated layers to publish as KVPP owner")
    ap.add_argument("--hold", action="append", default=[], help="ID or ID=TOKEN to hold (repeatable)")
    ap.add_argument("--hold-timeout", type=float, default=60.0)
    ap.add_argument("--lease", type=float, default=None, help="lease a renewal grants (s; default: --hold-timeout)")
    args = ap.parse_args()

    kv = pages(args.layers, args.blocks, args.seed)
    te = MooncakeTransfer("127.0.0.1", timeout_s=5)
    te.register([(kv.data_ptr(), kv.numel() * kv.element_size())])
    owned = None if args.owned is None else {int(x) for x in args.owned.split(",") if x}
    meta = local_meta(kv, args.engine_id, args.tp_rank, args.tp_size, te, owned)
    holds = HoldTable(args.hold_timeout, args.lease)
    for spec in args.hold:
        request_id, _, token = spec.partition("=")
        holds.hold(request_id, args.hold_timeout, token or TOKEN)
    responder = PrefillResponder(holds)
    responder.meta = meta
    server = SideChannelServer("127.0.0.1", args.port, responder, what="mooncake peer",
                               on_refused=lambda code: print(json.dumps({"refused": code}), flush=True))
    print(json.dumps({"ready": True, "port": args.port, "te": te.session}), flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.wait(0.1):
        released, expired = holds.pop_finished()
        for request_id in sorted(released):
            print(json.dumps({"released": request_id}), flush=True)
        for request_id in sorted(expired):
            print(json.dumps({"expired": request_id}), flush=True)
    server.close()
    te.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
