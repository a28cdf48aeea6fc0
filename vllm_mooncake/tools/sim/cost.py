"""The forward-pass cost model: how long one engine step takes, in simulated seconds.

::

    step_s = fixed_s + per_token_s * tokens + per_seq_s * seqs     (tokens > 0)
    step_s = idle_tick_s                                            (tokens == 0)

``tokens`` is the step's ``total_num_scheduled_tokens`` (prefill chunks and
decodes alike), ``seqs`` the number of requests scheduled. The defaults
(4 ms + 20 us/token + 50 us/seq) make a 2048-token prefill chunk about 45 ms
and a 128-sequence decode step about 13 ms -- the shape of a mid-size model on
one accelerator, not a measurement of one. Wall-clock time never enters the
simulation.

A step that schedules nothing costs ``idle_tick_s``: the engine loop polls
again. A rank whose only work is a transfer in flight sleeps until the
transfer lands instead of ticking (:meth:`vllm_mooncake.tools.sim.rank.Rank.step`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mooncake.tools.sim.scenario import CostSpec


@dataclass(frozen=True)
class CostModel:
    fixed_s: float
    per_token_s: float
    per_seq_s: float
    idle_tick_s: float

    @classmethod
    def from_spec(cls, spec: CostSpec) -> CostModel:
        return cls(spec.fixed_s, spec.per_token_s, spec.per_seq_s, spec.idle_tick_s)

    def step_seconds(self, tokens: int, seqs: int) -> float:
        if tokens <= 0:
            return self.idle_tick_s
        return self.fixed_s + self.per_token_s * tokens + self.per_seq_s * seqs
