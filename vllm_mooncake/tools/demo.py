"""``make demo``: the seed's 1P2D x 256 stall, stock vs guarded, then the catalogue.

Part 1 runs the simulator (:mod:`vllm_mooncake.tools.sim`) on
the library scenario ``seed_1p2d_256``: one prefill and two decode ranks, each
vLLM 0.32's real ``Scheduler``/``KVCacheManager`` behind the guard connector
over two scripted children (a Mooncake-store-like prefix loader and a
NIXL-like P->D transfer), 256 closed-loop clients, a cost model for the
forward pass. It prints one row per policy -- ``no-reserve`` (stock vLLM with
the async-load reservation removed, as before 0.23), upstream ``reserve``,
and the guarded ``reserve+lateral`` / ``lateral`` -- and the plot's path.

Part 2 is the wedge catalogue (:mod:`vllm_mooncake.testing.wedges`), each
wedge on one rank per policy: did every request finish, the longest run of
steps that scheduled no token, and how many lateral preemptions the guard
made.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

# The table is the output; vLLM's start-up chatter is not (VERBOSE=1 shows it).
if not os.environ.get("VERBOSE"):
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from vllm_mooncake.offline import prepare_offline_env  # noqa: E402

prepare_offline_env()

POLICIES = ("no-reserve", "reserve", "reserve+lateral", "lateral")
# Stock-like (no reservation, no valve), upstream, then the guarded policies.
SIM_POLICIES = POLICIES


@dataclass
class Row:
    scenario: str
    policy: str
    finished: int
    total: int
    steps: int
    max_stall: int
    lateral: int
    wall_s: float

    @property
    def outcome(self) -> str:
        return "finished" if self.finished == self.total else "WEDGED"


def run_one(scenario_name: str, policy: str, max_steps: int) -> Row:
    from vllm_mooncake.testing.configs import guarded
    from vllm_mooncake.testing.driver import SchedulerDriver
    from vllm_mooncake.testing.wedges import CATALOGUE, play

    scenario = CATALOGUE[scenario_name]
    start = time.perf_counter()
    driver = SchedulerDriver.build(
        scenario.shape,
        guarded(policy, kv_load_failure_policy=scenario.kv_load_failure_policy),
    )
    steps = play(driver, scenario, max_steps=max_steps)
    streak = longest = 0
    for step in steps:
        streak = 0 if step.num_scheduled_tokens else streak + 1
        longest = max(longest, streak)
    return Row(
        scenario=scenario.name,
        policy=policy,
        finished=len(driver.finished),
        total=len(scenario.arrivals),
        steps=len(steps),
        max_stall=longest,
        lateral=driver.scheduler.wedge_guard.stats.total_lateral_preemptions,
        wall_s=time.perf_counter() - start,
    )


def format_table(rows: list[Row]) -> str:
    head = (
        f"{'scenario':<9}{'policy':<17}{'outcome':<10}{'done':>6}"
        f"{'steps':>7}{'max stall':>11}{'lateral':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.scenario:<9}{r.policy:<17}{r.outcome:<10}"
            f"{f'{r.finished}/{r.total}':>6}{r.steps:>7}{r.max_stall:>11}{r.lateral:>9}"
        )
    return "\n".join(lines)


def simulate(scale: float, policies: tuple[str, ...]) -> None:
    """Part 1: the seed's 1P2D x 256 scenario under each policy, and the plot."""
    from vllm_mooncake.tools.sim.__main__ import RESULTS_DIR, SCENARIO_LIBRARY
    from vllm_mooncake.tools.sim.compare import describe, format_table, run_policies
    from vllm_mooncake.tools.sim.plot import plot_results
    from vllm_mooncake.tools.sim.progress import ProgressLine
    from vllm_mooncake.tools.sim.scenario import load_scenario

    scenario = load_scenario(SCENARIO_LIBRARY / "seed_1p2d_256.yaml")
    progress = ProgressLine if sys.stderr.isatty() else None
    results = run_policies(scenario, policies, scale, progress=progress)
    out_dir = RESULTS_DIR / scenario.name
    for result in results:
        result.write(out_dir / f"{result.policy}.json")
    plot = plot_results(
        results, out_dir / "compare.png", f"{scenario.name} (scale {scale:g})"
    )
    w = scenario.workload
    assert w is not None
    print()
    print(
        f"PD simulation on vLLM's real 0.32 scheduler: "
        f"{scenario.ranks.prefill}P{scenario.ranks.decode}D, "
        f"{round(w.concurrency * scale)} closed-loop clients, "
        f"{round(w.num_requests * scale)} requests (the library's seed_1p2d_256.yaml)"
    )
    print(
        f"WEDGED: a rank scheduled nothing for {scenario.limits.wedge_steps} "
        "steps with nothing in flight that could end it (the run stops there)."
    )
    print()
    print(format_table(results))
    print()
    for line in describe(results):
        print(f"  {line}")
    print(f"  results: {out_dir}/  plot: {plot}")


def main(argv: list[str] | None = None) -> int:
    from vllm_mooncake.tools.sim.logs import quiet_vllm

    if not os.environ.get("VERBOSE"):
        quiet_vllm()  # before vLLM is imported: it warns at import time
    from vllm_mooncake.plugin import register
    from vllm_mooncake.testing.wedges import CATALOGUE

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--policy", action="append", choices=POLICIES)
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="size of the 1P2D run (1 = 256 clients)",
    )
    parser.add_argument(
        "--no-sim", action="store_true", help="only the wedge catalogue"
    )
    args = parser.parse_args(argv)
    register()
    if not args.no_sim:
        simulate(args.scale, tuple(args.policy or SIM_POLICIES))
    rows = [
        run_one(name, policy, args.max_steps)
        for name in CATALOGUE
        for policy in (args.policy or POLICIES)
    ]
    print()
    print("Wedge catalogue on vLLM's real 0.32 scheduler (pool 100 blocks x 16 tokens)")
    print(f"A run is WEDGED if it still has requests after {args.max_steps} steps.")
    print()
    print(format_table(rows))
    print()
    for name, scenario in CATALOGUE.items():
        print(f"  {name}: {scenario.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
