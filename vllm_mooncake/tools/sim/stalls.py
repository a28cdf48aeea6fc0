"""Stalls and wedges of one rank, step by step.

A step is *blocked* when it scheduled no token although the rank had a
request that was not waiting for a transfer still in flight: the scheduler
had work and did none of it (admission failed, a head-of-line holder, blocks
held by leases). Waiting for a receive to land is not a stall.

A blocked step is *resolvable* when something in flight could still change
the rank's state by itself: a receive the worker has not reported yet, or
blocks this (prefill) rank holds for a decode rank's pull. A rank is
**wedged** once ``wedge_steps`` consecutive blocked steps had nothing
resolvable -- nothing but a lateral preemption (or an abort) can end it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Stall intervals shorter than this are counted but not listed.
MIN_LISTED_STEPS = 2
# At most this many intervals are listed per rank (the longest stalls are
# always summarised by max_stall_steps).
MAX_LISTED = 2000


@dataclass(frozen=True)
class StallInterval:
    start_s: float
    end_s: float
    steps: int


@dataclass
class StallTracker:
    wedge_steps: int
    streak: int = 0  # consecutive blocked steps, ending at the last step
    streak_start_s: float = 0.0
    max_streak: int = 0
    stalled_s: float = 0.0  # simulated seconds spent in blocked steps
    blocked_steps: int = 0
    wedge_streak: int = 0  # ... of which nothing was in flight
    intervals: list[StallInterval] = field(default_factory=list)
    _last_end_s: float = 0.0

    @property
    def wedged(self) -> bool:
        return self.wedge_streak >= self.wedge_steps

    def observe(
        self, start_s: float, end_s: float, blocked: bool, resolvable: bool
    ) -> None:
        if blocked:
            if self.streak == 0:
                self.streak_start_s = start_s
            self.streak += 1
            self.blocked_steps += 1
            self.stalled_s += end_s - start_s
            self.max_streak = max(self.max_streak, self.streak)
            self.wedge_streak = 0 if resolvable else self.wedge_streak + 1
            self._last_end_s = end_s
        else:
            self._close()
            self.wedge_streak = 0

    def restart_wedge_count(self) -> None:
        """Count the wedge anew (the stall itself goes on being measured)."""
        self.wedge_streak = 0

    def finish(self) -> None:
        """Close the stall in progress at the end of the run."""
        self._close()

    def _close(self) -> None:
        if self.streak >= MIN_LISTED_STEPS and len(self.intervals) < MAX_LISTED:
            self.intervals.append(
                StallInterval(self.streak_start_s, self._last_end_s, self.streak)
            )
        self.streak = 0
