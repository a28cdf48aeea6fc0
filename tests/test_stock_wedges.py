"""Red lights: stock vLLM stalls for good on the catalogue's wedges -- on the
releases where it does, and only there.

These run vLLM's own ``Scheduler`` with the scripted children under vLLM's
own ``MultiConnector``; nothing of the guard is involved. Each scenario runs
with its own config and with vLLM's default config; where the installed
release is in the scenario's ``wedges_on`` (``wedges_on_defaults``) it must
stall for good, elsewhere every request must finish (tests/test_vllm_releases.py
runs this file on every release 0.19-0.34).
"""

from __future__ import annotations

import pytest

from vllm_mooncake.compat.versions import check_vllm_version
from vllm_mooncake.testing.configs import scripted_multi
from vllm_mooncake.testing.driver import SchedulerDriver
from vllm_mooncake.testing.wedges import CATALOGUE, HOL, WedgeScenario, play

STALL_STEPS = 200
SERIES = check_vllm_version()
CASES = [
    pytest.param(scenario, config, id=f"{scenario.name}-{config}")
    for scenario in CATALOGUE.values()
    for config in ("own-config", "defaults")
]


def run_stock(scenario: WedgeScenario, steps: int = STALL_STEPS) -> SchedulerDriver:
    d = SchedulerDriver.build(
        scenario.shape,
        scripted_multi(kv_load_failure_policy=scenario.kv_load_failure_policy),
    )
    play(d, scenario, max_steps=steps)
    return d


def assert_wedged(d: SchedulerDriver, scenario: WedgeScenario) -> None:
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


@pytest.mark.parametrize(("scenario", "config"), CASES)
def test_stock_scheduler_wedges_where_the_release_does(
    scenario: WedgeScenario, config: str
) -> None:
    wedges_on = scenario.wedges_on
    if config == "defaults":
        scenario, wedges_on = (
            scenario.with_default_config(),
            scenario.wedges_on_defaults,
        )
    d = run_stock(scenario)
    if SERIES in wedges_on:
        assert_wedged(d, scenario)
    else:
        # Not a wedge on this release: every request ends (finishes, or
        # errors out on a failed load under kv_load_failure_policy=fail).
        assert set(d.finished) == {a.req_id for a in scenario.arrivals}
        assert not d.scheduler.has_requests()


@pytest.mark.skipif(SERIES in HOL.wedges_on, reason="HOL is a permanent wedge here")
def test_hol_layout_finishes_on_0_31_plus() -> None:
    """0.31+ queues the block-less C apart from B, so HOL is not a wedge."""
    d = run_stock(HOL)
    assert set(d.finished) == {"B", "C"}
