"""The guard turns the red lights green, on vLLM's real 0.32 scheduler.

For each wedge in the catalogue, the same layout runs twice through the guard
connector: once under a policy without the valve (``reserve``: upstream's
admission; ``no-reserve``: pre-0.23 admission), which stalls for good, and
once under a guarded policy, which schedules again as soon as a lateral
candidate exists, finishes every request, and leaves no block, scheduler
entry or ledger entry behind.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from vllm_mooncake.compat.releases import installed_layout
from vllm_mooncake.compat.versions import check_vllm_version
from vllm_mooncake.guard.scheduler import WedgeGuardAsyncScheduler, WedgeGuardScheduler
from vllm_mooncake.testing.configs import guarded, store_hit
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver
from vllm_mooncake.testing.leaks import assert_scheduler_empty
from vllm_mooncake.testing.wedges import (
    BLOCK,
    HOL,
    SEED,
    STORE_VICTIM,
    W1,
    W2,
    Arrival,
    WedgeScenario,
    play,
)

STALL_STEPS = 150

SERIES = check_vllm_version()
# (scenario, policy that stalls, policy that recovers), on the releases where
# the layout wedges stock vLLM (``WedgeScenario.wedges_on``). The seed layout
# runs on every release: ``no-reserve`` removes the reservation 0.23+ has.
ALL_CASES = [
    (SEED, "no-reserve", "lateral"),
    (W1, "reserve", "reserve+lateral"),
    (W1, "reserve", "lateral"),
    (W2, "reserve", "reserve+lateral"),
    (HOL, "reserve", "reserve+lateral"),
    (HOL, "reserve", "lateral"),
]
CASES = [c for c in ALL_CASES if c[0] is SEED or SERIES in c[0].wedges_on]


def _driver(scenario: WedgeScenario, policy: str, **guard: object) -> SchedulerDriver:
    return SchedulerDriver.build(
        scenario.shape,
        guarded(
            policy, kv_load_failure_policy=scenario.kv_load_failure_policy, **guard
        ),
    )


def _case_id(case: tuple[WedgeScenario, str, str]) -> str:
    return f"{case[0].name}-{case[2]}"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_unguarded_policy_stalls_guarded_policy_recovers(
    case: tuple[WedgeScenario, str, str], async_scheduling: bool
) -> None:
    """Both guarded classes: Scheduler and AsyncScheduler (vLLM's default)."""
    scenario, stalling, recovering = case
    shape = replace(scenario.shape, async_scheduling=async_scheduling)
    scenario = replace(scenario, shape=shape)
    # Red: the valve is off; the stranded recv-done request never runs.
    red = _driver(scenario, stalling)
    play(red, scenario, max_steps=STALL_STEPS)
    assert red.zero_token_streak() >= STALL_STEPS - 10
    assert not red.scheduler.running
    assert scenario.stranded in red.scheduler.finished_recving_kv_req_ids
    assert red.finished == {}
    assert red.scheduler.wedge_guard.stats.total_lateral_preemptions == 0

    # Green: same layout, the valve on.
    green = _driver(scenario, recovering)
    expected = WedgeGuardAsyncScheduler if async_scheduling else WedgeGuardScheduler
    assert type(green.scheduler) is expected
    steps = play(green, scenario, max_steps=STALL_STEPS)
    stats = green.scheduler.wedge_guard.stats
    assert stats.total_lateral_preemptions >= 1
    assert set(green.finished) == {a.req_id for a in scenario.arrivals}
    assert all(reason == "length" for reason in green.finished.values())
    # No stall longer than the transfers themselves: the valve opens in the
    # first step after the stranded request's receive lands.
    streaks = _zero_streaks(steps)
    assert max(streaks) <= _longest_transfer(scenario) + 1, streaks
    assert len(steps) < 30
    assert_scheduler_empty(green.scheduler)
    assert len(green.scheduler.wedge_guard.ledger) == 0


def _longest_transfer(scenario: WedgeScenario) -> int:
    return max(
        load.get("done_after", 1)
        for a in scenario.arrivals
        for load in (a.kv_transfer_params or {}).values()
    )


def _zero_streaks(steps: list) -> list[int]:  # type: ignore[type-arg]
    streaks, run = [0], 0
    for s in steps:
        run = 0 if s.num_scheduled_tokens else run + 1
        streaks.append(run)
    return streaks


def test_valve_acts_in_the_first_step_a_candidate_exists() -> None:
    """W1: while Y's receive is in flight, X fails and holds (no spurious
    preemption); the step after Y's receive lands, Y is preempted and X runs."""
    d = _driver(W1, "reserve+lateral")
    play(d, W1, max_steps=4)  # steps 0..3: X promoted at 3, Y still in flight
    stats = d.scheduler.wedge_guard.stats
    assert d.steps[3].num_scheduled_tokens == 0
    assert stats.total_lateral_preemptions == 0
    assert d.scheduler.wedge_guard.ledger.recv_state("Y").value == "done"
    s4 = d.step()
    assert stats.lateral_preemptions == {("recv_done", "ScriptedLoadConnector[1]"): 1}
    assert s4.scheduler_output.num_scheduled_tokens == {"X": 50 * BLOCK}
    # The victim went back to the front of `waiting`, as a new request.
    assert d.status("Y") == "WAITING"
    assert d.scheduler.requests["Y"].num_preemptions == 1
    if installed_layout().reset_preempted:  # 0.25+ names it to the worker
        assert "Y" in s4.scheduler_output.preempted_req_ids


def test_never_executed_victim_is_repromoted_as_new() -> None:
    """A store-loaded victim is re-offered its hit, loads again, is promoted
    with num_preemptions=1 and must still reach the worker as NEW (the fake
    worker raises, like vLLM's model runner, if it arrives as resumed)."""
    scenario = STORE_VICTIM
    d = _driver(scenario, "lateral")
    play(d, scenario, max_steps=60)
    assert d.scheduler.wedge_guard.stats.total_lateral_preemptions >= 1
    assert d.worker.started.count("B") == 2  # loaded, preempted, loaded again
    assert set(d.finished) == {"A", "B"}
    assert_scheduler_empty(d.scheduler)


def test_without_the_status_fix_the_worker_would_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The previous test can fail: drop the guard's status fix and the victim
    is sent as resumed to a worker that never saw it."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mooncake.guard.scheduler import WedgeGuardMixin
    from vllm_mooncake.testing.driver import WorkerProtocolError

    if not installed_layout().resumed_req_ids:
        pytest.skip(
            "0.34 re-sends every preempted request in full, as new: "
            "there is no 'resumed' for the status fix to avoid"
        )

    for hook in (
        "_handle_blocked_waiting_request",
        "_try_promote_blocked_waiting_request",
    ):
        if hasattr(Scheduler, hook):  # 0.31+ / 0.30
            monkeypatch.setattr(WedgeGuardMixin, hook, getattr(Scheduler, hook))
    with pytest.raises(
        WorkerProtocolError, match="B was sent to the worker as resumed"
    ):
        test_never_executed_victim_is_repromoted_as_new()


@pytest.mark.parametrize("policy", ["reserve", "reserve+lateral", "lateral"])
def test_control_runs_preempt_nothing(policy: str) -> None:
    """Healthy load: async store hits and P->D transfers in an ample pool."""
    d = SchedulerDriver.build(EngineShape(num_blocks=400), guarded(policy))
    for i in range(12):
        params = (
            store_hit(48, done_after=i % 3)
            if i % 2
            else {"pd_load": {"tokens": -1, "done_after": i % 4}}
        )
        d.add(f"r{i}", 64 + 16 * i, max_tokens=6, kv_transfer_params=params)
    d.run(100)
    assert len(d.finished) == 12
    assert d.scheduler.wedge_guard.stats.total_lateral_preemptions == 0
    assert d.scheduler.wedge_guard.stats.wedges_detected == 0
    assert_scheduler_empty(d.scheduler)


def test_fcfs_variant_of_w1_needs_no_valve() -> None:
    """The W1 layout under FCFS finishes on its own: the valve stays shut."""
    fcfs = replace(W1, shape=replace(W1.shape, policy="fcfs", reserve_full_isl=True))
    d = _driver(fcfs, "reserve+lateral")
    play(d, fcfs, max_steps=60)
    assert set(d.finished) == {"X", "Y"}
    assert d.scheduler.wedge_guard.stats.total_lateral_preemptions == 0
    assert_scheduler_empty(d.scheduler)


def test_max_attempts_bounds_preemptions_per_step() -> None:
    """With max_attempts=1 and a head needing two victims, the first step
    preempts one, counts the exhaustion, and the next step finishes the job."""
    scenario = WedgeScenario(
        name="two-victims",
        summary="head needs the blocks of two recv-done holders",
        shape=SEED.shape,
        arrivals=(
            Arrival(0, "A", 80 * BLOCK, kv_transfer_params=store_hit(40 * BLOCK, 2)),
            Arrival(
                1, "B", 30 * BLOCK, kv_transfer_params={"pd_load": {"done_after": 1}}
            ),
            Arrival(
                1, "C", 30 * BLOCK, kv_transfer_params={"pd_load": {"done_after": 1}}
            ),
        ),
    )
    d = _driver(scenario, "lateral", max_attempts=1)
    play(d, scenario, max_steps=80)
    stats = d.scheduler.wedge_guard.stats
    assert stats.attempts_exhausted >= 1
    assert stats.total_lateral_preemptions >= 2
    assert set(d.finished) == {"A", "B", "C"}
    assert_scheduler_empty(d.scheduler)
