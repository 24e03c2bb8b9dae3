"""A stand-in prefill worker without vLLM: seeded KV pages in registered memory, a real Mooncake
TransferEngine and the connector's own side channel and hold table.

The transfer benchmark and the integration tests run it as a separate process so that reads
cross a process boundary exactly as between a decode and a prefill worker. It prints one JSON
line when ready, one line per released/expired hold and per refused side-channel request, and exits
when stdin closes.

    python -m testbed.mooncake_peer '{"port": 37000, "layers": 4, "blocks": 64, "seed": 1, "holds": {"r1": "<token>"}}'

Its one argument is a PeerJob as JSON; `start(job)` runs it so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Annotated

import msgspec
import torch

from connectors.mooncake.channel import SideChannelServer
from connectors.mooncake.holds import HoldTable
from connectors.mooncake.messages import PROTOCOL_VERSION, LayerDesc, WorkerMeta
from connectors.mooncake.responder import PrefillResponder
from connectors.mooncake.transfer import MooncakeTransfer
from testbed.scripts import script_argv, script_env

BLOCK_SHAPE = (16, 576)  # block size 16 x MLA head 576, the tiny model's page
MODEL_KEY = "DeepseekV2ForCausalLM/peer"
TOKEN = "peer-token-" + "x" * 32
"""A token for holds (a real prefill issues a random one per request)."""
Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class PeerJob(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    """Side-channel (handshake) port."""
    host: str = "127.0.0.1"
    """Where its side channel and transfer engine listen (a test-bed host's address across namespaces)."""
    layers: Count = 4
    blocks: Count = 64
    seed: int = 0
    engine_id: str = "peer"
    tp_rank: Count = 0
    tp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    owned: tuple[int, ...] | None = None
    """Layers to publish as KVPP owner; None: every layer, KVPP off."""
    kv_heads: tuple[int, ...] | None = None
    """The GQA KV heads it publishes it holds; None: an MLA cache."""
    holds: dict[str, str] = {}
    """Request id -> token of each hold taken at start."""
    hold_timeout: Seconds = 60.0
    lease: Seconds | None = None
    """What a renewal grants (default: hold_timeout)."""


def start(job: PeerJob, stderr=None, prefix: Sequence[str] = ()) -> subprocess.Popen:
    """The peer in a process of its own, stdin and stdout piped (it lives until stdin closes), Mooncake's
    log quiet; `prefix` runs it elsewhere (a test-bed host: `Testbed.command(name, [])`)."""
    return subprocess.Popen([*prefix, *script_argv("mooncake_peer", msgspec.json.encode(job).decode())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env=script_env({"MC_LOG_LEVEL": "ERROR"}))


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """End a process started like `start`: close its stdin (it exits), kill it if it has not within `timeout`."""
    proc.stdin.close()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def pages(layers: int, blocks: int, seed: int) -> torch.Tensor:
    """The peer's KV content; a reader regenerates it from the seed to check bytes."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((layers, blocks, *BLOCK_SHAPE), generator=gen, dtype=torch.float32)


def local_meta(kv: torch.Tensor, engine_id: str, tp_rank: int, tp_size: int, te: MooncakeTransfer,
               owned: set[int] | None = None, kv_heads: tuple[int, ...] | None = None) -> WorkerMeta:
    """WorkerMeta of a [layers, blocks, 16, 576] tensor; `owned` publishes only those layers (KVPP), `kv_heads` the
    GQA KV heads it holds (None: an MLA cache)."""
    block_len = kv[0, 0].numel() * kv.element_size()
    layers = [
        LayerDesc(name=layer_name(i), base_addr=kv[i].data_ptr(), num_blocks=kv.shape[1], block_len=block_len,
                  block_stride=kv.stride(1) * kv.element_size(), owner=None if owned is None else tp_rank)
        for i in range(kv.shape[0]) if owned is None or i in owned
    ]
    return WorkerMeta(version=PROTOCOL_VERSION, engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size, pp_rank=0,
                      pp_size=1, te_host=te.host, te_rpc_port=te.rpc_port, model=MODEL_KEY, dtype="float32",
                      block_size=BLOCK_SHAPE[0], kvpp=owned is not None,
                      kv_heads=None if kv_heads is None else list(kv_heads), layers=layers)


def main(job_json: str) -> int:
    job = msgspec.json.decode(job_json, type=PeerJob)
    kv = pages(job.layers, job.blocks, job.seed)
    te = MooncakeTransfer(job.host)
    te.register([(kv.data_ptr(), kv.numel() * kv.element_size())])
    owned = None if job.owned is None else set(job.owned)
    meta = local_meta(kv, job.engine_id, job.tp_rank, job.tp_size, te, owned, job.kv_heads)
    holds = HoldTable(job.hold_timeout, job.lease)
    for request_id, token in job.holds.items():
        holds.hold(request_id, job.hold_timeout, token)
    responder = PrefillResponder(holds)
    responder.meta = meta
    server = SideChannelServer(job.host, job.port, responder, what="mooncake peer",
                               on_refused=lambda code: print(json.dumps({"refused": code}), flush=True))
    print(json.dumps({"ready": True, "port": job.port, "te": te.session}), flush=True)
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
    sys.exit(main(*sys.argv[1:]))
