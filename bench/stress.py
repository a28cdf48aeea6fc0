"""Stress: 1P2D at 4x the seed's concurrency with faults on; nothing may be lost.

Runs the library scenario ``stress_1p2d_1024_faults`` (1024 closed-loop clients,
4096 requests on the seed's pools; store loads and P->D transfers that fail,
arrive partly, or take long) under each policy, then checks:

* the run completed (every request finished or ended with a reason; a
  request *lost* is one that did neither) and no rank wedged;
* the guard's ledger never disagreed with the scheduler (``ledger_errors``);
* every rank drains: after the run, the prefill rank's held blocks are
  released (as their leases would) and each rank is stepped until idle;
  then vLLM's scheduler holds no request, no queue entry, no reservation and
  no block (``vllm_mooncake.testing.leaks.scheduler_leaks``).

Exit code 1 if a guarded policy (one with the valve) lost a request, wedged
or leaked. ``--failure-policy fail`` reruns it with failed loads ending their
request instead of recomputing it. ::

    python bench/stress.py                       # full size, guarded policies
    python bench/stress.py --policies reserve,reserve+lateral,lateral
    python bench/stress.py --quick               # scale 0.125
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from _util import machine, setup, table

if TYPE_CHECKING:
    from vllm_mooncake.tools.sim.cluster import Cluster
    from vllm_mooncake.tools.sim.rank import Rank
    from vllm_mooncake.tools.sim.scenario import Scenario

SCENARIO = "stress_1p2d_1024_faults"
GUARDED = ("reserve+lateral", "lateral")
DRAIN_STEPS = 10_000


@dataclass(frozen=True)
class StressRow:
    policy: str
    outcome: str
    finished: int
    failed: int
    total: int
    lost: int
    leaks: list[str]
    ledger_errors: int
    held_at_end: int
    lateral: int
    preemptions: int
    max_stall: int
    stalled_s: float
    lease_expired: int
    tok_s: float
    sim_s: float
    steps: int
    cpu_s: float

    @property
    def ok(self) -> bool:
        return (
            self.outcome == "finished"
            and not self.lost
            and not self.leaks
            and not self.ledger_errors
        )


def drain(rank: Rank, at: float) -> list[str]:
    """Release what the rank still holds, step it idle, list its leaks."""
    from vllm_mooncake.testing.leaks import scheduler_leaks

    for req_id in sorted(rank.held):
        rank.release(req_id, at)
    for _ in range(DRAIN_STEPS):
        if not rank.active:
            break
        rank.step()
    return [f"{rank.name}: {p}" for p in scheduler_leaks(rank.scheduler)]


def _scenario(failure_policy: str | None) -> Scenario:
    from vllm_mooncake.tools.sim.__main__ import resolve_scenario
    from vllm_mooncake.tools.sim.scenario import load_scenario

    scenario = load_scenario(resolve_scenario(SCENARIO))
    if failure_policy is None:
        return scenario
    return replace(
        scenario,
        prefill_engine=replace(
            scenario.prefill_engine, kv_load_failure_policy=failure_policy
        ),
        decode_engine=replace(
            scenario.decode_engine, kv_load_failure_policy=failure_policy
        ),
    )


def run(policy: str, scale: float, failure_policy: str | None) -> StressRow:
    from vllm_mooncake.tools.sim.runner import simulate

    scenario = _scenario(failure_policy).with_policy(policy)
    cpu0 = time.process_time()
    result, cluster = simulate(scenario, scale)
    cpu = time.process_time() - cpu0
    held = sum(len(r.held) for r in cluster.ranks)
    leaks = _drain_all(cluster) if result.outcome != "wedged" else []
    return StressRow(
        policy=policy,
        outcome=result.outcome,
        finished=result.finished,
        failed=result.failed,
        total=result.total,
        lost=result.total - result.finished - result.failed,
        leaks=leaks,
        ledger_errors=sum(r.guard_stats.ledger_errors for r in cluster.ranks),
        held_at_end=held,
        lateral=result.lateral_preemptions,
        preemptions=result.preemptions,
        max_stall=result.max_stall_steps,
        stalled_s=result.stalled_seconds,
        lease_expired=result.lease_expired,
        tok_s=result.throughput_tok_s,
        sim_s=result.sim_seconds,
        steps=result.steps,
        cpu_s=cpu,
    )


def _drain_all(cluster: Cluster) -> list[str]:
    return [leak for rank in cluster.ranks for leak in drain(rank, cluster.now)]


def report(rows: Sequence[StressRow]) -> str:
    return table(
        (
            "policy",
            "outcome",
            "finished",
            "failed",
            "lost",
            "leaks",
            "ledger errors",
            "lateral",
            "preempt",
            "max stall",
            "stalled s",
            "leases out",
            "tok/s",
            "sim s",
            "steps",
            "cpu s",
        ),
        [
            (
                r.policy,
                r.outcome.upper() if r.outcome == "wedged" else r.outcome,
                f"{r.finished}/{r.total}",
                r.failed,
                r.lost,
                len(r.leaks),
                r.ledger_errors,
                r.lateral,
                r.preemptions,
                r.max_stall,
                f"{r.stalled_s:.2f}",
                r.lease_expired,
                f"{r.tok_s:.0f}",
                f"{r.sim_s:.1f}",
                r.steps,
                f"{r.cpu_s:.0f}",
            )
            for r in rows
        ],
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="scale 0.125")
    p.add_argument("--scale", type=float, default=None, help="default 1 (quick 0.125)")
    p.add_argument("--policies", default=",".join(GUARDED))
    p.add_argument(
        "--failure-policy",
        choices=("fail", "recompute"),
        default=None,
        help="override kv_load_failure_policy (the file says recompute)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scale = args.scale or (0.125 if args.quick else 1.0)
    setup()
    policies = [p for p in args.policies.split(",") if p]
    print(
        f"# stress: {SCENARIO} at scale {scale:g}, kv_load_failure_policy="
        f"{args.failure_policy or 'as in the file'}; {machine()}"
    )
    rows = [run(p, scale, args.failure_policy) for p in policies]
    print(report(rows))
    for r in rows:
        for leak in r.leaks[:10]:
            print(f"  {r.policy}: leak: {leak}")
    bad = [r.policy for r in rows if r.policy in GUARDED and not r.ok]
    if bad:
        print(f"FAILED: {', '.join(bad)} lost, wedged, leaked or ledger errors")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
