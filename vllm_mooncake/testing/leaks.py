"""Leak checks in the spirit of vLLM's ``assert_scheduler_empty``."""

from __future__ import annotations

from typing import Any


def scheduler_leaks(scheduler: Any) -> list[str]:
    """Everything a drained scheduler still holds; empty when clean."""
    problems: list[str] = []

    def check(name: str, value: Any) -> None:
        if value:
            problems.append(f"{name} not empty: {value!r}")

    check("requests", list(scheduler.requests))
    check("running", [r.request_id for r in scheduler.running])
    check("waiting", [r.request_id for r in scheduler.waiting])
    # 0.31+ keeps holders in kv_holding_waiting; 0.30 blocked ones in
    # skipped_waiting. Check whichever this release has.
    for queue in ("kv_holding_waiting", "skipped_waiting", "deferred_waiting"):
        if hasattr(scheduler, queue):
            check(queue, [r.request_id for r in getattr(scheduler, queue)])
    check("finished_recving_kv_req_ids", scheduler.finished_recving_kv_req_ids)
    check("failed_recving_kv_req_ids", scheduler.failed_recving_kv_req_ids)
    check("_inflight_prefills", [r.request_id for r in scheduler._inflight_prefills])
    manager = scheduler.kv_cache_manager
    for i, single in enumerate(manager.coordinator.single_type_managers):
        check(f"group {i} req_to_blocks", dict(single.req_to_blocks))
    pool = manager.block_pool
    held = [b.block_id for b in pool.blocks if b.ref_cnt and not b.is_null]
    check("blocks with ref_cnt > 0", held)
    free, total = pool.get_num_free_blocks(), pool.num_gpu_blocks - 1
    if free != total:
        problems.append(f"free blocks {free} != pool {total}")
    return problems


def assert_scheduler_empty(scheduler: Any) -> None:
    """Fail with every leak listed, not only the first."""
    problems = scheduler_leaks(scheduler)
    assert not problems, "scheduler leaks:\n  " + "\n  ".join(problems)
