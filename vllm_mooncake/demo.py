"""``make demo``: the wedge catalogue on vLLM's real scheduler, per policy.

For every wedge in :mod:`vllm_mooncake.testing.wedges` and every policy, this
drives vLLM 0.32's real ``Scheduler``/``KVCacheManager`` (through the guard
connector over two scripted children -- a Mooncake-store-like prefix loader
and a NIXL-like P->D transfer; only the GPU and the transport are fake) and
prints one row: did every request finish, the longest run of steps that
scheduled no token, and how many lateral preemptions the guard made.
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

from vllm_mooncake.testing import prepare_offline_env  # noqa: E402

prepare_offline_env()

POLICIES = ("no-reserve", "reserve", "reserve+lateral", "lateral")


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


def main(argv: list[str] | None = None) -> int:
    from vllm_mooncake.plugin import register
    from vllm_mooncake.testing.wedges import CATALOGUE

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--policy", action="append", choices=POLICIES)
    args = parser.parse_args(argv)
    register()
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
