"""Red lights: stock vLLM 0.32 stalls for good on the catalogue's wedges.

These run vLLM's own ``Scheduler`` with the scripted children under vLLM's
own ``MultiConnector``; nothing of the guard is involved.
"""

from __future__ import annotations

import pytest

from vllm_mooncake.compat.versions import check_vllm_version
from vllm_mooncake.testing.configs import scripted_multi
from vllm_mooncake.testing.driver import SchedulerDriver
from vllm_mooncake.testing.wedges import HOL, W1, W2, WedgeScenario, play

STALL_STEPS = 200
OLD_QUEUES = check_vllm_version() == "0.30"  # skipped_waiting: HOL wedges too
STOCK_WEDGES = [W1, W2, HOL] if OLD_QUEUES else [W1, W2]


@pytest.mark.parametrize("scenario", STOCK_WEDGES, ids=lambda s: s.name)
def test_stock_scheduler_wedges_for_good(scenario: WedgeScenario) -> None:
    d = SchedulerDriver.build(
        scenario.shape,
        scripted_multi(kv_load_failure_policy=scenario.kv_load_failure_policy),
    )
    play(d, scenario, max_steps=STALL_STEPS)
    sched = d.scheduler
    stranded = sched.requests[scenario.stranded]
    # Many consecutive steps schedule nothing ...
    assert d.zero_token_streak() >= STALL_STEPS - 10
    # ... nothing runs, so running-side preemption has no victim ...
    assert not sched.running
    # ... while a request whose receive has finished holds blocks.
    assert stranded.status.name == "WAITING_FOR_REMOTE_KVS"
    assert scenario.stranded in sched.finished_recving_kv_req_ids
    assert sched.kv_cache_manager.get_block_ids(scenario.stranded)[0]
    assert d.finished == {}


@pytest.mark.skipif(OLD_QUEUES, reason="HOL is a permanent wedge before 0.31")
def test_hol_layout_finishes_on_0_31_plus() -> None:
    """0.31+ queues the block-less C apart from B, so HOL is not a wedge."""
    d = SchedulerDriver.build(HOL.shape, scripted_multi())
    play(d, HOL, max_steps=STALL_STEPS)
    assert set(d.finished) == {"B", "C"}
