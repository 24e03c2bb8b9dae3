"""vllm-ascend: whether it is installed and implements KVPP itself, and so which KVPP serves a launch.

On Ascend, vllm-ascend's `NPUWorker` (a `WorkerBase`, not vLLM's GPU `Worker`) allocates the KV caches,
so this project's adapter, which patches vLLM's `Worker` and `CPUWorker`, never runs there. vllm-ascend
documents its own KVPP behind the same key (`--additional-config '{"enable_kvpp": true}'`) with its own
`MooncakeConnectorV2` and `AscendStoreConnector`. So where vllm-ascend is installed this project patches
nothing and registers no connector name (vllm-ascend registers its own, and vLLM refuses a name
registered twice): a vllm-ascend that reads `enable_kvpp` serves KVPP natively, and the launch is
validated against its support matrix (`kvpp_core.validation`, platform "ascend"); one that does not
would accept the key and run without KVPP, so the launch check refuses it (`refusal`).

"Reads enable_kvpp" is decided from the installed package's source, not a version number: the source
read for this project (vllm-ascend main and its open pull requests, 2026-08-22) holds no KVPP worker
and no `enable_kvpp` (MooncakeConnectorV2 only in an open pull request), so no release to pin exists yet.
Detection never imports vllm_ascend (it needs CANN and torch-npu) and reads its files once per process.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvpp_core.config import ENABLE_KEY
from kvpp_core.platforms import ASCEND

PACKAGE = "vllm_ascend"
DISTRIBUTION = "vllm-ascend"
OURS = "kvpp-connectors (this project's vLLM adapter)"
NATIVE = "vllm-ascend (native)"


@dataclass(frozen=True)
class VllmAscend:
    """The installed vllm-ascend."""

    version: str
    location: str
    native_kvpp: bool
    """Its source reads `enable_kvpp`: it implements KVPP itself."""


def _reads_enable_kvpp(root: Path) -> bool:
    marker = f'"{ENABLE_KEY}"'.encode()
    return any(marker in path.read_bytes() for path in sorted(root.rglob("*.py")))


@functools.cache
def installed() -> VllmAscend | None:
    """The vllm-ascend this interpreter would import, or None (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "of unknown version"
    return VllmAscend(version, str(root), _reads_enable_kvpp(root))


def implementation() -> str:
    """Which KVPP serves `enable_kvpp` in this process (logged by the plugin and the launch check)."""
    found = installed()
    if found is None:
        return OURS
    return f"{NATIVE} {found.version}" if found.native_kvpp else f"none: vllm-ascend {found.version} has no KVPP"


def platform() -> str | None:
    """"ascend" where vllm-ascend is installed (the validation rules then follow its support matrix)."""
    return ASCEND.name if installed() is not None else None


def refusal() -> str | None:
    """Why `enable_kvpp` cannot run here, or None: a vllm-ascend without KVPP would accept the key and
    serve the replicated cache."""
    found = installed()
    if found is None or found.native_kvpp:
        return None
    return (f"vllm-ascend {found.version} ({found.location}) does not implement KVPP (its source never reads "
            f'"{ENABLE_KEY}"), and this project\'s KVPP adapter patches only vLLM\'s GPU Worker and CPUWorker, '
            "which vllm-ascend's NPUWorker is not: the engine would run without KVPP. Install a vllm-ascend that "
            f'ships KVPP, or remove "{ENABLE_KEY}" from --additional-config')
