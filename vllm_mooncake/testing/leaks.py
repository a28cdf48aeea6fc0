"""Leak checks in the spirit of vLLM's ``assert_scheduler_empty``.

Covers the waiting state of every release 0.19-0.34: the holder queues
(``skipped_waiting`` up to 0.30, ``kv_holding_waiting`` + ``deferred_waiting``
from 0.31), 0.34's ``async_kv_waiting``, the async-load reservation
(``_inflight_prefills``, 0.23+) and 0.34's parked reservations, the KV-fetch
stages (0.32+; on 0.34 they are the slots of ``max_num_inflight_kv_loads``),
0.33+'s deferred loads and 0.34's aborted-load slots.
"""

from __future__ import annotations

from typing import Any


def scheduler_leaks(scheduler: Any) -> list[str]:
    """Everything a drained scheduler still holds; empty when clean."""
    problems: list[str] = []

    def check(name: str, value: Any) -> None:
        if value:
            problems.append(f"{name} not empty: {value!r}")

    def ids(requests: Any) -> list[str]:
        return [r.request_id for r in requests]

    problems += waiting_state_leaks(scheduler)
    check("requests", list(scheduler.requests))
    check("running", ids(scheduler.running))
    check("waiting", ids(scheduler.waiting))
    # Whichever queues this release has.
    for queue in (
        "kv_holding_waiting",
        "skipped_waiting",
        "deferred_waiting",
        "async_kv_waiting",
    ):
        if hasattr(scheduler, queue):
            check(queue, ids(getattr(scheduler, queue)))
    check("finished_recving_kv_req_ids", scheduler.finished_recving_kv_req_ids)
    check("failed_recving_kv_req_ids", scheduler.failed_recving_kv_req_ids)
    if hasattr(scheduler, "_inflight_prefills"):  # 0.23+
        check("_inflight_prefills", ids(scheduler._inflight_prefills))
    if hasattr(scheduler, "_parked_reservations"):  # 0.34
        check("_parked_reservations", ids(scheduler._parked_reservations))
        if scheduler._parked_reserved_blocks != 0:
            problems.append(
                f"_parked_reserved_blocks {scheduler._parked_reserved_blocks} != 0"
            )
    if getattr(scheduler, "_kv_fetch_stages", None):  # 0.32+, when kept
        check("_kv_fetch_stages", dict(scheduler._kv_fetch_stages))
    counts = getattr(scheduler, "_kv_fetch_counts", None)
    if counts:
        check("_kv_fetch_counts", {k: v for k, v in dict(counts).items() if v})
    check("deferred_loads", dict(getattr(scheduler, "deferred_loads", None) or {}))
    check("_aborted_kv_loads", set(getattr(scheduler, "_aborted_kv_loads", ())))
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


def waiting_state_leaks(scheduler: Any) -> list[str]:
    """State that outlives its reason, checkable after any step (0.34).

    vLLM 0.34 parks an async load's reservation while the request waits in
    ``kv_holding_waiting`` (from the load's start until its admission) and
    drops it when the request is admitted or freed. A parked reservation of
    a request anywhere else -- e.g. a lateral victim back in ``waiting`` --
    still counts against every admission: a leak, even if a later re-park
    of the same request would overwrite it.
    """
    parked = getattr(scheduler, "_parked_reservations", None)
    if not parked:
        return []
    holding = set(scheduler.kv_holding_waiting)
    stray = sorted(r.request_id for r in parked if r not in holding)
    if stray:
        return [
            f"_parked_reservations held by requests not parked in "
            f"kv_holding_waiting: {stray} ({scheduler._parked_reserved_blocks} "
            "blocks reserved in all)"
        ]
    return []


def assert_waiting_state_clean(scheduler: Any) -> None:
    """:func:`waiting_state_leaks` as an assertion (after any step)."""
    problems = waiting_state_leaks(scheduler)
    assert not problems, "scheduler leaks:\n  " + "\n  ".join(problems)


def assert_scheduler_empty(scheduler: Any) -> None:
    """Fail with every leak listed, not only the first."""
    problems = scheduler_leaks(scheduler)
    assert not problems, "scheduler leaks:\n  " + "\n  ".join(problems)
