"""Each invariant check catches a deliberately broken guard.

The property tests are only as good as their checks. Here each check of
``vllm_mooncake.testing.invariants`` runs against a guard broken in the way
that check exists for -- and, first, against the real guard on the same
layouts, where every check passes.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_mooncake.guard.ledger import (
    BlockLedger,
    HolderView,
    VictimReason,
    WaitStatus,
)
from vllm_mooncake.guard.scheduler import WedgeGuardMixin
from vllm_mooncake.testing.configs import guarded
from vllm_mooncake.testing.driver import SchedulerDriver
from vllm_mooncake.testing.invariants import (
    BLOCKS,
    ENDS,
    IN_FLIGHT,
    LEDGER,
    NORMAL_ENDS,
    RESUMED,
    STALL,
    VICTIM,
    CheckerStats,
    InvariantChecker,
    InvariantViolation,
)
from vllm_mooncake.testing.wedges import (
    SEED,
    STORE_VICTIM,
    W1,
    W2,
    WedgeScenario,
    play,
)


def checked_run(
    scenario: WedgeScenario,
    policy: str,
    stall_bound: int | None = 2,
    max_steps: int = 80,
    watch_laterals: bool = True,
    **guard: Any,
) -> CheckerStats:
    """Play ``scenario`` through the guard, checking after every step."""
    driver = SchedulerDriver.build(
        scenario.shape,
        guarded(
            policy, kv_load_failure_policy=scenario.kv_load_failure_policy, **guard
        ),
    )
    checker = InvariantChecker(
        driver, stall_bound=stall_bound, watch_laterals=watch_laterals
    )
    play(
        driver,
        scenario,
        max_steps,
        until=lambda d: not d.scheduler.requests and not d.worker.in_flight,
        after_step=checker.after_step,
    )
    checker.at_end({a.req_id: NORMAL_ENDS for a in scenario.arrivals})
    return checker.stats


def broken(
    monkeypatch: pytest.MonkeyPatch, invariant: str, scenario: WedgeScenario,
    policy: str, **kwargs: Any,
) -> InvariantViolation:  # fmt: skip
    with pytest.raises(InvariantViolation) as info:
        checked_run(scenario, policy, **kwargs)
    assert info.value.invariant == invariant, str(info.value)
    return info.value


@pytest.mark.parametrize(
    ("scenario", "policy"),
    [
        (SEED, "lateral"),
        (W1, "reserve+lateral"),
        (W1, "lateral"),
        (W2, "reserve+lateral"),
        (STORE_VICTIM, "lateral"),
    ],
    ids=lambda x: getattr(x, "name", x),
)
def test_the_real_guard_passes_every_check(
    scenario: WedgeScenario, policy: str
) -> None:
    stats = checked_run(scenario, policy)
    assert stats.laterals, "the layout must make the valve act"


# ---- in_flight: a guard allowed to pick a request whose receive is in flight ----
def _any_waiting_holder(
    self: BlockLedger, view: HolderView, target: str
) -> VictimReason | None:
    """The candidate rule without its in-flight and recv-done conditions."""
    if view.req_id == target or view.num_blocks <= 0:
        return None
    if view.status is WaitStatus.WAITING_FOR_REMOTE_KVS:
        return VictimReason.RECV_DONE
    return VictimReason.PROMOTED_IDLE


def test_in_flight_victim_is_caught_when_picked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """W1: X fails admission while Y's receive is still in flight."""
    monkeypatch.setattr(BlockLedger, "candidate_reason", _any_waiting_holder)
    error = broken(monkeypatch, IN_FLIGHT, W1, "reserve+lateral")
    assert "lateral victim Y: the worker is still receiving it" in str(error)


def test_in_flight_blocks_freed_are_caught_after_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same bug, with the ledger only logging and no look at victims:
    before the worker runs the step, the check finds Y's receive writing
    into blocks Y lost (vLLM itself asserts later in that step)."""
    monkeypatch.setattr(BlockLedger, "candidate_reason", _any_waiting_holder)
    error = broken(
        monkeypatch, IN_FLIGHT, W1, "reserve+lateral",
        strict=False, watch_laterals=False,
    )  # fmt: skip
    assert "Y: block(s)" in str(error)
    assert "freed while its receive is still writing them" in str(error)


# ---- blocks: a lateral preemption that frees blocks but keeps the bookkeeping ----
def test_blocks_freed_behind_the_books_break_conservation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The victim's blocks go back to the pool while vLLM still lists them as
    the victim's: the target is then given blocks the victim still owns."""
    preempt = WedgeGuardMixin._preempt_laterally

    def frees_behind_the_books(self: Any, victim: Any, target: Any) -> None:
        manager = self.kv_cache_manager
        single = manager.coordinator.single_type_managers[0]

        def free(request: Any) -> None:
            manager.block_pool.free_blocks(
                list(single.req_to_blocks[request.request_id])
            )

        self._free_request_blocks = free
        try:
            preempt(self, victim, target)
        finally:
            del self._free_request_blocks

    monkeypatch.setattr(WedgeGuardMixin, "_preempt_laterally", frees_behind_the_books)
    error = broken(monkeypatch, BLOCKS, SEED, "lateral")
    assert "ref_cnt 1 but 2 reference(s) (held by ['A', 'B']" in str(error)


# ---- victim: a candidate rule that forgets the admission target -----------------
def test_target_chosen_as_its_own_victim_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """W1: X (the target) is the least progressed holder."""
    rule = BlockLedger.candidate_reason

    def forgets_target(
        self: BlockLedger, view: HolderView, target: str
    ) -> VictimReason | None:
        return rule(self, view, "")

    monkeypatch.setattr(BlockLedger, "candidate_reason", forgets_target)
    error = broken(monkeypatch, VICTIM, W1, "reserve+lateral")
    assert "lateral victim X is the request being admitted" in str(error)


# ---- ledger: entries that outlive their requests ----------------------------------
def test_ledger_that_never_forgets_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(BlockLedger, "on_finished", lambda self, req_id: None)
    error = broken(monkeypatch, LEDGER, W1, "reserve+lateral")
    assert "stale ledger entry" in str(error)


# ---- resumed: the status fix for never-executed victims dropped -------------------
def test_never_executed_victim_sent_as_resumed_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for hook in (
        "_handle_blocked_waiting_request",
        "_try_promote_blocked_waiting_request",
    ):
        if hasattr(Scheduler, hook):  # 0.31+ / 0.30
            monkeypatch.setattr(WedgeGuardMixin, hook, getattr(Scheduler, hook))
    error = broken(monkeypatch, RESUMED, STORE_VICTIM, "lateral")
    assert "B sent to the worker as resumed but never seen as new" in str(error)


# ---- ends: a victim that is never re-queued (lost), or a valve that never opens ----
def test_lost_victim_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    preempt = WedgeGuardMixin._preempt_laterally

    def loses_victim(self: Any, victim: Any, target: Any) -> None:
        preempt(self, victim, target)
        self.waiting.remove_request(self.requests[victim.req_id])

    monkeypatch.setattr(WedgeGuardMixin, "_preempt_laterally", loses_victim)
    error = broken(monkeypatch, ENDS, SEED, "lateral")
    assert "B never ended (WAITING)" in str(error)


def _valve_shut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        WedgeGuardMixin, "_may_preempt_for", lambda self, request: False
    )


def test_wedge_is_caught_as_a_request_that_never_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _valve_shut(monkeypatch)
    error = broken(monkeypatch, ENDS, SEED, "lateral", stall_bound=None)
    assert "never ended" in str(error)


# ---- stall: the valve shut while a victim waits -------------------------------------
def test_stall_with_a_victim_left_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    _valve_shut(monkeypatch)
    error = broken(monkeypatch, STALL, SEED, "lateral", stall_bound=2)
    assert "3 zero-token steps" in str(error)
