"""Every library scenario, at CI size, ends as its ``expect`` section says.

The runs drive vLLM's real scheduler on every rank (through the guard
connector); the sizes are the ``--scale`` at which each scenario keeps its
outcome while running in about a second.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest

from vllm_mooncake.tools.sim.__main__ import SCENARIO_LIBRARY
from vllm_mooncake.tools.sim.results import RunResult
from vllm_mooncake.tools.sim.runner import run_scenario
from vllm_mooncake.tools.sim.scenario import Scenario, load_scenario

# Scenario -> the CI --scale (scripted single-rank scenarios are not scaled).
CI_SCALE = {
    "seed_1p2d_256": 0.125,
    "healthy_baseline": 0.125,
    "async_load_heavy": 0.125,
    "w1": 1.0,
    "w2": 1.0,
    "seed_single": 1.0,
    "stress_1p2d_1024_faults": 0.125,
}
# Scenario -> requests at CI size, where the scaled count is too slow (the
# stress run's prefill rank steps every millisecond while decode ranks pull).
CI_REQUESTS = {"stress_1p2d_1024_faults": 160}


@cache
def _scenario(name: str) -> Scenario:
    return load_scenario(SCENARIO_LIBRARY / f"{name}.yaml")


def _ci_sized(name: str) -> Scenario:
    """The scenario with its CI request count, if it has one (before scaling)."""
    scenario = _scenario(name)
    cap = CI_REQUESTS.get(name)
    if cap is None or scenario.workload is None:
        return scenario
    unscaled = round(cap / CI_SCALE[name])
    return replace(scenario, workload=replace(scenario.workload, num_requests=unscaled))


@cache
def _run(name: str, policy: str) -> RunResult:
    return run_scenario(_ci_sized(name).with_policy(policy), scale=CI_SCALE[name])


def test_every_library_scenario_has_a_ci_size() -> None:
    assert {p.stem for p in SCENARIO_LIBRARY.glob("*.yaml")} == set(CI_SCALE)


CASES = [
    (name, policy, outcome)
    for name in CI_SCALE
    for policy, outcome in _scenario(name).expected().items()
]


@pytest.mark.parametrize(
    ("name", "policy", "outcome"), CASES, ids=[f"{n}-{p}" for n, p, _ in CASES]
)
def test_outcome_per_policy(name: str, policy: str, outcome: str) -> None:
    result = _run(name, policy)
    assert result.outcome == outcome, result.stop_reason
    if outcome == "wedged":
        assert result.wedged_ranks
        assert result.finished < result.total
        assert result.lateral_preemptions == 0
    else:
        assert result.finished == result.total
        assert result.failed == 0
        assert not result.wedged_ranks


def test_seed_wedges_a_decode_rank_and_the_valve_opens() -> None:
    stock = _run("seed_1p2d_256", "no-reserve")
    assert stock.wedged_ranks and all(r.startswith("d") for r in stock.wedged_ranks)
    assert stock.max_stall_steps >= _scenario("seed_1p2d_256").limits.wedge_steps
    assert _run("seed_1p2d_256", "lateral").lateral_preemptions >= 1


@pytest.mark.parametrize(
    "policy", ["no-reserve", "reserve", "reserve+lateral", "lateral"]
)
def test_healthy_baseline_never_opens_the_valve(policy: str) -> None:
    result = _run("healthy_baseline", policy)
    assert result.lateral_preemptions == 0
    assert result.lease_expired == 0
    assert result.max_stall_steps < 20
    assert all(not r.guard["wedges_detected"] for r in result.ranks)


@pytest.mark.parametrize("policy", ["reserve+lateral", "lateral"])
def test_stress_with_faults_loses_nothing(policy: str) -> None:
    """Issue #6's stress run at CI size: faults on, every request finishes."""
    result = _run("stress_1p2d_1024_faults", policy)
    assert result.total == CI_REQUESTS["stress_1p2d_1024_faults"]
    assert result.finished == result.total
    assert not result.wedged_ranks
    assert all(not r.guard["ledger_errors"] for r in result.ranks)


def test_results_carry_the_numbers_the_issue_asks_for() -> None:
    data = _run("healthy_baseline", "reserve+lateral").to_dict()
    for key in (
        "finished",
        "total",
        "wedged",
        "max_stall_steps",
        "stalled_seconds",
        "lateral_preemptions",
        "throughput_tok_s",
        "ttft_s",
        "e2e_s",
        "wall_seconds",
    ):
        assert key in data, key
    assert data["throughput_tok_s"] > 0
    assert 0 < data["ttft_s"]["p50"] <= data["ttft_s"]["p99"]
    assert data["ttft_s"]["p50"] <= data["e2e_s"]["p50"]
    assert len(data["timeline"]["t"]) == len(data["timeline"]["throughput_tok_s"])
