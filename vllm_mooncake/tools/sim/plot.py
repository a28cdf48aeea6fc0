"""The comparison plot: throughput and free KV blocks over simulated time.

Two panels sharing the time axis, one line per policy (from each result's
binned ``timeline``): output tokens per simulated second on the client-facing
ranks, and free blocks summed over the decode (or single) ranks. Stall
intervals longer than :data:`SHADE_MIN_STEPS` steps are shaded in the
policy's colour; a wedged run's line ends where the run stopped, marked x.
matplotlib runs headless (Agg); nothing is shown, the PNG is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_mooncake.tools.sim.results import RunResult

SHADE_MIN_STEPS = 20
# Policies often coincide (reserve and reserve+lateral when the valve stays
# shut): a line style each keeps both visible.
STYLES = ("-", "--", ":", "-.")


def _serving_ranks(result: RunResult) -> list[str]:
    return [r.name for r in result.ranks if r.role != "prefill"]


def _free_blocks(result: RunResult) -> list[int]:
    series = result.timeline.get("free_blocks", {})
    names = _serving_ranks(result)
    columns = [series[n] for n in names if n in series]
    return [sum(values) for values in zip(*columns, strict=True)] if columns else []


def plot_results(
    results: Sequence[RunResult], path: str | Path, title: str = ""
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    end = max((r.sim_seconds for r in results), default=0.0)
    for i, result in enumerate(results):
        style = {"color": colors[i % len(colors)], "linestyle": STYLES[i % len(STYLES)]}
        _draw(top, bottom, result, style, end)
    top.set_ylabel("output tokens / s")
    bottom.set_ylabel("free KV blocks\n(decode ranks)")
    bottom.set_xlabel("simulated time (s)")
    top.legend(loc="upper right", fontsize="small")
    top.set_title(title or (results[0].scenario if results else ""))
    fig.text(
        0.01,
        0.01,
        f"shaded: a rank stalled >= {SHADE_MIN_STEPS} steps (no token, work waiting); "
        "x: a wedged run stopped (0 tokens/s from there on)",
        fontsize="x-small",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw(
    top: Any, bottom: Any, result: RunResult, style: dict[str, str], end: float
) -> None:
    t = result.timeline.get("t", [])
    label = f"{result.policy} ({result.outcome})"
    top.plot(t, result.timeline.get("throughput_tok_s", []), label=label, **style)
    free = _free_blocks(result)
    if free:
        bottom.plot(t, free, label=label, **style)
    color = style["color"]
    if result.wedged and t:
        top.plot([t[-1]], [0], marker="x", color=color, markersize=10)
        top.plot([t[-1], end], [0, 0], color=color, linestyle=":", linewidth=2)
    for stall in result.stalls:
        if stall["steps"] >= SHADE_MIN_STEPS:
            for ax in (top, bottom):
                ax.axvspan(stall["start_s"], stall["end_s"], color=color, alpha=0.15)
