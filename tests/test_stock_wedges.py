"""Red lights: stock vLLM 0.32 stalls for good on the catalogue's wedges.

These run vLLM's own ``Scheduler`` with the scripted children under vLLM's
own ``MultiConnector``; nothing of the guard is involved.
"""

from __future__ import annotations

import pytest

from vllm_mooncake.testing.configs import scripted_multi
from vllm_mooncake.testing.driver import SchedulerDriver
from vllm_mooncake.testing.wedges import W1, W2, WedgeScenario, play

STALL_STEPS = 200


@pytest.mark.parametrize("scenario", [W1, W2], ids=lambda s: s.name)
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
