"""Fake Mooncake prefill workers (testbed/mooncake_peer.py) in their own processes, and a decode's puller."""

from __future__ import annotations

import json
import os
import subprocess
import time

import torch

from connectors.mooncake.messages import PrefillHandle
from connectors.mooncake.puller import Puller
from connectors.mooncake.transfer import MooncakeTransfer
from testbed.mooncake_peer import BLOCK_SHAPE, TOKEN, PeerJob, local_meta, start


class Peer:
    def __init__(self, job: PeerJob) -> None:
        self.proc = start(job, stderr=subprocess.DEVNULL)
        self.port = job.port
        ready = self.line(timeout=60)
        assert ready.get("ready"), ready

    def line(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        os.set_blocking(self.proc.stdout.fileno(), False)
        buf = ""
        while time.monotonic() < deadline:
            chunk = self.proc.stdout.readline()
            if chunk:
                buf += chunk
                if buf.endswith("\n"):
                    return json.loads(buf)
            elif self.proc.poll() is not None:
                raise RuntimeError(f"peer exited with {self.proc.returncode}")
            else:
                time.sleep(0.02)
        raise TimeoutError(f"peer printed nothing within {timeout}s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def make_puller(te: MooncakeTransfer, layers: int, blocks: int, timeout: float = 3.0, tp_rank: int = 0,
                tp_size: int = 1, kv_heads: tuple[int, ...] | None = None):
    """A decode worker's cache (zeros) and puller; `kv_heads`: the GQA KV heads it holds (None: MLA)."""
    kv = torch.zeros((layers, blocks, *BLOCK_SHAPE))
    te.register([(kv.data_ptr(), kv.numel() * kv.element_size())])
    return kv, Puller(te, local_meta(kv, "decode", tp_rank, tp_size, te, kv_heads=kv_heads), timeout_s=timeout,
                      consumer_id=f"decode/pp0/tp{tp_rank}", num_consumers=tp_size)


def handle(port: int, request_id: str, blocks: list[int], tp: int = 1, engine: str = "peer", token: str = TOKEN,
           **extra) -> PrefillHandle:
    return PrefillHandle(remote_engine_id=engine, remote_request_id=request_id, remote_token=token, remote_host="127.0.0.1",
                         remote_kv_port=port, remote_tp_size=tp, remote_block_ids=blocks,
                         remote_num_tokens=16 * len(blocks), **extra)
