"""vLLM 0.34's parked reservations: a lateral victim gives its own back.

0.34 caches an async load's reservation when the load starts and again when
the request is promoted (``_reserve_parked``: ``_parked_reservations``,
``_parked_reserved_blocks``), keeps block-less requests waiting for a load
slot in ``async_kv_waiting`` when ``max_num_inflight_kv_loads`` is set, and
counts a load's KV-fetch stage against that cap. A victim of a lateral
preemption is undone like vLLM's own ``_free_request`` undoes a waiting
request: its parked reservation popped, out of every waiting queue, its
stage (a load slot) cleared. Forgetting the parked reservation is caught by
the leak check. Runs on 0.34 (tests/test_vllm_releases.py); elsewhere skipped.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from vllm_mooncake.compat.releases import installed_layout
from vllm_mooncake.testing.configs import guarded
from vllm_mooncake.testing.driver import SchedulerDriver, StepResult
from vllm_mooncake.testing.leaks import (
    assert_scheduler_empty,
    assert_waiting_state_clean,
)
from vllm_mooncake.testing.wedges import SEED, W1, W2, WedgeScenario, play

pytestmark = pytest.mark.skipif(
    not installed_layout().parked,
    reason="parked reservations and max_num_inflight_kv_loads are vLLM 0.34's",
)

STEPS = 150
CASES = [
    (SEED, "lateral"),
    (W1, "reserve+lateral"),
    (W1, "lateral"),
    (W2, "reserve+lateral"),
]


def _driver(scenario: WedgeScenario, policy: str, cap: int | None) -> SchedulerDriver:
    shape = replace(scenario.shape, max_num_inflight_kv_loads=cap)
    return SchedulerDriver.build(
        shape, guarded(policy, kv_load_failure_policy=scenario.kv_load_failure_policy)
    )


@pytest.mark.parametrize("cap", [None, 1, 2], ids=lambda c: f"inflight-cap-{c}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{c[1]}")
def test_guarded_runs_finish_and_leave_no_parked_state(
    case: tuple[WedgeScenario, str], cap: int | None
) -> None:
    scenario, policy = case
    d = _driver(scenario, policy, cap)
    sched = d.scheduler
    assert sched.scheduler_config.max_num_inflight_kv_loads == cap
    victims_seen: list[str] = []

    def check_victims(_: StepResult) -> None:
        # Right after a lateral preemption: no trace of the victim's
        # reservation, load slot or queue place other than `waiting`.
        for victim, _target in sched.guard_valve.lateral:
            request = sched.requests[victim.req_id]
            victims_seen.append(victim.req_id)
            assert request not in sched._parked_reservations
            assert request not in sched._inflight_prefills
            assert request not in sched.async_kv_waiting
            assert request not in sched.kv_holding_waiting
            stages = sched._kv_fetch_stages or {}
            assert victim.req_id not in stages and request not in stages
        assert_waiting_state_clean(sched)
        assert sched._parked_reserved_blocks >= 0

    play(d, scenario, max_steps=STEPS, after_step=check_victims)
    assert set(d.finished) == {a.req_id for a in scenario.arrivals}
    if cap is None:  # the wedge forms: the guard had to act
        assert victims_seen
    assert_scheduler_empty(sched)
    assert len(sched.wedge_guard.ledger) == 0


def test_a_load_cap_does_not_starve_after_a_lateral_preemption() -> None:
    """Two load slots, both taken when the wedge forms: the victim's stage
    (COMPLETED_WAITING, a slot) must go with it, or its own re-load and
    every later one would wait for a slot that never frees."""
    d = _driver(W1, "lateral", 2)
    play(d, W1, max_steps=STEPS)
    assert d.scheduler.wedge_guard.stats.total_lateral_preemptions >= 1
    assert set(d.finished) == {"X", "Y"}
    assert_scheduler_empty(d.scheduler)


def test_leak_check_catches_a_guard_that_forgets_the_parked_reservation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tests above can fail: without the undo step the victim, back in
    ``waiting``, keeps its parked reservation, and the leak check names it."""
    from vllm_mooncake.compat.releases import SchedulerAccess

    monkeypatch.setattr(SchedulerAccess, "release_parked", lambda self, request: None)
    d = _driver(W1, "reserve+lateral", None)
    with pytest.raises(AssertionError, match=r"_parked_reservations held by .*'Y'"):
        play(
            d,
            W1,
            max_steps=STEPS,
            after_step=lambda _: assert_waiting_state_clean(d.scheduler),
        )
    assert d.scheduler.wedge_guard.stats.total_lateral_preemptions == 1
