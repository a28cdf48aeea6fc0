"""A child connector that raises in a per-request hook ends that request, not the rank.

The scripted children raise where their script says (``raise_in``); this is
the one fake here besides the GPU and the transport: a buggy connector.
Stock MultiConnector lets the exception out of ``schedule()`` /
``update_from_output()`` -- in a server that ends the engine core and every
request on it. The guard contains it (``guard/containment.py``): the faulty
request gets the outcome vLLM knows for it (computed locally, a failed load
under ``kv_load_failure_policy``, or its blocks freed), the other requests
are untouched, and nothing leaks.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_mooncake.testing.configs import (
    guarded,
    pd_transfer,
    scripted_multi,
    store_hit,
)
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver
from vllm_mooncake.testing.leaks import assert_scheduler_empty
from vllm_mooncake.testing.scripted_connector import ScriptedChildFault

BLOCK = EngineShape().block_size
PROMPT = 6 * BLOCK
MAX_STEPS = 60


def _faulty(hook: str, sync_load: bool = False) -> dict[str, Any]:
    if sync_load:
        return store_hit(3 * BLOCK, 0, raise_in=hook, **{"async": False})
    if hook == "lookup":
        return store_hit(3 * BLOCK, 1, raise_in=hook)
    return pd_transfer(1, raise_in=hook)


def _play(config: dict[str, Any], params: dict[str, Any]) -> SchedulerDriver:
    d = SchedulerDriver.build(EngineShape(), config)
    d.add("faulty", PROMPT, max_tokens=4, kv_transfer_params=params)
    d.add("healthy", PROMPT, max_tokens=4, kv_transfer_params=pd_transfer(1))
    d.run(MAX_STEPS)
    return d


CASES = [
    # (hook, sync load?, kv_load_failure_policy, how the faulty request ends)
    ("lookup", False, "fail", "length"),  # computed locally
    ("alloc", False, "recompute", "length"),  # failed load, recomputed
    ("alloc", False, "fail", "error"),  # failed load, failed request
    ("alloc", True, "recompute", "length"),
    ("alloc", True, "fail", "error"),
    ("finished", False, "fail", "length"),  # blocks freed as usual
]


def _id(case: tuple[str, bool, str, str]) -> str:
    hook, sync_load, policy, _ = case
    return f"{hook}-{'sync' if sync_load else 'async'}-{policy}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_stock_multiconnector_lets_the_fault_out(
    case: tuple[str, bool, str, str],
) -> None:
    hook, sync_load, policy, _ = case
    with pytest.raises(ScriptedChildFault):
        _play(scripted_multi(kv_load_failure_policy=policy), _faulty(hook, sync_load))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_guard_contains_the_fault_to_its_request(
    case: tuple[str, bool, str, str],
) -> None:
    hook, sync_load, policy, ending = case
    d = _play(guarded(kv_load_failure_policy=policy), _faulty(hook, sync_load))
    assert d.finished == {"faulty": ending, "healthy": "length"}
    guard = d.scheduler.wedge_guard
    owner = "ScriptedLoadConnector"
    assert sum(guard.stats.child_errors.values()) >= 1
    assert all(key.startswith(owner) for key in guard.stats.child_errors)
    assert any(key.endswith(hook_name(hook)) for key in guard.stats.child_errors)
    assert_scheduler_empty(d.scheduler)
    assert len(guard.ledger) == 0


def hook_name(hook: str) -> str:
    return {
        "lookup": "get_num_new_matched_tokens",
        "alloc": "update_state_after_alloc",
        "finished": "request_finished",
    }[hook]


def test_a_recomputed_load_that_never_started_prefills_its_whole_prompt() -> None:
    """The failed-load path really recomputes: the faulty request's prompt
    is scheduled in full after the contained fault, not taken as loaded."""
    d = SchedulerDriver.build(
        EngineShape(), guarded(kv_load_failure_policy="recompute")
    )
    d.add("faulty", PROMPT, max_tokens=2, kv_transfer_params=_faulty("alloc"))
    scheduled = 0
    for _ in range(MAX_STEPS):
        if not d.scheduler.has_requests():
            break
        result = d.step()
        scheduled += result.scheduler_output.num_scheduled_tokens.get("faulty", 0)
    assert d.finished == {"faulty": "length"}
    # Prompt prefilled locally, then one decode step (the first token comes
    # from the prefill).
    assert scheduled == PROMPT + 1


def test_unstarted_load_is_reported_through_an_empty_output_without_mutating_it() -> (
    None
):
    """With nothing scheduled, vLLM passes its shared EMPTY_MODEL_RUNNER_OUTPUT
    to update_from_output; the guard reports the failed load on a copy."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    d = SchedulerDriver.build(
        EngineShape(), guarded(kv_load_failure_policy="recompute")
    )
    d.add("faulty", PROMPT, max_tokens=2, kv_transfer_params=_faulty("alloc"))
    sched = d.scheduler
    output = sched.schedule()
    assert sched.requests["faulty"].status.name == "WAITING_FOR_REMOTE_KVS"
    sched.update_from_output(output, EMPTY_MODEL_RUNNER_OUTPUT)
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None
    assert "faulty" in sched.finished_recving_kv_req_ids
    assert "faulty" in sched.failed_recving_kv_req_ids
