"""Each invariant check catches a deliberately broken guard.

The property tests are only as good as their checks. Here each check of
``vllm_mooncake.testing.invariants`` runs against a guard broken in the way
that check exists for -- and, first, against the real guard on the same
layouts, where every check passes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_mooncake.guard.ledger import (
    BlockLedger,
    HolderView,
    VictimReason,
    WaitStatus,
)
from vllm_mooncake.guard.routing import ChildRouter
from vllm_mooncake.guard.scheduler import WedgeGuardMixin
from vllm_mooncake.guard.stall_watch import StallWatch
from vllm_mooncake.guard.valve import LateralValve
from vllm_mooncake.testing.cases import RandomDraw, draw_case, run_case
from vllm_mooncake.testing.configs import guarded
from vllm_mooncake.testing.driver import SchedulerDriver
from vllm_mooncake.testing.invariants import (
    ALARM,
    BLOCKS,
    ENDS,
    IN_FLIGHT,
    LATERAL,
    LEDGER,
    NORMAL_ENDS,
    PREFIX,
    RESERVATION,
    RESUMED,
    ROUTING,
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
    skip: tuple[str, ...] = (),
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
        driver, stall_bound=stall_bound, watch_laterals=watch_laterals, skip=skip
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
    preempt = LateralValve.preempt

    def frees_behind_the_books(self: Any, victim: Any, target: Any) -> None:
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        single = manager.coordinator.single_type_managers[0]

        def free(request: Any) -> None:
            manager.block_pool.free_blocks(
                list(single.req_to_blocks[request.request_id])
            )

        scheduler._free_request_blocks = free
        try:
            preempt(self, victim, target)
        finally:
            del scheduler._free_request_blocks

    monkeypatch.setattr(LateralValve, "preempt", frees_behind_the_books)
    # (the lateral check sees the victim still listing its blocks first)
    error = broken(monkeypatch, BLOCKS, SEED, "lateral", skip=(LATERAL,))
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
    preempt = LateralValve.preempt

    def loses_victim(self: Any, victim: Any, target: Any) -> None:
        preempt(self, victim, target)
        scheduler = self.scheduler
        scheduler.waiting.remove_request(scheduler.requests[victim.req_id])

    monkeypatch.setattr(LateralValve, "preempt", loses_victim)
    error = broken(monkeypatch, ENDS, SEED, "lateral")
    assert "B never ended (WAITING)" in str(error)


def _valve_shut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LateralValve, "_may_preempt_for", lambda self, request: False)


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


# ==== policy mistakes: the valve acting when its policy says it may not ===========
# Each mistake below is one small change to the guard. Generated runs (the
# property tests' own generator, seeded) or a catalogue layout must make at
# least one invariant fire -- the new policy checks, not only safety.
def first_violation(
    invariants: set[str], cases: int = 400, **draw: Any
) -> InvariantViolation:
    """Run seeded generated cases until one breaks an invariant."""
    for i in range(cases):
        case = draw_case(RandomDraw(f"policy-mistake:{i}"), **draw)
        try:
            run_case(case)
        except InvariantViolation as error:
            assert error.invariant in invariants, f"{case.to_json()}\n{error}"
            return error
    raise AssertionError(f"no invariant fired in {cases} generated cases")


WEDGE_PRONE: dict[str, Any] = {
    "policies": ("reserve+lateral", "lateral"),
    "burst": True,
}


def test_generated_runs_pass_the_policy_checks_on_the_real_guard() -> None:
    """The same seeds on the real guard: nothing fires, and the valve acts."""
    laterals = 0
    for i in range(40):
        laterals += run_case(
            draw_case(RandomDraw(f"policy-mistake:{i}"), **WEDGE_PRONE)
        ).laterals
    assert laterals > 0


def _ignoring(
    monkeypatch: pytest.MonkeyPatch, method: str, **config: Any
) -> None:  # fmt: skip
    """``method`` of the guard's valve runs with ``config`` overridden."""
    original = getattr(LateralValve, method)

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        side = self.side
        real = side.config
        side.config = replace(real, **config)
        try:
            return original(self, *args, **kwargs)
        finally:
            side.config = real

    monkeypatch.setattr(LateralValve, method, patched)


def test_valve_opening_while_requests_run_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ``only_when_idle`` check removed: a victim is preempted while
    another request runs (the stall would have ended by itself)."""
    for method in ("_may_preempt_for", "arm"):
        _ignoring(monkeypatch, method, only_when_idle=False)
    error = first_violation({LATERAL}, **WEDGE_PRONE)
    assert "running (only_when_idle)" in str(error)


def test_reservation_not_recomputed_after_a_preemption_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The valve retries the admission against the reservation it had
    before it preempted a victim that was itself in the reservation."""
    install = LateralValve._install_admission_valve

    def without_recompute(self: Any) -> None:
        manager = self.scheduler.kv_cache_manager
        first: dict[str, tuple[int, Any]] = {}

        def stock(request: Any, *args: Any, **kwargs: Any) -> Any:
            # vLLM's method of the manager's class now (the checker probes it)
            return type(manager).allocate_slots(manager, request, *args, **kwargs)

        def stale(request: Any, *args: Any, **kwargs: Any) -> Any:
            made = len(self.lateral)
            seen = first.get(request.request_id)
            if seen is not None and seen[0] < made and "reserved_blocks" in kwargs:
                kwargs["reserved_blocks"] = seen[1]  # the value before the preemption
            else:
                first[request.request_id] = (made, kwargs.get("reserved_blocks"))
            return stock(request, *args, **kwargs)

        manager.allocate_slots = stale
        install(self)

    monkeypatch.setattr(LateralValve, "_install_admission_valve", without_recompute)
    error = first_violation({RESERVATION}, policies=("reserve+lateral",), burst=True)
    assert "a fresh computation gives" in str(error)


def test_reservation_kept_under_lateral_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        WedgeGuardMixin,
        "_inflight_prefill_reserved_blocks",
        Scheduler._inflight_prefill_reserved_blocks,
    )
    error = first_violation({RESERVATION}, policies=("lateral",), burst=True)
    assert "(policy lateral)" in str(error)


def _two_stalls() -> int:
    """Two genuine stalls on vLLM's scheduler, checked after every step:
    W1 under ``reserve`` (no valve) wedges; aborting X ends the stall (Y
    runs); a second W1 pair wedges again and is aborted too. Returns the
    alarms the guard raised."""
    from vllm.v1.request import RequestStatus

    again = tuple(
        replace(a, step=a.step + 30, req_id=a.req_id + "2") for a in W1.arrivals
    )
    scenario = replace(W1, arrivals=W1.arrivals + again)
    driver = SchedulerDriver.build(
        scenario.shape,
        guarded(
            "reserve",
            kv_load_failure_policy=scenario.kv_load_failure_policy,
            stall_alarm_steps=3,
        ),
    )
    checker = InvariantChecker(driver, stall_bound=None, watch_laterals=False)
    aborts = {15: "X", 45: "X2"}
    steps = [0]

    def after_step(result: Any) -> None:
        checker.after_step(result)
        steps[0] += 1
        if steps[0] in aborts:
            driver.scheduler.finish_requests(
                aborts[steps[0]], RequestStatus.FINISHED_ABORTED
            )

    play(driver, scenario, 70, until=lambda d: False, after_step=after_step)
    return int(driver.scheduler.wedge_guard.stats.wedges_detected)


def test_two_stalls_raise_two_alarms_on_the_real_guard() -> None:
    assert _two_stalls() == 2


def test_alarm_never_re_armed_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once raised, the alarm stays raised: the next stall goes unreported."""
    observe = StallWatch.observe_step

    def never_re_armed(self: Any, *args: Any, **kwargs: Any) -> None:
        raised = self._alarm_raised
        observe(self, *args, **kwargs)
        self._alarm_raised = self._alarm_raised or raised

    monkeypatch.setattr(StallWatch, "observe_step", never_re_armed)
    with pytest.raises(InvariantViolation) as info:
        _two_stalls()
    assert info.value.invariant == ALARM
    assert "expected" in str(info.value) and "wedge alarm" in str(info.value)


def test_ledger_not_told_of_a_lateral_preemption_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(BlockLedger, "on_lateral_preempt", lambda self, req_id: None)
    error = broken(monkeypatch, LATERAL, SEED, "lateral")
    assert "the ledger was not told of B's lateral preemption" in str(error)
    error = first_violation({LATERAL}, **WEDGE_PRONE)
    assert "the ledger was not told" in str(error)


def test_every_load_routed_to_the_first_child_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        ChildRouter, "owner_for", lambda self, params: 0 if params else None
    )
    error = first_violation({ROUTING})
    assert "but child 0 was asked to load it" in str(error)


def test_victim_keeping_its_computed_tokens_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    preempt = LateralValve.preempt

    def keeps_tokens(self: Any, victim: Any, target: Any) -> None:
        request = self.scheduler.requests[victim.req_id]
        computed = request.num_computed_tokens
        preempt(self, victim, target)
        request.num_computed_tokens = computed

    monkeypatch.setattr(LateralValve, "preempt", keeps_tokens)
    error = broken(monkeypatch, LATERAL, SEED, "lateral")
    assert "lateral victim B keeps 800 computed tokens" in str(error)
    error = first_violation({LATERAL, PREFIX}, **WEDGE_PRONE)
    assert "computed tokens" in str(error)


@pytest.mark.parametrize("off_by", [-1, 1])
def test_off_by_one_max_attempts_is_caught(
    monkeypatch: pytest.MonkeyPatch, off_by: int
) -> None:
    """The per-call budget checked one too early or one too late."""
    may_preempt = LateralValve._may_preempt_for

    def off_by_one(self: Any, request: Any) -> bool:
        self._budget += off_by
        try:
            return bool(may_preempt(self, request))
        finally:
            self._budget -= off_by

    monkeypatch.setattr(LateralValve, "_may_preempt_for", off_by_one)
    error = first_violation({LATERAL}, **WEDGE_PRONE)
    assert "max_attempts=" in str(error)


def test_a_re_admitted_victim_hits_what_it_had_cached() -> None:
    """PREFIX on the real guard: the seed's victim B (its P->D receive done)
    comes back with its 50 loaded blocks still cached and hits them."""
    stats = checked_run(SEED, "lateral")
    assert [r.victim for r in stats.laterals] == ["B"]


def test_a_victim_whose_cache_is_ignored_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Re-admission skipping the prefix cache (as a victim left with
    computed tokens makes vLLM do) is a PREFIX violation on its own."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    lookup = KVCacheManager.get_computed_blocks

    def no_hit_for_victims(self: Any, request: Any) -> Any:
        found = lookup(self, request)
        if request.num_preemptions:  # (blocks, hit tokens, ...): no hit
            return (self.empty_kv_cache_blocks, 0, *(0 for _ in found[2:]))
        return found

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", no_hit_for_victims)
    error = broken(monkeypatch, PREFIX, SEED, "lateral")
    assert "re-admitted lateral victim B hit 0 cached tokens" in str(error)
