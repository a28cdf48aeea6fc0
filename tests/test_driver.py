"""The driver runs vLLM's real 0.32 Scheduler; only the GPU is fake."""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_mooncake.testing.configs import (
    STORE_KEY,
    pd_transfer,
    scripted_multi,
    scripted_single,
    store_hit,
)
from vllm_mooncake.testing.driver import (
    EngineShape,
    SchedulerDriver,
    WorkerProtocolError,
)
from vllm_mooncake.testing.leaks import assert_scheduler_empty, scheduler_leaks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_run_to_completion(async_scheduling: bool) -> None:
    d = SchedulerDriver.build(EngineShape(async_scheduling=async_scheduling))
    assert type(d.scheduler) is (AsyncScheduler if async_scheduling else Scheduler)
    for i in range(3):
        d.add(f"r{i}", 40, max_tokens=4)
    # (1) one step prefills all three prompts together
    first = d.step()
    assert first.num_scheduled_tokens == 120
    d.run(20)
    assert d.finished == {"r0": "length", "r1": "length", "r2": "length"}
    assert_scheduler_empty(d.scheduler)


def test_chunked_prefill_samples_only_at_the_end() -> None:
    d = SchedulerDriver.build(EngineShape(max_num_batched_tokens=64))
    d.add("long", 150, max_tokens=2)
    chunks = [d.step().num_scheduled_tokens for _ in range(3)]
    assert chunks == [64, 64, 22]
    d.run(10)
    assert d.finished == {"long": "length"}
    assert_scheduler_empty(d.scheduler)


def test_async_load_parks_then_promotes_then_finishes() -> None:
    d = SchedulerDriver.build(EngineShape(), scripted_single(STORE_KEY))
    d.add("a", 64, max_tokens=3, kv_transfer_params=store_hit(48, done_after=2))
    # (1a) admission: the load is async, nothing is computed yet
    s0 = d.step()
    assert s0.num_scheduled_tokens == 0
    assert d.status("a") == "WAITING_FOR_REMOTE_KVS"
    assert d.num_free_blocks == d.num_usable_blocks - 3  # 48 tokens = 3 blocks
    # (1b) the worker is still receiving
    assert d.step().num_scheduled_tokens == 0
    receive_done = d.step()
    assert receive_done.kv_connector_output.finished_recving == {"a"}
    # (2) promoted: only the 16 tokens past the hit are computed
    s3 = d.step()
    assert s3.scheduler_output.num_scheduled_tokens == {"a": 16}
    d.run(10)
    assert d.finished == {"a": "length"}
    assert_scheduler_empty(d.scheduler)


def test_failed_load_under_fail_policy_errors_the_request() -> None:
    d = SchedulerDriver.build(EngineShape(), scripted_single(STORE_KEY))
    d.add("a", 64, kv_transfer_params=store_hit(48, outcome="fail"))
    d.run(10)
    assert d.finished == {"a": "error"}
    assert_scheduler_empty(d.scheduler)


def test_multiconnector_children_are_real_and_scripted() -> None:
    d = SchedulerDriver.build(EngineShape(), scripted_multi())
    d.add("p", 64, max_tokens=2, kv_transfer_params=pd_transfer(done_after=0))
    d.run(10)
    assert d.finished == {"p": "length"}
    assert d.worker.started == ["p"]
    assert_scheduler_empty(d.scheduler)


def test_leak_check_reports_held_blocks() -> None:
    d = SchedulerDriver.build(EngineShape(), scripted_single(STORE_KEY))
    d.add("a", 64, kv_transfer_params=store_hit(48, done_after=50))
    d.step()
    problems = scheduler_leaks(d.scheduler)
    assert any("free blocks" in p for p in problems)
    # 0.31+ parks it in kv_holding_waiting, 0.30 in skipped_waiting
    assert any(q in p for p in problems for q in ("kv_holding", "skipped_waiting"))


def test_worker_protocol_rejects_resume_of_unknown_request() -> None:
    d = SchedulerDriver.build(EngineShape())
    d.add("r", 40, max_tokens=4)
    d.step()
    d._worker_requests.clear()  # the worker forgets it: next step must be refused
    with pytest.raises(WorkerProtocolError, match="never saw it as new"):
        d.step()


def test_model_info_cache_is_project_local() -> None:
    """vLLM's model inspection (about 12 s cold) is cached under our folder."""
    from vllm_mooncake.offline import cache_dir

    SchedulerDriver.build(EngineShape())
    cached = list((cache_dir() / "vllm").rglob("*LlamaForCausalLM*.json"))
    assert cached, "vLLM's modelinfos cache is not under the project cache"
