"""One side of a raw Mooncake transfer between two hosts of the test bed (tests/deploy/harness/test_testbed.py).

    te_host.py serve HOST MIB SEED   registers MIB MiB of seeded bytes, prints {"session", "addr", "nbytes"},
                                     serves until stdin closes
    te_host.py read HOST SESSION ADDR NBYTES SEED [STALL_S]
                                     reads them (given up after STALL_S, default 5, without
                                     progress), prints {"ok", "intact", "seconds", "bytes"}
"""

from __future__ import annotations

import json
import sys
import time

import torch

from connectors.mooncake.stall import LinkRate, PrefillProgress, StallWatch
from connectors.mooncake.transfer import Desc, MooncakeTransfer, TransferError


def seeded(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def main(argv: list[str]) -> int:
    mode, host = argv[0], argv[1]
    if mode == "serve":
        data = seeded(int(argv[2]) << 20, int(argv[3]))
        te = MooncakeTransfer(host)
        te.register([(data.data_ptr(), data.numel())])
        print(json.dumps({"session": te.session, "addr": data.data_ptr(), "nbytes": data.numel()}), flush=True)
        sys.stdin.read()
        te.close()
        return 0
    session, addr, nbytes, seed = argv[2], int(argv[3]), int(argv[4]), int(argv[5])
    stall_s = float(argv[6]) if len(argv) > 6 else 5.0
    te = MooncakeTransfer(host, progress_timeout_s=stall_s)
    local = torch.zeros(nbytes, dtype=torch.uint8)
    te.register([(local.data_ptr(), nbytes)])
    start = time.perf_counter()
    try:
        te.read(session, [Desc(local.data_ptr(), addr, nbytes)],
                StallWatch(stall_s, LinkRate(), PrefillProgress(), since=time.monotonic()))
        ok, error = True, None
    except TransferError as exc:
        ok, error = False, str(exc)
    seconds = time.perf_counter() - start
    intact = ok and bool(torch.equal(local, seeded(nbytes, seed)))
    print(json.dumps({"ok": ok, "intact": intact, "seconds": seconds, "bytes": nbytes, "error": error}), flush=True)
    te.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
