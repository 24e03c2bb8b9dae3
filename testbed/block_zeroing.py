"""The worker extension (vLLM's `worker_extension_cls`) of the negative controls: every worker of an engine
imports it, so it imports nothing itself."""


class BlockZeroing:
    """Methods that `collective_rpc` calls by name, so no code object crosses vLLM's IPC; they act only when
    called."""

    def zero_blocks_from(self, first: int) -> None:
        """Zero blocks `first`.. of every KV cache this worker bound."""
        for cache in self.model_runner.kv_caches:
            cache[first:].zero_()

    def zero_blocks(self, ids: list[int]) -> None:
        """Zero blocks `ids` of every KV cache this worker bound."""
        for cache in self.model_runner.kv_caches:
            cache[ids] = 0


BLOCK_ZEROING = f"{BlockZeroing.__module__}.{BlockZeroing.__qualname__}"
"""Its qualified name, as `worker_extension_cls` and `--worker-extension-cls` take it."""
