"""Requests of a run: drawn from a generated workload or taken from a scripted list.

Every request is fixed before the run starts (lengths, priority, route, its
store hit and the latency and outcome of each load), from ``random.Random``
streams seeded by the scenario seed and the request index -- so a policy
change never changes the workload, and growing ``num_requests`` only appends.
Only *when* a closed-loop request is sent depends on the run: its client
sends it ``think_s`` after the client's previous request completed.

In pd mode a request is either disaggregated (prefill rank computes the
prompt, possibly after a store hit; the decode rank receives the KV through
``transfer``) or direct (a decode rank computes it, possibly after a store
hit). In single mode, ``local_load`` is whatever async load the one rank
performs: a store hit, or a full-prompt P->D receive.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from vllm_mooncake.testing.configs import PD_KEY, STORE_KEY
from vllm_mooncake.tools.sim.scenario import (
    EngineSpec,
    LoadSpec,
    RequestEntry,
    Scenario,
    TransferSpec,
    WorkloadSpec,
)

CHILD_KEYS = {"store": STORE_KEY, "pd": PD_KEY}


@dataclass(frozen=True)
class Load:
    """One async load, as the scripted child's ``kv_transfer_params`` entry."""

    key: str  # STORE_KEY or PD_KEY: which child loads it
    tokens: int = -1  # -1: the whole prompt
    done_after_steps: int | None = None
    done_after_s: float | None = None
    outcome: str = "ok"
    valid_tokens: int = 0
    failing_attempts: int = -1

    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens": self.tokens,
            "outcome": self.outcome,
            "valid_tokens": self.valid_tokens,
            "failing_attempts": self.failing_attempts,
            # A store keeps its copy: a preempted request is offered it again.
            "reoffer": self.key == STORE_KEY,
        }
        if self.done_after_s is not None:
            out["done_after_s"] = self.done_after_s
        else:
            out["done_after"] = self.done_after_steps or 0
        return out


@dataclass(frozen=True)
class SimRequest:
    req_id: str
    index: int
    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    # Scripted or Poisson arrival time; None for closed-loop requests (sent
    # when a client is free) and for step arrivals.
    arrival_s: float | None = None
    arrival_step: int | None = None  # single mode: before this rank step
    local_load: Load | None = None  # on the rank that computes the prompt
    transfer: Load | None = None  # pd mode: the decode rank's P->D receive
    think_s: float = 0.0  # closed loop: the client's pause before sending it
    # Scripted aborts: at this simulated time / (single mode) before this step.
    abort_at_s: float | None = None
    abort_at_step: int | None = None

    @property
    def disaggregated(self) -> bool:
        return self.transfer is not None


@dataclass(frozen=True)
class Workload:
    requests: tuple[SimRequest, ...]
    # Closed loop: clients, each with one request outstanding; 0 otherwise.
    concurrency: int = 0

    @property
    def closed_loop(self) -> bool:
        return self.concurrency > 0


def build_workload(scenario: Scenario) -> Workload:
    if scenario.workload is not None:
        return _generate(scenario, scenario.workload)
    requests = tuple(
        _scripted(scenario, entry, i) for i, entry in enumerate(scenario.requests)
    )
    return Workload(requests)


# ---- generated ------------------------------------------------------------------
def _generate(s: Scenario, w: WorkloadSpec) -> Workload:
    arrivals = random.Random(f"{s.seed}/arrivals")
    t = 0.0
    requests = []
    for i in range(w.num_requests):
        rng = random.Random(f"{s.seed}/request/{i}")
        request = _draw(s, w, i, rng)
        if w.arrival == "poisson":
            t += arrivals.expovariate(w.rate_per_s)
            request = _with_arrival(request, t)
        requests.append(request)
    concurrency = w.concurrency if w.arrival == "closed" else 0
    return Workload(tuple(requests), concurrency)


def _with_arrival(request: SimRequest, t: float) -> SimRequest:
    from dataclasses import replace

    return replace(request, arrival_s=round(t, 9))


def _draw(s: Scenario, w: WorkloadSpec, i: int, rng: random.Random) -> SimRequest:
    prompt = w.prompt_tokens.sample_int(rng)
    output = w.output_tokens.sample_int(rng)
    priority = w.priority.sample_int(rng)
    think = w.think_time_s.sample(rng) if w.arrival == "closed" else 0.0
    disaggregated = rng.random() < w.pd_fraction
    transfer = _timed_load(rng, PD_KEY, -1, prompt, s.pd.transfer, retry=False)
    store_hit = _store_hit(rng, s, w, prompt, _computing_engine(s, disaggregated))
    if s.mode == "single":
        local, transfer_ = (transfer if disaggregated else store_hit), None
    else:
        local, transfer_ = store_hit, (transfer if disaggregated else None)
    return SimRequest(
        req_id=f"r{i}",
        index=i,
        prompt_tokens=prompt,
        max_tokens=output,
        priority=priority,
        arrival_s=0.0 if w.arrival == "closed" else None,
        local_load=local,
        transfer=transfer_,
        think_s=think,
    )


def _computing_engine(s: Scenario, disaggregated: bool) -> EngineSpec:
    if s.mode == "single":
        return s.engine
    return s.prefill_engine if disaggregated else s.decode_engine


def _store_hit(
    rng: random.Random, s: Scenario, w: WorkloadSpec, prompt: int, engine: EngineSpec
) -> Load | None:
    """A block-aligned prefix hit in the store, or None (drawn either way)."""
    hit = rng.random() < w.store.hit_ratio
    fraction = w.store.hit_fraction.sample(rng)
    block = engine.block_size
    tokens = int(prompt * fraction) // block * block
    load = _timed_load(rng, STORE_KEY, tokens, tokens, w.store.load, retry=True)
    return load if hit and tokens > 0 else None


def _timed_load(
    rng: random.Random,
    key: str,
    tokens: int,
    size: int,
    spec: TransferSpec,
    retry: bool,
) -> Load:
    """Latency and outcome drawn from ``spec`` (always the same draws)."""
    latency = spec.latency_s.sample(rng) + spec.per_token_s * size
    u = rng.random()
    valid = rng.randrange(0, max(1, size))
    if u < spec.fail_rate:
        outcome = "fail"
    elif u < spec.fail_rate + spec.partial_rate:
        outcome = "partial"
    else:
        outcome = "ok"
    return Load(
        key=key,
        tokens=tokens,
        done_after_s=round(latency, 9),
        outcome=outcome,
        valid_tokens=valid if outcome == "partial" else 0,
        # A store hit fails once (a transient miss); a P->D transfer once is all.
        failing_attempts=1 if retry else -1,
    )


# ---- scripted -------------------------------------------------------------------
def _scripted(s: Scenario, entry: RequestEntry, i: int) -> SimRequest:
    local = _scripted_load(entry.load) if entry.load else None
    transfer = None
    if s.mode == "pd" and entry.route == "pd":
        transfer = _scripted_transfer(s, entry, i)
    return SimRequest(
        req_id=entry.id,
        index=i,
        prompt_tokens=entry.prompt_tokens,
        max_tokens=entry.max_tokens,
        priority=entry.priority,
        arrival_s=entry.arrival_s,
        arrival_step=entry.arrival_step,
        local_load=local,
        transfer=transfer,
        abort_at_s=entry.abort_at_s,
        abort_at_step=entry.abort_at_step,
    )


def _scripted_load(spec: LoadSpec) -> Load:
    return Load(
        key=CHILD_KEYS[spec.child],
        tokens=spec.tokens,
        done_after_steps=spec.done_after_steps,
        done_after_s=spec.done_after_s,
        outcome=spec.outcome,
        valid_tokens=spec.valid_tokens,
        failing_attempts=spec.failing_attempts,
    )


def _scripted_transfer(s: Scenario, entry: RequestEntry, i: int) -> Load:
    drawn = _timed_load(
        random.Random(f"{s.seed}/request/{i}"),
        PD_KEY,
        -1,
        entry.prompt_tokens,
        s.pd.transfer,
        retry=False,
    )
    override = entry.transfer
    if override is None:
        return drawn
    return Load(
        key=PD_KEY,
        tokens=-1,
        done_after_s=(
            override.done_after_s
            if override.done_after_s is not None
            else drawn.done_after_s
        ),
        outcome=override.outcome,
        valid_tokens=override.valid_tokens,
    )
