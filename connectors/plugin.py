"""vLLM general-plugin entry point (`vllm.general_plugins: kvpp`).

Stub until the runtime lands: vLLM imports and calls this in every process, so it must stay cheap
and must not fail.
"""


def register() -> None:
    """Hook KVPP into vLLM; does nothing yet."""
