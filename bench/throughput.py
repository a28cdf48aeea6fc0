"""Throughput of each guard policy over upstream ``reserve``, and simulator speed.

Scenarios (default): ``async_load_heavy`` (the throughput workload: 90% store
hits, tight decode pools), ``healthy_baseline`` and ``seed_1p2d_256`` (the
seed's 256-client burst, where reservation and no reservation differ most).
Runs each scenario under each policy for each seed on the simulator (vLLM
0.32's real scheduler per rank) and prints, per run, output tokens per
simulated second and its ratio to ``reserve`` on the same scenario and seed;
then the geometric mean, minimum and maximum of each ratio over the seeds;
then the simulator's speed (scheduler steps per CPU second and per wall
second, summed over ranks).

Throughput is simulated: a run is deterministic for its seed, so the ratios
carry no machine noise. Only the speed figures depend on the machine; each
run's CPU time is its own process's, so a shared machine slows the wall
clock more than the CPU figure. ::

    python bench/throughput.py                          # 5 seeds, full size
    python bench/throughput.py --quick                  # 1 seed, scale 0.25
    python bench/throughput.py --seeds 0-9 --jobs 2 --scenarios async_load_heavy
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

from _util import geomean, machine, setup, table

BASELINE = "reserve"
DEFAULT_POLICIES = ("reserve", "reserve+lateral", "lateral")
DEFAULT_SCENARIOS = ("async_load_heavy", "healthy_baseline", "seed_1p2d_256")


@dataclass(frozen=True)
class Job:
    scenario: str
    seed: int
    policy: str
    scale: float


@dataclass(frozen=True)
class Run:
    job: Job
    outcome: str
    finished: int
    total: int
    tok_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    e2e_p99: float | None
    lateral: int
    preemptions: int
    steps: int
    cpu_s: float
    wall_s: float


def run_job(job: Job) -> Run:
    """One simulation; CPU and wall time measured around it."""
    setup()
    from vllm_mooncake.tools.sim.__main__ import resolve_scenario
    from vllm_mooncake.tools.sim.runner import run_scenario
    from vllm_mooncake.tools.sim.scenario import load_scenario

    scenario = load_scenario(resolve_scenario(job.scenario))
    scenario = scenario.with_seed(job.seed).with_policy(job.policy)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    r = run_scenario(scenario, job.scale)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return Run(
        job=job,
        outcome=r.outcome,
        finished=r.finished,
        total=r.total,
        tok_s=r.throughput_tok_s,
        ttft_p50=r.ttft_s["p50"],
        ttft_p99=r.ttft_s["p99"],
        e2e_p99=r.e2e_s["p99"],
        lateral=r.lateral_preemptions,
        preemptions=r.preemptions,
        steps=r.steps,
        cpu_s=cpu,
        wall_s=wall,
    )


def run_all(jobs: Sequence[Job], workers: int) -> list[Run]:
    """Every job, in order; in ``workers`` spawned processes if > 1."""
    if workers <= 1:
        return [run_job(j) for j in jobs]
    ctx = get_context("spawn")  # no fork after torch/vLLM are imported
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return list(pool.map(run_job, jobs))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _baseline(runs: Sequence[Run], run: Run) -> Run | None:
    for other in runs:
        j = other.job
        if (j.scenario, j.seed, j.policy) == (run.job.scenario, run.job.seed, BASELINE):
            return other
    return None


def ratio(runs: Sequence[Run], run: Run) -> float | None:
    """``run``'s throughput over ``reserve``'s on the same scenario and seed."""
    base = _baseline(runs, run)
    if base is None or base.tok_s <= 0 or base.outcome != "finished":
        return None
    return run.tok_s / base.tok_s


def runs_table(runs: Sequence[Run]) -> str:
    rows = []
    for r in runs:
        x = ratio(runs, r)
        rows.append(
            (
                r.job.scenario,
                r.job.seed,
                r.job.policy,
                r.outcome,
                f"{r.finished}/{r.total}",
                f"{r.tok_s:.0f}",
                "-" if x is None else f"{x:.3f}",
                f"{_ms(r.ttft_p50)}/{_ms(r.ttft_p99)}",
                _ms(r.e2e_p99),
                r.lateral,
                r.preemptions,
            )
        )
    headers = (
        "scenario",
        "seed",
        "policy",
        "outcome",
        "done",
        "tok/s",
        f"x {BASELINE}",
        "ttft p50/p99 ms",
        "e2e p99 ms",
        "lateral",
        "preempt",
    )
    return table(headers, rows)


def summary_table(runs: Sequence[Run], policies: Sequence[str]) -> str:
    """Per scenario and policy: the ratio to reserve over the seeds."""
    rows = []
    for scenario in dict.fromkeys(r.job.scenario for r in runs):
        for policy in policies:
            if policy == BASELINE:
                continue
            mine = [
                r for r in runs if (r.job.scenario, r.job.policy) == (scenario, policy)
            ]
            ratios = [x for r in mine if (x := ratio(runs, r)) is not None]
            if not ratios:
                continue
            rows.append(
                (
                    scenario,
                    policy,
                    len(ratios),
                    f"{geomean(ratios):.3f}",
                    f"{min(ratios):.3f}",
                    f"{max(ratios):.3f}",
                    sum(1 for x in ratios if x > 1),
                )
            )
    headers = (
        "scenario",
        "policy",
        "seeds",
        f"tok/s x {BASELINE} (geomean)",
        "min",
        "max",
        "seeds faster",
    )
    return table(headers, rows)


def _speed_row(label: str, policy: str, runs: Sequence[Run]) -> tuple[object, ...]:
    steps = sum(r.steps for r in runs)
    cpu = sum(r.cpu_s for r in runs)
    wall = sum(r.wall_s for r in runs)
    return (
        label,
        policy,
        len(runs),
        steps,
        f"{cpu:.1f}",
        f"{steps / cpu:.0f}",
        f"{steps / wall:.0f}",
    )


def speed_table(runs: Sequence[Run]) -> str:
    """Scheduler steps (summed over ranks) per CPU and per wall second."""
    rows = []
    for scenario in dict.fromkeys(r.job.scenario for r in runs):
        for policy in dict.fromkeys(r.job.policy for r in runs):
            key = (scenario, policy)
            mine = [r for r in runs if (r.job.scenario, r.job.policy) == key]
            if mine:
                rows.append(_speed_row(scenario, policy, mine))
    rows.append(_speed_row("all", "", runs))
    headers = (
        "scenario",
        "policy",
        "runs",
        "steps",
        "cpu s",
        "steps/cpu s",
        "steps/wall s",
    )
    return table(headers, rows)


def _seeds(text: str) -> list[int]:
    """``0-4`` or ``0,3,7``."""
    if "-" in text:
        lo, hi = text.split("-", 1)
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",") if s.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 seed at scale 0.25")
    p.add_argument("--seeds", type=_seeds, default=None, help="e.g. 0-4 (default)")
    p.add_argument("--scale", type=float, default=None, help="default 1 (quick 0.25)")
    p.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS))
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    seeds = args.seeds or ([0] if args.quick else list(range(5)))
    scale = args.scale or (0.25 if args.quick else 1.0)
    policies = [p for p in args.policies.split(",") if p]
    if BASELINE not in policies:
        policies.insert(0, BASELINE)
    jobs = [
        Job(scenario, seed, policy, scale)
        for scenario in args.scenarios.split(",")
        for seed in seeds
        for policy in policies
    ]
    print(f"# throughput: {len(jobs)} runs at scale {scale:g}; {machine()}")
    runs = run_all(jobs, args.jobs)
    print(runs_table(runs))
    print()
    print(summary_table(runs, policies))
    print()
    print("# simulator speed (scheduler steps summed over ranks)")
    print(speed_table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
