"""The guard's scheduler side and its rooms, without a vLLM scheduler.

:class:`GuardSchedulerSide` and its rooms (``ownership``, ``notices``,
``watch``) read requests and blocks by attribute only, so plain stand-ins
drive them here: route, record a lookup and an allocation, pick a victim,
report the lateral preemption, observe a step. The same paths run on
vLLM's real scheduler in tests/test_guard_wedges.py and
tests/test_guard_scheduler_rules.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from vllm_mooncake.guard.config import GuardConfig
from vllm_mooncake.guard.containment import ContainedChild
from vllm_mooncake.guard.ledger import HolderView, RecvState, VictimReason, WaitStatus
from vllm_mooncake.guard.ownership import UNROUTABLE
from vllm_mooncake.guard.routing import ChildRouter
from vllm_mooncake.guard.scheduler_side import GuardSchedulerSide
from vllm_mooncake.guard.stall_watch import StepObservation


class Store:
    """Claims no transfer params (a prefix store)."""


class Nixl:
    def claim_keys(self) -> frozenset[str]:
        return frozenset({"remote_block_ids"})


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0


@dataclass
class FakeBlocks:
    ids: list[int] = field(default_factory=list)

    @property
    def blocks(self) -> tuple[list[int], ...]:  # one KV cache group
        return (self.ids,)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def _side(**config: Any) -> tuple[GuardSchedulerSide, dict[str, int]]:
    mapping: dict[str, int] = {}
    router = ChildRouter.for_children([Store(), Nixl()])
    side = GuardSchedulerSide(GuardConfig(**config), router, mapping, block_size=16)
    return side, mapping


class Child:
    """A child connector's allocation hook, recording who heard what, in order."""

    def __init__(self, name: str, heard: list[tuple[str, int]]) -> None:
        self.name = name
        self.heard = heard

    def update_state_after_alloc(
        self, request: FakeRequest, blocks: FakeBlocks, num_external_tokens: int
    ) -> None:
        self.heard.append((self.name, num_external_tokens))


class Raising(Child):
    def update_state_after_alloc(
        self, request: FakeRequest, blocks: FakeBlocks, num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        raise RuntimeError("a buggy connector")


def _recv_done(req_id: str, blocks: int) -> HolderView:
    return HolderView(req_id, WaitStatus.WAITING_FOR_REMOTE_KVS, 0, blocks, True)


def test_route_by_transfer_params_and_record_the_owner() -> None:
    side, mapping = _side()
    nixl_req = FakeRequest("n", {"do_remote_prefill": True, "remote_block_ids": [1]})
    own = side.ownership
    assert own.route(nixl_req) == 1
    side.on_arrival("n")
    own.record_lookup("n", 1, 32, True, num_computed_tokens=16)
    entry = side.ledger.get("n")
    assert entry is not None and entry.owner == "Nixl" and entry.load_start == 16
    assert mapping == {"n": 1}  # MultiConnector's copy, by index
    assert own.alloc_order("n", 2) == (1, (1, 0))
    # A remote prefill that names no child is computed locally, and counted.
    stray = FakeRequest("x", {"do_remote_prefill": True})
    side.on_arrival("x")
    assert own.route(stray) == UNROUTABLE
    assert side.stats.unroutable_requests == 1
    assert "x" not in mapping
    # No hit, no owner: the ledger and MultiConnector's copy both forget it.
    own.record_lookup("n", 1, 0, False)
    assert side.ledger.get("n").owner is None and "n" not in mapping  # type: ignore[union-attr]
    assert own.alloc_order("n", 2) == (None, (0, 1))


def test_the_owner_hears_of_the_allocation_first_and_the_ledger_after() -> None:
    side, _ = _side()
    heard: list[tuple[str, int]] = []
    children = [Child("store", heard), Child("nixl", heard)]
    side.on_arrival("B")
    side.ownership.record_lookup("B", 1, 800, True)
    side.ownership.allocate(
        FakeRequest("B"), FakeBlocks(list(range(50))), 800, children
    )
    assert heard == [("nixl", 800), ("store", 0)]
    assert side.ledger.recv_state("B") is RecvState.IN_FLIGHT
    assert not side.notices.pending


def test_a_load_its_owner_never_started_is_failed_in_the_same_call() -> None:
    """The contained owner's fault comes back from its allocation hook: the
    async load is handed to the notices as a failed receive at once."""
    side, _ = _side()
    heard: list[tuple[str, int]] = []
    children = [
        ContainedChild(Child("store", heard), "Store", side.ownership.on_child_fault),
        ContainedChild(Raising("nixl", heard), "Nixl", side.ownership.on_child_fault),
    ]
    side.on_arrival("B")
    side.ownership.record_lookup("B", 1, 800, True)
    side.ownership.allocate(
        FakeRequest("B"), FakeBlocks(list(range(50))), 800, children
    )
    assert heard == [("nixl", 800), ("store", 0)]
    assert side.stats.child_errors == {"Nixl|update_state_after_alloc": 1}
    assert side.notices.pending


def test_victim_is_the_recv_done_holder_and_the_preemption_is_counted() -> None:
    side, mapping = _side()
    for req_id in ("A", "B"):
        side.on_arrival(req_id)
    side.ownership.record_lookup("B", 1, 800, True)
    heard: list[tuple[str, int]] = []
    side.ownership.allocate(
        FakeRequest("B"),
        FakeBlocks(list(range(50))),
        800,
        [Child("store", heard), Child("nixl", heard)],
    )
    side.ledger.accept_recv_complete("B", failed=False)
    victim = side.pick_victim([_recv_done("B", 50)], target="A")
    assert victim is not None and victim.req_id == "B"
    assert victim.reason is VictimReason.RECV_DONE and victim.owner == "Nixl"
    side.on_lateral_preemption(victim)
    assert "B" not in mapping
    assert side.stats.lateral_preemptions == {("recv_done", "Nixl"): 1}
    assert not side.has_executed("B")
    # The admission target itself is never its own victim.
    assert side.pick_victim([_recv_done("B", 50)], target="B") is None


def test_alarm_fires_once_per_stall_and_rearms(
    guard_log: pytest.LogCaptureFixture,
) -> None:
    side, _ = _side(stall_alarm_steps=3)
    holders = [_recv_done("B", 50)]
    idle = StepObservation.of(0, 0, (), holders)
    busy = StepObservation.of(8, 1, (), [])
    for _ in range(5):
        side.watch.observe_step(idle, lambda: holders)
    assert side.stats.wedges_detected == 1
    assert side.stats.stalled_steps == 5
    assert side.stats.recv_done_holders_waiting == 1
    assert side.stats.blocks_held_by_non_running == 50
    side.watch.observe_step(busy, list)
    assert side.stats.stalled_steps == 0
    for _ in range(3):
        side.watch.observe_step(idle, lambda: holders)
    assert side.stats.wedges_detected == 2
    alarms = [r for r in guard_log.records if "wedge alarm" in r.getMessage()]
    assert all(r.levelno == logging.ERROR for r in alarms)
    assert len(alarms) == 2


def test_no_stall_is_counted_without_waiting_holders() -> None:
    side, _ = _side(stall_alarm_steps=1)
    side.watch.observe_step(StepObservation(0, 0, ()), list)
    assert side.stats.stalled_steps == 0 and side.stats.wedges_detected == 0


def _in_flight(req_id: str, blocks: int) -> HolderView:
    return HolderView(req_id, WaitStatus.WAITING_FOR_REMOTE_KVS, 0, blocks, False)


def test_a_receive_in_flight_is_a_slow_transfer_not_a_stall() -> None:
    """No token, nothing running, blocks held -- but a receive has not landed:
    it will, so no stall is counted and no alarm fires, however long."""
    side, _ = _side(stall_alarm_steps=3)
    holders = [_recv_done("B", 50), _in_flight("C", 20)]
    for _ in range(10):
        side.watch.observe_step(StepObservation.of(0, 0, (), holders), lambda: holders)
    assert side.stats.stalled_steps == 0
    assert side.stats.wedges_detected == 0
    assert side.stats.blocks_held_by_non_running == 70
    # Once it lands, the same picture is a stall.
    landed = [_recv_done("B", 50), _recv_done("C", 20)]
    for _ in range(3):
        side.watch.observe_step(StepObservation.of(0, 0, (), landed), lambda: landed)
    assert side.stats.wedges_detected == 1


def test_the_alarm_fires_after_stall_alarm_s_on_a_slow_stepping_engine() -> None:
    """An engine that steps slowly reaches stall_alarm_s before
    stall_alarm_steps: the alarm fires on time, then once only."""
    now = [100.0]
    side, _ = _side(stall_alarm_steps=2000, stall_alarm_s=5.0)
    side.watch.clock = lambda: now[0]
    holders = [_recv_done("B", 50)]
    stalled = StepObservation.of(0, 0, (), holders)
    for _ in range(4):  # 4 steps, 2 s apart: 6 s since the stall began
        side.watch.observe_step(stalled, lambda: holders)
        now[0] += 2.0
    assert side.stats.stalled_steps == 4
    assert side.stats.wedges_detected == 1
    for _ in range(5):
        side.watch.observe_step(stalled, lambda: holders)
        now[0] += 2.0
    assert side.stats.wedges_detected == 1


def test_a_busy_step_recounts_the_holders_once_per_gauge_interval() -> None:
    """While tokens flow the holder gauges are recounted at most every
    gauge_interval_s; with no holder possible (empty queues) always."""
    now = [50.0]
    side, _ = _side(gauge_interval_s=0.1)
    side.watch.clock = lambda: now[0]
    assert side.watch.census_due(holders_may_wait=True)  # never counted yet
    holders = [_recv_done("B", 50)]
    side.watch.observe_step(StepObservation.of(8, 1, (), holders), lambda: holders)
    assert side.stats.blocks_held_by_non_running == 50
    now[0] += 0.05
    assert not side.watch.census_due(holders_may_wait=True)
    assert side.watch.census_due(holders_may_wait=False)
    now[0] += 0.06
    assert side.watch.census_due(holders_may_wait=True)
    # Every step, with 0.
    every, _ = _side(gauge_interval_s=0.0)
    every.watch.clock = lambda: now[0]
    every.watch.observe_step(StepObservation.of(8, 1, (), holders), lambda: holders)
    assert every.watch.census_due(holders_may_wait=True)


def test_a_busy_step_that_is_not_recounted_still_ends_a_stall() -> None:
    side, _ = _side(stall_alarm_steps=3)
    holders = [_recv_done("B", 50)]
    for _ in range(2):
        side.watch.observe_step(StepObservation.of(0, 0, (), holders), lambda: holders)
    assert side.stats.stalled_steps == 2
    side.watch.note_no_stall()
    assert side.stats.stalled_steps == 0
    assert side.stats.blocks_held_by_non_running == 50  # gauges as last counted
    for _ in range(2):  # a new stall: 2 steps, under the 3 of the alarm
        side.watch.observe_step(StepObservation.of(0, 0, (), holders), lambda: holders)
    assert side.stats.wedges_detected == 0
