"""Scheduler-level rules of the guard, on vLLM's real scheduler."""

from __future__ import annotations

import pytest

from vllm_mooncake.testing.configs import guarded, pd_transfer, scripted_multi
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver
from vllm_mooncake.testing.leaks import assert_scheduler_empty
from vllm_mooncake.testing.wedges import W1, play


def test_both_waiting_queues_are_searched_for_victims() -> None:
    """A recv-done holder is found in the holder queue *and* in ``waiting``."""
    d = SchedulerDriver.build(W1.shape, guarded("reserve"))
    play(d, W1, max_steps=8)  # wedged: X promoted at the head, Y recv-done
    sched = d.scheduler
    holder_queue, waiting = sched._access.holder_queues()
    y = sched.requests["Y"]
    assert y in holder_queue
    views = {v.req_id for v in sched._holder_views()}
    assert views == {"X", "Y"}
    # Move Y to the other queue: still seen, still the victim.
    holder_queue.remove_request(y)
    waiting.add_request(y)
    assert {v.req_id for v in sched._holder_views()} == {"X", "Y"}
    victim = sched._choose_victim(sched.requests["X"])
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
