"""Where the guard's scheduler overhead goes: CPU time per hook, in place.

``bench/overhead.py`` times whole steps; this splits them. The same closed
loop runs stock and guarded side by side (interleaved chunks, as there),
with a CPU-time wrapper around each connector hook vLLM calls and each
scheduler method the guard overrides or adds. The table lists, per hook,
the microseconds per step in each variant and the calls per step: the
difference is what the guard adds there, measured in the running loop
(cold caches included), where a micro-benchmark of one hook in a tight loop
reads about a third of it.

Rows nest where the calls do (``add_request`` holds ``on_new_request``,
``_update_from_kv_xfer_finished`` holds ``update_connector_output``,
``wedge_guard.watch.after_schedule`` holds ``guard_holders.census``,
``request_finished_all_groups`` holds
``request_finished``). The guard's own rows are its public parts
(``guard_valve``, ``guard_holders``, the scheduler side's rooms), never a
private name. Each wrapper adds about the same time to both variants. ::

    python bench/overhead_hooks.py                # 256 running, 16 x 30 steps
    python bench/overhead_hooks.py --size 1024 --rounds 8
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from _util import machine, setup, table
from overhead import STOCK, Variant

GUARDED = "reserve+lateral"
CONNECTOR_HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "get_kv_connector_stats",
    "take_events",
    "request_finished",
    "request_finished_all_groups",
)
SCHEDULER_METHODS = (
    "add_request",
    "finish_requests",
    "_handle_blocked_waiting_request",
    "_inflight_prefill_reserved_blocks",
    "_update_from_kv_xfer_finished",
)
# The guard's parts (a path of public attributes from the scheduler) and the
# method of each that runs per step.
GUARD_ONLY = (
    ("guard_valve", "arm"),
    ("wedge_guard.watch", "after_schedule"),
    ("guard_holders", "census"),
    ("guard_holders", "failed_loads"),
    ("wedge_guard.notices", "filter"),
    ("wedge_guard.ownership", "record_failed_loads"),
)

Totals = defaultdict[str, list[float]]  # hook -> [CPU seconds, calls]


def instrument(obj: Any, name: str, totals: Totals, label: str = "") -> None:
    """Shadow ``obj.name`` with a wrapper adding its CPU time to ``totals``
    (under ``label``, else ``name``)."""
    inner: Callable[..., Any] = getattr(obj, name)
    clock = time.thread_time

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            entry = totals[label or name]
            entry[0] += clock() - start
            entry[1] += 1

    setattr(obj, name, timed)


def instrumented(name: str, size: int) -> tuple[Variant, Totals]:
    variant = Variant(name, size, num_blocks=size * 80 + 1)
    totals: Totals = defaultdict(lambda: [0.0, 0])
    scheduler = variant.driver.scheduler
    connector = scheduler.connector
    for hook in CONNECTOR_HOOKS:
        instrument(connector, hook, totals)
    for method in SCHEDULER_METHODS:
        if hasattr(scheduler, method):
            instrument(scheduler, method, totals)
    if name != STOCK:
        for path, method in GUARD_ONLY:
            part = scheduler
            for attr in path.split("."):
                part = getattr(part, attr)
            instrument(part, method, totals, f"{path}.{method}")
    return variant, totals


def run(size: int, rounds: int, chunk: int, warmup: int) -> str:
    pairs = [instrumented(name, size) for name in (STOCK, GUARDED)]
    for variant, totals in pairs:
        variant.steps(warmup, record=False)
        totals.clear()
    for i in range(rounds):
        for variant, _ in pairs if i % 2 == 0 else pairs[::-1]:
            gc.collect()
            variant.steps(chunk, record=True)
    (stock, stock_totals), (guarded, guarded_totals) = pairs
    steps = stock.timing.steps
    rows = []
    for hook in sorted(set(stock_totals) | set(guarded_totals)):
        s_cpu, s_calls = stock_totals.get(hook, (0.0, 0))
        g_cpu, g_calls = guarded_totals.get(hook, (0.0, 0))
        rows.append(
            (
                hook,
                f"{s_cpu / steps * 1e6:.1f}",
                f"{g_cpu / steps * 1e6:.1f}",
                f"{(g_cpu - s_cpu) / steps * 1e6:+.1f}",
                f"{max(s_calls, g_calls) / steps:.2f}",
            )
        )
    whole = [v.timing.cpu_s / v.timing.steps * 1e6 for v in (stock, guarded)]
    rows.append(
        (
            "whole step",
            f"{whole[0]:.0f}",
            f"{whole[1]:.0f}",
            f"{whole[1] - whole[0]:+.0f}",
            "",
        )
    )
    headers = ("hook", "stock us/step", "guarded us/step", "difference", "calls/step")
    return table(headers, rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256, help="concurrent requests")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--chunk", type=int, default=30)
    p.add_argument("--warmup", type=int, default=150)
    args = p.parse_args(argv)
    setup()
    print(
        f"# guard overhead by hook: {args.size} concurrent, {args.rounds} rounds "
        f"x {args.chunk} steps per variant ({GUARDED} vs stock); {machine()}"
    )
    print(run(args.size, args.rounds, args.chunk, args.warmup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
