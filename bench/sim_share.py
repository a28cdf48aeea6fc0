"""The simulator's own cost: its share of a run's CPU outside the schedulers.

One decode step of vLLM's scheduler at 256 running costs milliseconds, so a
simulation's speed is bounded by vLLM, not by the simulator. What the
simulator can waste is the rest: workload, transfers, cost model, recording.
This runs a library scenario once per policy and splits the main thread's
CPU time into the ranks' ``schedule()`` + ``update_from_output()`` (vLLM's
scheduler with the guard on it: the system under test) and everything else
(the simulator). ::

    python bench/sim_share.py                          # seed_1p2d_256, full size
    python bench/sim_share.py --scale 0.25 --policies reserve+lateral
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

from _util import machine, setup, table

DEFAULT_POLICIES = ("reserve", "reserve+lateral")


class SchedulerClock:
    """CPU time spent inside the outermost scheduler calls of every rank."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.calls = 0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = time.thread_time() if self._depth == 1 else 0.0
            try:
                return fn(*args, **kwargs)
            finally:
                if self._depth == 1:
                    self.cpu_s += time.thread_time() - start
                    self.calls += 1
                self._depth -= 1

        return timed


def measure(name: str, policy: str, scale: float) -> tuple[float, float, int, Any]:
    """(total CPU s, scheduler CPU s, scheduler calls, result) of one run."""
    from vllm_mooncake.guard.scheduler import WedgeGuardMixin
    from vllm_mooncake.tools.sim.__main__ import SCENARIO_LIBRARY
    from vllm_mooncake.tools.sim.runner import simulate
    from vllm_mooncake.tools.sim.scenario import load_scenario

    scenario = load_scenario(SCENARIO_LIBRARY / f"{name}.yaml").with_policy(policy)
    clock = SchedulerClock()
    stock = {n: getattr(WedgeGuardMixin, n) for n in ("schedule", "update_from_output")}
    for attr, fn in stock.items():
        setattr(WedgeGuardMixin, attr, clock.wrap(fn))
    try:
        start = time.thread_time()
        result, _ = simulate(scenario, scale)
        total = time.thread_time() - start
    finally:
        for attr, fn in stock.items():
            setattr(WedgeGuardMixin, attr, fn)
    return total, clock.cpu_s, clock.calls, result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="seed_1p2d_256")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    args = p.parse_args(argv)
    setup()
    print(f"# simulator share: {args.scenario} at scale {args.scale}; {machine()}")
    # A first small run pays the one-time costs (imports, vLLM's model
    # inspection, first configs) that are neither the simulator's nor vLLM's.
    measure(args.scenario, "reserve", min(args.scale, 0.125))
    rows = []
    for policy in (x for x in args.policies.split(",") if x):
        total, sched, calls, result = measure(args.scenario, policy, args.scale)
        rows.append(
            (
                policy,
                result.outcome,
                calls // 2,
                f"{total:.1f}",
                f"{sched:.1f}",
                f"{total - sched:.1f}",
                f"{(total - sched) / total:.1%}",
            )
        )
    headers = (
        "policy",
        "outcome",
        "steps",
        "run cpu s",
        "schedulers cpu s",
        "simulator cpu s",
        "simulator share",
    )
    print(table(headers, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
