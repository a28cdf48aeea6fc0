"""Run one scenario under one policy: workload, cluster, result."""

from __future__ import annotations

from vllm_mooncake.tools.sim.cluster import Cluster, ProgressFn, WedgeFn
from vllm_mooncake.tools.sim.results import RunResult
from vllm_mooncake.tools.sim.scenario import Scenario
from vllm_mooncake.tools.sim.workload import build_workload


def shape_of(scenario: Scenario) -> str:
    if scenario.mode == "single":
        return "single"
    return f"{scenario.ranks.prefill}P{scenario.ranks.decode}D"


def run_scenario(
    scenario: Scenario, scale: float = 1.0, progress: ProgressFn | None = None
) -> RunResult:
    """Simulate ``scenario`` (already overridden: policy, seed) at ``scale``."""
    result, _ = simulate(scenario, scale, progress)
    return result


def simulate(
    scenario: Scenario,
    scale: float = 1.0,
    progress: ProgressFn | None = None,
    on_wedge: WedgeFn | None = None,
) -> tuple[RunResult, Cluster]:
    """:func:`run_scenario`, also returning the cluster (its ranks' schedulers)
    for inspection after the run; ``on_wedge`` as :class:`Cluster` takes it."""
    from vllm_mooncake.plugin import register

    register()  # what vLLM does at start-up: the guard connector by name
    scenario = scenario.scaled(scale)
    cluster = Cluster(scenario, build_workload(scenario), progress, on_wedge)
    header: dict[str, object] = {
        "scenario": scenario.name,
        "source": scenario.source,
        "mode": scenario.mode,
        "shape": shape_of(scenario),
        "policy": scenario.policy,
        "seed": scenario.seed,
        "scale": scale,
    }
    return cluster.run(header), cluster
