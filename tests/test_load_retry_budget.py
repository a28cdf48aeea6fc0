"""The load-retry budget, on vLLM's real 0.32 scheduler.

Under ``kv_load_failure_policy=recompute`` a failed async load sends the
request back to the head of the queue with nothing computed; the next
lookup asks the store again, which offers the same hit again. A store that
keeps failing that load (its segment's owner died) makes the request reload
forever: no token, and no wedge either -- the engine is busy loading.
Stock vLLM loops; the guard counts failed loads per request and child, and
after ``max_failed_loads`` of them reports no external hit for the request,
so vLLM prefills it locally and it finishes.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_mooncake.guard.config import GuardConfig, GuardConfigError
from vllm_mooncake.testing.configs import guarded, scripted_multi, store_hit
from vllm_mooncake.testing.driver import (
    SAMPLED_TOKEN_ID,
    EngineShape,
    SchedulerDriver,
)
from vllm_mooncake.testing.leaks import assert_scheduler_empty

STORE = "ScriptedLoadConnector[0]"
PROMPT = 8 * 16
STEPS = 80
SIDE_LOGGER = "vllm.vllm_mooncake.guard.ownership"


def _always_failing(**more: object) -> dict[str, object]:
    """A store hit of the whole prompt whose every load fails."""
    return store_hit(PROMPT, 1, outcome="fail", **more)


def _guarded(async_scheduling: bool = False, **guard: Any) -> SchedulerDriver:
    return SchedulerDriver.build(
        EngineShape(async_scheduling=async_scheduling),
        guarded(kv_load_failure_policy="recompute", **guard),
    )


def _tokens(d: SchedulerDriver, req_id: str) -> list[int]:
    """Every token the engine emitted for ``req_id``, in order."""
    out: list[int] = []
    for step in d.steps:
        for outputs in step.engine_outputs.values():
            for o in outputs.outputs:
                if o.request_id == req_id:
                    out += o.new_token_ids
    return out


def test_stock_reloads_a_failing_store_hit_forever() -> None:
    """Red: stock vLLM (MultiConnector, vLLM's Scheduler) under recompute."""
    d = SchedulerDriver.build(
        EngineShape(), scripted_multi(kv_load_failure_policy="recompute"), Scheduler
    )
    d.add("A", PROMPT, max_tokens=4, kv_transfer_params=_always_failing())
    d.run(STEPS)
    assert d.finished == {}
    assert sum(s.num_scheduled_tokens for s in d.steps) == 0
    loads = d.worker.started.count("A")
    assert loads >= STEPS // 4, loads  # one failed load every other step
    store = d.scheduler.connector._connectors[0]
    assert store.lookups.count("A") >= loads  # looked up again and again
    assert d.status("A") in ("WAITING", "WAITING_FOR_REMOTE_KVS")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_guard_computes_locally_after_max_failed_loads(
    async_scheduling: bool, guard_log: pytest.LogCaptureFixture
) -> None:
    """Green: same store, the guard; K = the default 3."""
    d = _guarded(async_scheduling)
    k = GuardConfig().max_failed_loads
    assert k == 3
    d.add("A", PROMPT, max_tokens=4, kv_transfer_params=_always_failing())
    steps = d.run(STEPS)
    assert d.finished == {"A": "length"}
    assert _tokens(d, "A") == [SAMPLED_TOKEN_ID] * 4
    assert d.worker.started.count("A") == k  # K loads, then no more
    assert len(steps) < 30
    side = d.scheduler.wedge_guard
    assert side.stats.load_retry_cutoffs == {STORE: 1}
    lines = [r.getMessage() for r in guard_log.records if "max_failed_loads" in r.msg]
    assert len(lines) == 1 and "request A: 3 loads from" in lines[0]
    assert_scheduler_empty(d.scheduler)
    assert len(side.ledger) == 0


@pytest.mark.parametrize("k", [1, 5])
def test_the_budget_is_max_failed_loads(k: int) -> None:
    d = _guarded(max_failed_loads=k)
    d.add("A", PROMPT, max_tokens=2, kv_transfer_params=_always_failing())
    d.run(STEPS)
    assert d.finished == {"A": "length"}
    assert d.worker.started.count("A") == k
    assert d.scheduler.wedge_guard.stats.load_retry_cutoffs == {STORE: 1}


def test_a_load_that_succeeds_within_the_budget_is_kept() -> None:
    """Two failures, then the store delivers: the third load is taken, no
    cut-off, the request is not recomputed from scratch."""
    d = _guarded()
    d.add(
        "A",
        PROMPT,
        max_tokens=2,
        kv_transfer_params=_always_failing(failing_attempts=2),
    )
    d.run(STEPS)
    assert d.finished == {"A": "length"}
    assert d.worker.started.count("A") == 3
    assert d.scheduler.wedge_guard.stats.load_retry_cutoffs == {}
    prefill = sum(s.num_scheduled_tokens for s in d.steps)
    assert prefill < PROMPT  # the loaded KV was used


def test_the_budget_is_per_request() -> None:
    """Each request spends its own budget; one cut-off per request."""
    d = _guarded(max_failed_loads=2)
    d.add("A", PROMPT, max_tokens=2, kv_transfer_params=_always_failing())
    d.add("B", PROMPT, max_tokens=2, kv_transfer_params=_always_failing())
    d.run(STEPS)
    assert d.finished == {"A": "length", "B": "length"}
    assert d.worker.started.count("A") == d.worker.started.count("B") == 2
    assert d.scheduler.wedge_guard.stats.load_retry_cutoffs == {STORE: 2}
    assert_scheduler_empty(d.scheduler)


def test_a_failed_sync_load_counts_through_invalid_blocks() -> None:
    """A sync load reports its failure as invalid blocks of a running
    request (no receive notice); the guard counts it against the owner."""
    d = _guarded()
    d.add(
        "A",
        PROMPT,
        max_tokens=3,
        kv_transfer_params=_always_failing(**{"async": False}),
    )
    d.step()  # looked up, allocated, scheduled with its sync load
    d.step()  # the worker reports the invalid blocks
    side = d.scheduler.wedge_guard
    assert side.ledger.failed_loads("A", STORE) == 1
    d.run(STEPS)
    assert d.finished == {"A": "length"}
    assert side.stats.load_retry_cutoffs == {}  # one failure, within budget
    assert_scheduler_empty(d.scheduler)


@pytest.mark.parametrize("bad", [0, 1001, "3", True])
def test_max_failed_loads_is_validated_with_the_field_named(bad: object) -> None:
    with pytest.raises(GuardConfigError, match=r"wedge_guard\.max_failed_loads: "):
        GuardConfig.from_extra_config({"wedge_guard": {"max_failed_loads": bad}})


def test_reserve_keeps_upstreams_behaviour() -> None:
    """Under ``reserve`` (the guard only observes admission) the budget is
    off: the request loops as on stock vLLM."""
    d = _guarded(policy="reserve")
    d.add("A", PROMPT, max_tokens=2, kv_transfer_params=_always_failing())
    d.run(STEPS)
    assert d.finished == {}
    assert d.worker.started.count("A") > GuardConfig().max_failed_loads
    assert d.scheduler.wedge_guard.stats.load_retry_cutoffs == {}
