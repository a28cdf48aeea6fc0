"""The result of one run, as JSON (schema ``vllm-mooncake-sim/1``).

Top-level fields (all times in simulated seconds unless named ``wall``):

``finished`` / ``failed`` / ``aborted`` / ``total``
    requests that completed (length/stop), that ended in an error (a failed
    load under ``kv_load_failure_policy: fail``), that a scripted
    ``abort_at_s`` / ``abort_at_step`` aborted, and that the workload has; a
    request counted in none of the first three is lost.
``stop_reason``, ``completed``
    ``done`` (every request completed), ``wedged``, ``livelock``,
    ``max_sim_s`` or ``max_steps``; ``completed`` is ``stop_reason == "done"``.
``livelocked``
    ``[{"rank", "request", "loads"}]``: requests that started
    ``limits.livelock_loads`` loads without a token in between (a load that
    keeps failing under ``kv_load_failure_policy: recompute``); the run stops
    there with ``stop_reason`` and ``outcome`` ``livelock``.
``wedged``, ``wedged_ranks``
    a rank stalled ``limits.wedge_steps`` steps with nothing in flight that
    could end the stall (the run stops there).
``max_stall_steps``, ``stalled_seconds``
    longest run of blocked steps on one rank; blocked seconds summed over
    ranks (see :mod:`.stalls` for "blocked").
``lateral_preemptions``, ``preemptions``, ``lease_expired``
    the guard's lateral preemptions; all preemptions vLLM reported (running
    and lateral); P->D leases that ran out before the decode rank pulled.
``laterals``
    every lateral preemption, in simulated-time order: ``rank``, ``step``
    (that rank's step index), ``t_s`` (the step's start), ``victim``,
    ``target`` (the request being admitted), ``reason`` (``recv_done`` /
    ``promoted_idle``) and ``owner`` (the child that loaded the victim).
    Entries sharing rank and step came from one ``schedule()`` call.
``attempts_exhausted``
    ``schedule()`` calls in which the valve wanted another lateral
    preemption past ``guard.max_attempts`` (summed over ranks): a wedge the
    valve needed more than one step to clear.
``leaks``
    after the run every rank is drained (what is left aborted, held blocks
    released, stepped idle) and checked: vLLM's scheduler must hold no
    request, queue entry, reservation or block, the guard's ledger no entry
    and the worker no receive. ``[]`` when clean, else one line per finding
    (``"d0: requests not empty: [...]"``).
``output_tokens``, ``sim_seconds``, ``throughput_tok_s``
    tokens sampled by decode (or single) ranks, the simulated makespan, and
    their ratio.
``ttft_s``, ``e2e_s``
    ``{"p50", "p99", "mean"}`` over completed requests: first token on the
    decode rank, and completion, from the request's arrival at the router.
``ranks``, ``timeline``, ``stalls``
    per-rank detail (steps, busy time, stalls, guard counters); the binned
    throughput and free-block series the plot draws; stall intervals.
``wall_seconds``
    the only field that depends on the machine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "vllm-mooncake-sim/1"
# Fields that differ between two runs of the same scenario and seed.
WALL_FIELDS = ("wall_seconds",)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p99 (linear interpolation, as numpy's default) and the mean."""
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    ordered = sorted(values)
    return {
        "p50": _round(_quantile(ordered, 0.50)),
        "p99": _round(_quantile(ordered, 0.99)),
        "mean": _round(sum(ordered) / len(ordered)),
    }


def _quantile(ordered: Sequence[float], q: float) -> float:
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _round(x: float) -> float:
    return round(x, 6)


@dataclass
class RankResult:
    name: str
    role: str
    steps: int
    busy_s: float
    blocked_steps: int
    max_stall_steps: int
    stalled_seconds: float
    wedged: bool
    min_free_blocks: int
    usable_blocks: int
    guard: dict[str, Any]


@dataclass
class RunResult:
    scenario: str
    source: str
    mode: str
    shape: str
    policy: str
    seed: int
    scale: float
    stop_reason: str
    finished: int
    failed: int
    total: int
    wedged: bool
    wedged_ranks: list[str]
    max_stall_steps: int
    stalled_seconds: float
    lateral_preemptions: int
    preemptions: int
    lease_expired: int
    output_tokens: int
    sim_seconds: float
    throughput_tok_s: float
    ttft_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    steps: int
    ranks: list[RankResult] = field(default_factory=list)
    timeline: dict[str, Any] = field(default_factory=dict)
    stalls: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0
    livelocked: list[dict[str, Any]] = field(default_factory=list)
    aborted: int = 0
    attempts_exhausted: int = 0
    laterals: list[dict[str, Any]] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    schema: str = SCHEMA

    @property
    def completed(self) -> bool:
        return self.stop_reason == "done"

    @property
    def outcome(self) -> str:
        """``wedged``, ``finished`` (every request completed) or the stop reason."""
        if self.wedged:
            return "wedged"
        if self.completed:
            return "finished"
        return self.stop_reason

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["completed"] = self.completed
        out["outcome"] = self.outcome
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        data = {k: v for k, v in data.items() if k not in ("completed", "outcome")}
        ranks = [RankResult(**r) for r in data.pop("ranks", [])]
        return cls(ranks=ranks, **data)

    @classmethod
    def read(cls, path: str | Path) -> RunResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


def without_wall(data: dict[str, Any]) -> dict[str, Any]:
    """The result minus what depends on the machine (for determinism checks)."""
    return {k: v for k, v in data.items() if k not in WALL_FIELDS}
