"""A stand-in vllm-ascend on sys.path (a package directory and its dist-info, nothing importable from
it): vllm-ascend cannot be installed here (it needs CANN), so kvpp_core.ascend's detection is tested
against files shaped like the installed package's, with or without its `enable_kvpp` reader."""

from __future__ import annotations

from pathlib import Path

VERSION = "0.99.0"
NATIVE_SOURCE = 'self.enable_kvpp = additional_config.get("enable_kvpp", False)\n'


def write_fake_vllm_ascend(root: Path, native: bool) -> Path:
    """`root` holding vllm_ascend/ (its config reader reading enable_kvpp when `native`) and its
    dist-info; put `root` on sys.path (or PYTHONPATH) to make it the installed vllm-ascend."""
    package = root / "vllm_ascend"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("the stand-in vllm_ascend is never imported")\n')
    (package / "ascend_config.py").write_text(
        "class AscendConfig:\n    def __init__(self, additional_config):\n        "
        + (NATIVE_SOURCE if native else 'self.enable_kv_nz = additional_config.get("enable_kv_nz", False)\n'))
    info = root / f"vllm_ascend-{VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {VERSION}\n")
    return root
