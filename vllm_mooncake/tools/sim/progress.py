"""A one-line progress bar on stderr for long runs (no dependency).

Redrawn at most every :data:`REDRAW_S` wall seconds, and only once the run
has lasted :data:`SHOW_AFTER_S` (short runs print nothing); :meth:`close`
clears the line.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_S = 0.5
SHOW_AFTER_S = 1.0
WIDTH = 24


class ProgressLine:
    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self._start = time.monotonic()
        self._last = 0.0
        self._shown = False

    def __call__(self, now_s: float, completed: int, total: int, steps: int) -> None:
        wall = time.monotonic()
        if wall - self._start < SHOW_AFTER_S or wall - self._last < REDRAW_S:
            return
        self._last = wall
        self._shown = True
        done = int(WIDTH * completed / total) if total else WIDTH
        bar = "#" * done + "-" * (WIDTH - done)
        self.stream.write(
            f"\r{self.label} [{bar}] {completed}/{total} requests, "
            f"t={now_s:.1f}s sim, {steps} steps, {wall - self._start:.0f}s wall "
        )
        self.stream.flush()

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
