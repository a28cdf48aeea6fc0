"""Scheduler-level rules of the guard, on vLLM's real scheduler."""

from __future__ import annotations

import pytest

from vllm_mooncake.compat.releases import SchedulerAccess, installed_layout
from vllm_mooncake.testing.configs import (
    guarded,
    pd_transfer,
    scripted_multi,
    store_hit,
)
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver
from vllm_mooncake.testing.leaks import assert_scheduler_empty
from vllm_mooncake.testing.wedges import W1, play


def test_both_waiting_queues_are_searched_for_victims() -> None:
    """A recv-done holder is found in the holder queue *and* in ``waiting``."""
    d = SchedulerDriver.build(W1.shape, guarded("reserve"))
    play(d, W1, max_steps=8)  # wedged: X promoted at the head, Y recv-done
    sched = d.scheduler
    holder_queue, waiting = SchedulerAccess(sched, installed_layout()).holder_queues()
    y = sched.requests["Y"]
    assert y in holder_queue
    views = {v.req_id for v in sched.guard_holders.views()}
    assert views == {"X", "Y"}
    # Move Y to the other queue: still seen, still the victim.
    holder_queue.remove_request(y)
    waiting.add_request(y)
    holders = sched.guard_holders.views()
    assert {v.req_id for v in holders} == {"X", "Y"}
    victim = sched.wedge_guard.pick_victim(holders, "X")
    assert victim is not None and victim.req_id == "Y"


def test_running_requests_are_never_victims() -> None:
    """With the idle gate off, a running request still is not chosen."""
    d = SchedulerDriver.build(EngineShape(num_blocks=40), guarded(only_when_idle=False))
    d.add("run", 16 * 20, max_tokens=50)
    d.step()
    assert d.status("run") == "RUNNING"
    d.add("big", 16 * 30, max_tokens=2)
    d.step()  # "big" cannot be admitted; the only block holder is running
    stats = d.scheduler.wedge_guard.stats
    assert stats.total_lateral_preemptions == 0
    d.run(200)
    assert set(d.finished) == {"run", "big"}
    assert_scheduler_empty(d.scheduler)


@pytest.mark.parametrize(
    ("connector", "survives"),
    [("MultiConnector", False), ("WedgeGuardConnector", True)],
)
def test_late_duplicate_receive_notice(connector: str, survives: bool) -> None:
    """Upstream #53049: MultiConnector unions its children's receive notices;
    a second notice for a request that already finished trips vLLM's assert.
    The guard drops it (and counts it)."""
    kv = (
        guarded()
        if connector == "WedgeGuardConnector"
        else scripted_multi(kv_connector=connector)
    )
    d = SchedulerDriver.build(EngineShape(), kv)
    d.add("p", 64, max_tokens=2, kv_transfer_params=pd_transfer(done_after=0))
    d.run(10)
    assert d.finished == {"p": "length"}
    if not survives:
        with pytest.raises(AssertionError):
            d.step(finished_recving={"p"})
        return
    d.step(finished_recving={"p"})
    d.step(finished_recving={"p", "never-seen"})
    dropped = d.scheduler.wedge_guard.stats.dropped_recv_notices
    assert dropped == {"late": 2, "unexpected": 1}
    assert_scheduler_empty(d.scheduler)


@pytest.mark.skipif(
    not installed_layout().resumed_req_ids,
    reason="0.34 has no resumed_req_ids: it re-sends a preempted request as new",
)
def test_executed_victim_is_resumed_not_new() -> None:
    """A victim that ran before (here: preempted by vLLM's running loop, then
    re-admitted through a store load) goes back as PREEMPTED and reaches the
    worker as *resumed*, with its state intact there.

    Layout (priority policy, lateral, pool 100): R1 (prio 0) and L (prio 5,
    store hit) run; R1's growth makes vLLM preempt L; X (prio 1, 90-block
    prompt, 50-block store hit) and L reload together after R1 finishes; X is
    promoted first, needs 40 blocks with 30 free, nothing runs: L (recv done,
    executed) is the lateral victim.
    """
    b = 16
    d = SchedulerDriver.build(
        EngineShape(num_blocks=101, policy="priority"), guarded("lateral")
    )
    d.add("R1", 79 * b, max_tokens=40, priority=0)
    d.add("L", 20 * b, max_tokens=60, priority=5, kv_transfer_params=store_hit(19 * b))
    resumed: list[str] = []
    sent_new: list[str] = []
    lateral_at = None
    for i in range(200):
        if i == 3:
            d.add(
                "X",
                90 * b,
                max_tokens=4,
                priority=1,
                kv_transfer_params=store_hit(50 * b),
            )
        s = d.step()
        resumed += s.scheduler_output.scheduled_cached_reqs.resumed_req_ids
        sent_new += [n.req_id for n in s.scheduler_output.scheduled_new_reqs]
        stats = d.scheduler.wedge_guard.stats
        if lateral_at is None and stats.total_lateral_preemptions:
            lateral_at = i
            assert stats.lateral_preemptions == {
                ("recv_done", "ScriptedLoadConnector[0]"): 1
            }
            assert d.status("L") == "PREEMPTED"  # executed: resumes, not new
            assert d.scheduler.wedge_guard.ledger.has_executed("L")
        if not d.scheduler.has_requests():
            break
    assert lateral_at is not None
    # New once (its first run); after both preemptions it comes back resumed.
    assert sent_new.count("L") == 1
    assert resumed == ["L"]
    assert set(d.finished) == {"R1", "L", "X"}
    assert_scheduler_empty(d.scheduler)
