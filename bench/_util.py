"""Shared helpers of the bench scripts: set-up, tables, summary statistics."""

from __future__ import annotations

import math
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def setup() -> None:
    """Quiet vLLM (the tables are the output) and register the plugin."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_mooncake.tools.sim.logs import quiet_vllm

    quiet_vllm()
    import logging

    # The guard logs a WARNING per resolved wedge and vLLM an ERROR per
    # failed load; the benches count them instead.
    logging.disable(logging.ERROR)
    from vllm_mooncake.plugin import register

    register()


def machine() -> str:
    """One line naming the machine the figures come from."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"machine: {os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}, load average {load:.2f} at start"
    )


def geomean(values: Sequence[float]) -> float:
    """Geometric mean of positive ratios (nan if there is none)."""
    positive = [v for v in values if v > 0]
    if not positive:
        return float("nan")
    return math.exp(sum(math.log(v) for v in positive) / len(positive))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: first column left-aligned, the others right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    out = [line(cells[0]), "-" * len(line(cells[0]))]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)
