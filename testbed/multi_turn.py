"""Multi-turn conversations on one offline engine: the workload KVPP's capacity pays off on, where a turn finds its
conversation's history in vLLM's prefix cache only if the cache kept it since the conversation's previous turn.

Turn t of a conversation is its previous prompt, the answer to it and the turn's new user tokens (turn 0: the start
alone), as bench/multiturn.py's clients send them. The conversations take turns, one request at a time (conversation
0's turn t, then conversation 1's, ...), so a conversation's history waits in the cache while every other one is
served: a cache that cannot hold every history evicts the least recently used, which is the one asked for next.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from testbed.engine import Stepper, greedy, llm_metric, tokens_and_logprobs

Tokens = Annotated[int, msgspec.Meta(ge=1)]


class MultiTurn(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    users: list[list[list[int]]]
    """Per conversation, per turn, the new user tokens (turn 0: the start); every conversation has as many turns."""
    answer_tokens: Tokens = 8

    def __post_init__(self) -> None:
        if len({len(turns) for turns in self.users}) > 1:
            raise ValueError(f"users: every conversation needs as many turns, got {[len(t) for t in self.users]}")

    def serve(self, llm) -> dict:
        """{"outputs": {"c/t": {"token_ids", "logprobs", "cached_tokens", "prompt_tokens"}}, "prefix_cache": {"hits",
        "queries"} (vLLM's own counters over the conversations)}."""
        before = {name: llm_metric(llm, f"vllm:prefix_cache_{name}") for name in ("hits", "queries")}
        prompts: list[list[int]] = [[] for _ in self.users]
        outputs = {}
        for turn in range(len(self.users[0]) if self.users else 0):
            for c, turns in enumerate(self.users):
                prompts[c] = prompts[c] + turns[turn]
                stepper = Stepper(llm)
                stepper.add(f"{c}/{turn}", prompts[c], greedy(self.answer_tokens))
                (out,) = stepper.finish().values()
                token_ids, logprobs = tokens_and_logprobs(out)
                outputs[f"{c}/{turn}"] = {"token_ids": token_ids, "logprobs": logprobs,
                                          "cached_tokens": out.num_cached_tokens, "prompt_tokens": len(prompts[c])}
                prompts[c] = prompts[c] + token_ids
        return {"outputs": outputs,
                "prefix_cache": {name: llm_metric(llm, f"vllm:prefix_cache_{name}") - value
                                 for name, value in before.items()}}
