"""Run one scenario under several policies and put the results side by side.

Each policy runs in its own process when ``jobs > 1`` (a run is one
process's vLLM schedulers; nothing is shared), otherwise in this one. The
table has one row per policy; ``check`` compares each outcome with the
scenario's ``expect`` section.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from vllm_mooncake.guard.config import POLICY_NAMES
from vllm_mooncake.tools.sim.progress import ProgressLine
from vllm_mooncake.tools.sim.results import RunResult
from vllm_mooncake.tools.sim.scenario import Scenario

# Stock-like first, then upstream, then the guarded policies.
DEFAULT_POLICIES = ("no-reserve", "reserve", "reserve+lateral", "lateral")
assert set(DEFAULT_POLICIES) == set(POLICY_NAMES)

# Makes the progress line of one policy's run (serial runs only).
ProgressFactory = Callable[[str], ProgressLine]


def run_policies(
    scenario: Scenario,
    policies: Sequence[str],
    scale: float = 1.0,
    jobs: int = 1,
    progress: ProgressFactory | None = None,
) -> list[RunResult]:
    """One result per policy, in the order given."""
    variants = [scenario.with_policy(p) for p in policies]
    if jobs <= 1 or len(variants) == 1:
        return [_run_serial(v, scale, progress) for v in variants]
    ctx = get_context("spawn")  # no fork after torch/vLLM are imported
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_quiet_run, v, scale) for v in variants]
        return [f.result() for f in futures]


def _run_serial(
    scenario: Scenario, scale: float, progress: ProgressFactory | None
) -> RunResult:
    from vllm_mooncake.tools.sim.runner import run_scenario

    line = progress(f"{scenario.name} {scenario.policy}") if progress else None
    try:
        return run_scenario(scenario, scale, line)
    finally:
        if line is not None:
            line.close()


def _quiet_run(scenario: Scenario, scale: float) -> RunResult:
    from vllm_mooncake.tools.sim.logs import quiet_vllm

    quiet_vllm()
    return _run_serial(scenario, scale, None)


def mismatches(scenario: Scenario, results: Sequence[RunResult]) -> list[str]:
    """``expect`` entries the results do not meet, as sentences."""
    expected = scenario.expectations()
    out = []
    for r in results:
        want = expected.get(r.policy)
        if want is not None:
            for problem in want.problems(r.outcome, r.lateral_preemptions):
                out.append(f"{r.policy}: {problem}")
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


COLUMNS: tuple[tuple[str, int, Callable[[RunResult], str]], ...] = (
    ("policy", 16, lambda r: r.policy),
    (
        "outcome",
        9,
        lambda r: (
            r.outcome.upper() if r.outcome in ("wedged", "livelock") else r.outcome
        ),
    ),
    ("done", 10, lambda r: f"{r.finished}/{r.total}"),
    ("sim s", 8, lambda r: f"{r.sim_seconds:.2f}"),
    ("tok/s", 8, lambda r: f"{r.throughput_tok_s:.0f}"),
    ("ttft p50/p99 ms", 16, lambda r: f"{_ms(r.ttft_s['p50'])}/{_ms(r.ttft_s['p99'])}"),
    ("e2e p50/p99 ms", 15, lambda r: f"{_ms(r.e2e_s['p50'])}/{_ms(r.e2e_s['p99'])}"),
    ("max stall", 10, lambda r: str(r.max_stall_steps)),
    ("stalled s", 10, lambda r: f"{r.stalled_seconds:.2f}"),
    ("lateral", 8, lambda r: str(r.lateral_preemptions)),
    ("exhausted", 10, lambda r: str(r.attempts_exhausted)),
    ("wall s", 7, lambda r: f"{r.wall_seconds:.1f}"),
)


def format_table(results: Sequence[RunResult]) -> str:
    """One row per run; numbers right-aligned, ``WEDGED`` in capitals."""
    head = "".join(
        f"{name:<{w}}" if i == 0 else f"{name:>{w}}"
        for i, (name, w, _) in enumerate(COLUMNS)
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            "".join(
                f"{get(r):<{w}}" if i == 0 else f"{get(r):>{w}}"
                for i, (_, w, get) in enumerate(COLUMNS)
            )
        )
    return "\n".join(lines)


def describe(results: Sequence[RunResult]) -> list[str]:
    """One line per wedged, livelocked or leaking run: where, and when the
    run stopped (a leak: what the drained ranks still held)."""
    out = []
    for r in results:
        if r.wedged:
            out.append(
                f"{r.policy}: rank(s) {', '.join(r.wedged_ranks)} wedged; the run "
                f"stopped at t={r.sim_seconds:.2f}s with {r.finished}/{r.total} "
                "finished"
            )
        if r.leaks:
            out.append(
                f"{r.policy}: LEAK: {len(r.leaks)} finding(s) after draining the "
                f"ranks: {'; '.join(r.leaks[:5])}"
            )
        for loop in r.livelocked:
            out.append(
                f"{r.policy}: livelock: request {loop['request']} on rank "
                f"{loop['rank']} started {loop['loads']} loads without a token; "
                f"the run stopped at t={r.sim_seconds:.2f}s with "
                f"{r.finished}/{r.total} finished"
            )
    return out
