"""vLLM's engine core loop over a real scheduler, its model runner played by a clock: what the simulator's engine
(deploy/simulation/engine.py) is compared with.

`CoreLoop.call` is vLLM's own `EngineCore.step` (synchronous scheduling) or `EngineCore.step_with_batch_queue` (a
batch queue two deep, with the `AsyncScheduler`: vLLM's default on GPUs), run on a stand-in for the engine core
that carries what those methods read. The executor runs the batches one after the other, each for a second if it
computes tokens and for no time if it is empty, and makes a batch's output when the core waits for it: a token
for every request whose scheduled tokens reached its end (as the schedule decided: not a prefill chunk), the next
of its planned answer, and the P/D reads that ended by then (`KVConnectorOutput.finished_sending`).

Time runs only while the core waits for a batch, or, when nothing could be scheduled and nothing runs (vLLM then
spins on empty steps, which change nothing), until the next request arrives or the next read ends. Before it
moves, the loop records a snapshot of the scheduler's state: the simulator must hold the same at that moment.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Batch:
    """A scheduled batch as the executor runs it; a future of its output."""

    loop: CoreLoop
    scheduler_output: object
    end: float
    samples: set[str]

    def result(self):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.loop.wait_until(self.end)
        sched = self.loop.scheduler
        req_ids = list(self.scheduler_output.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = sched.requests.get(rid)
            if rid in self.samples and request is not None:
                answer = self.loop.answers[rid]
                sampled.append([answer[min(request.num_output_tokens, len(answer) - 1)]])
            else:
                sampled.append([])
        sending = self.loop.reads_ended()
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled,
                                 kv_connector_output=KVConnectorOutput(finished_sending=sending or None))


class Executor:
    """vLLM's executor as the engine core calls it (non-blocking)."""

    def __init__(self, loop: CoreLoop):
        self.loop = loop
        self.run_free = 0.0
        self.last: Batch | None = None

    def execute_model(self, scheduler_output, non_block: bool = False):
        sched = self.loop.scheduler
        end = max(self.loop.now, self.run_free) + (1.0 if scheduler_output.total_num_scheduled_tokens else 0.0)
        self.run_free = end
        samples = {rid for rid in scheduler_output.num_scheduled_tokens if not sched.requests[rid].is_prefill_chunk}
        self.loop.scheduled.append(scheduler_output)
        queue = self.loop.batch_queue or ()
        self.loop.spun = not (scheduler_output.total_num_scheduled_tokens or scheduler_output.preempted_req_ids
                              or any(so.total_num_scheduled_tokens for _, so, _ in queue))
        self.last = Batch(self.loop, scheduler_output, end, samples)
        return self.last

    def sample_tokens(self, grammar_output, non_block: bool = False):
        return self.last if non_block else self.last.result()

    def take_draft_token_ids(self):
        return None


@dataclass
class CoreLoop:
    """The stand-in engine core: `scheduler` driven by vLLM's loop, `answers` the tokens each request samples,
    `pull(request id, finished at)` when a finished P/D prefill's read ends (None: no reads)."""

    scheduler: object
    asynchronous: bool
    answers: dict[str, list[int]]
    pull: Callable[[str, float], float] | None = None
    now: float = 0.0
    scheduled: list = field(default_factory=list)
    """Every SchedulerOutput, in order."""
    snapshots: list[tuple[float, dict]] = field(default_factory=list)
    snapshot: Callable[[], dict] | None = None
    finished_at: dict[str, float] = field(default_factory=dict)
    spun: bool = False
    """The last batch scheduled nothing and preempted nothing while nothing ran: vLLM spins on such batches, which
    change nothing, until a request arrives or a read ends."""
    reads: dict[str, float] = field(default_factory=dict)
    """A finished P/D prefill -> when its decode's read ends (until it is reported)."""

    def __post_init__(self):
        from vllm.v1.engine.core import EngineCore

        self.batch_queue_size = 2 if self.asynchronous else 1
        self.batch_queue = deque(maxlen=2) if self.asynchronous else None
        self._step = EngineCore.step_with_batch_queue if self.asynchronous else EngineCore.step
        self.model_executor = Executor(self)
        self.is_mm_encoder_only = self.is_pooling_model = self.check_for_draft_tokens = False

    # what EngineCore's step methods call on the core
    def _should_throttle_prefills(self) -> bool:
        return False

    def log_error_detail(self, scheduler_output):
        return contextlib.nullcontext()

    def capture_iteration_details(self, scheduler_output):
        return contextlib.nullcontext()

    def _process_aborts_queue(self) -> None:
        pass

    def _attach_iteration_details(self, outputs, details) -> None:
        pass

    def _attach_weight_version(self, outputs) -> None:
        pass

    # the clock
    def wait_until(self, t: float) -> None:
        if t > self.now:
            if self.snapshot is not None:
                self.snapshots.append((self.now, self.snapshot()))
            self.now = t

    def reads_ended(self) -> set[str]:
        ended = {rid for rid, t in self.reads.items() if t <= self.now}
        for rid in ended:
            del self.reads[rid]
        return ended

    def call(self) -> None:
        """One turn of the engine core's busy loop; finished requests' reads (P/D) start."""
        outputs, _ = self._step(self)
        for client in (outputs or {}).values():
            for out in client.outputs:
                if out.finish_reason is not None:
                    self.finished_at[out.request_id] = self.now
                    if self.pull is not None:
                        self.reads[out.request_id] = self.pull(out.request_id, self.now)

    def run(self, arrivals: dict[float, list], add: Callable[[object], None]) -> None:
        """Serve `arrivals` (a time -> the requests arriving then, each given to `add`) until every request is done."""
        times = sorted(arrivals)
        i = 0
        while True:
            while i < len(times) and times[i] <= self.now:
                for request in arrivals[times[i]]:
                    add(request)
                i += 1
            busy = self.scheduler.has_requests() or bool(self.batch_queue)
            if busy and not (self.spun and self.scheduler.has_requests()):
                self.call()
                continue
            arrival = times[i] if i < len(times) else math.inf
            read = min(self.reads.values(), default=math.inf)
            if read < arrival:  # the spinning core reports the read with its next (empty) batch
                self.wait_until(read)
                self.call()
                self.spun = False
                continue
            if arrival == math.inf:
                if self.scheduler.has_requests():
                    raise AssertionError(f"vLLM's engine waits at {self.now} for blocks nothing will free")
                if self.snapshot is not None:
                    self.snapshots.append((self.now, self.snapshot()))
                return
            self.wait_until(arrival)
            self.spun = False
