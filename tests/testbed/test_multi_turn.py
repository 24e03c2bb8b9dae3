"""testbed/multi_turn.py without an engine: each turn sends the previous prompt, its answer and the new user tokens,
the conversations take turns one request at a time, and the prefix-cache counters are the conversations' own."""

from types import SimpleNamespace

import msgspec
import pytest

from testbed.engine import EngineSettings
from testbed.engine_run import Job
from testbed.multi_turn import MultiTurn
from testbed.staggered import Staggered

pytestmark = pytest.mark.unit


class FakeLLM:
    """Answers each request in one step with two tokens (its prompt length, then 7), one request at a time; reports
    a quarter of each prompt cached, and counts hits and queries as vLLM's metrics."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.pending: list[tuple[str, list[int]]] = []
        self.counters = {"vllm:prefix_cache_hits": 100.0, "vllm:prefix_cache_queries": 400.0}  # earlier traffic
        self.llm_engine = SimpleNamespace(add_request=self.add_request, step=self.step,
                                          has_unfinished_requests=lambda: bool(self.pending))

    def add_request(self, request_id, prompt, params):
        assert not self.pending, "one request at a time"
        self.pending.append((request_id, prompt["prompt_token_ids"]))
        return request_id

    def step(self):
        (request_id, ids), = self.pending
        self.pending.clear()
        self.prompts.append(ids)
        self.counters["vllm:prefix_cache_hits"] += len(ids) // 4
        self.counters["vllm:prefix_cache_queries"] += len(ids)
        tokens = [len(ids), 7]
        logprobs = [{t: SimpleNamespace(logprob=-0.5)} for t in tokens]
        return [SimpleNamespace(request_id=request_id, finished=True, num_cached_tokens=len(ids) // 4,
                                outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs)])]

    def get_metrics(self):
        return [SimpleNamespace(name=name, value=value) for name, value in self.counters.items()]


def test_each_turn_sends_the_history_its_answer_and_the_new_user_tokens():
    users = [[[1, 1], [2], [3]], [[4, 4, 4], [5], [6]]]
    llm = FakeLLM()
    result = MultiTurn(users, answer_tokens=2).serve(llm)
    assert llm.prompts == [[1, 1], [4, 4, 4], [1, 1, 2, 7, 2], [4, 4, 4, 3, 7, 5], [1, 1, 2, 7, 2, 5, 7, 3],
                           [4, 4, 4, 3, 7, 5, 6, 7, 6]]
    assert list(result["outputs"]) == ["0/0", "1/0", "0/1", "1/1", "0/2", "1/2"]
    assert result["outputs"]["1/2"] == {"token_ids": [9, 7], "logprobs": [-0.5, -0.5], "cached_tokens": 2,
                                        "prompt_tokens": 9}
    assert result["prefix_cache"] == {"hits": sum(len(p) // 4 for p in llm.prompts),
                                      "queries": sum(map(len, llm.prompts))}


def test_every_conversation_needs_as_many_turns_and_the_job_carries_them():
    with pytest.raises(ValueError, match=r"as many turns, got \[2, 1\]"):
        MultiTurn([[[1], [2]], [[3]]])
    job = Job(EngineSettings(model="/m"), Staggered([[1]], multi_turn=MultiTurn([[[1], [2]]], answer_tokens=3)))
    assert msgspec.json.decode(msgspec.json.encode(job), type=Job) == job
