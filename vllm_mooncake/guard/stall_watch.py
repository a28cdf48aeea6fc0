"""The stall watch: the holder gauges, the wedge alarm and the resolution log line.

A room of the guard's scheduler side (``docs/architecture.md``), told once
per ``schedule()`` call by the guarded scheduler
(:meth:`StallWatch.after_schedule`):

1. a busy call (tokens scheduled, or requests running) is no stall: the
   watch starts over (:meth:`StallWatch.note_no_stall`), and the waiting
   holders are recounted only when their gauges are due (``gauge_interval_s``,
   :meth:`StallWatch.census_due`);
2. a call that scheduled nothing, or made a lateral preemption, always has
   the holders counted (:class:`StepObservation`, by the scheduler's
   :class:`HolderCensus`) and observed (:meth:`StallWatch.observe_step`):
   the gauges are set, a lateral preemption is logged (WARNING) and counted
   as a resolved wedge, and zero-token steps with holders waiting, nothing
   running and no receive in flight are a stall -- ``stall_alarm_steps`` of
   them (or ``stall_alarm_s``) raise the wedge alarm (ERROR), once per
   stall;
3. any step that scheduled no token starts (or continues) a spell without
   progress; once it lasted ``recv_deadline_s`` the rank is *stuck*
   (``vllm:kv_guard_stuck`` 1, a WARNING), whatever the reason -- a wedge,
   receives that never land, blocks quarantined for a silent sender. The
   first step that schedules a token ends it (INFO), and so does an engine
   left with nothing to do (:meth:`StallWatch.clear_stuck`). The
   readiness probe (``tools/ready.py``) reads the flag.

A plain module: no vLLM import (the census reads vLLM's queues behind
:class:`HolderCensus`; the guarded scheduler's is ``guard/holders.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from vllm_mooncake import logger_for
from vllm_mooncake.guard.config import GuardConfig
from vllm_mooncake.guard.ledger import BlockLedger, HolderView, Victim, WaitStatus
from vllm_mooncake.guard.stats import GuardStats

logger = logger_for(__name__)

Lateral = Sequence[tuple[Victim, str]]
"""The lateral preemptions of one ``schedule()`` call: (victim, admission target)."""


class StepObservation(NamedTuple):
    """What one ``schedule()`` call did, as the guard's gauges need it.

    The holder counts come from the scheduler's queues after the call; the
    views themselves are built only when a log line names them. A named
    tuple: one is made per step, and a frozen dataclass costs a
    ``object.__setattr__`` per field to make.
    """

    scheduled_tokens: int
    num_running: int
    lateral: Lateral
    num_holders: int = 0  # waiting requests that hold KV blocks
    recv_done_holders: int = 0  # of them, WAITING_FOR_REMOTE_KVS, recv done
    blocks_held: int = 0  # the blocks they hold
    recv_in_flight: int = 0  # holders whose receive has not landed yet

    @classmethod
    def of(
        cls,
        scheduled_tokens: int,
        num_running: int,
        lateral: Lateral,
        views: Sequence[HolderView],
    ) -> StepObservation:
        """The observation whose holders are ``views``."""
        recv_done = sum(
            1
            for v in views
            if v.status is WaitStatus.WAITING_FOR_REMOTE_KVS and v.recv_finished
        )
        blocks = sum(v.num_blocks for v in views)
        in_flight = sum(
            1
            for v in views
            if v.status is WaitStatus.WAITING_FOR_REMOTE_KVS and not v.recv_finished
        )
        return cls(
            scheduled_tokens,
            num_running,
            lateral,
            len(views),
            recv_done,
            blocks,
            in_flight,
        )


class HolderCensus(Protocol):
    """The waiting requests that hold KV blocks, read from a scheduler."""

    def may_wait(self) -> bool:
        """Whether any waiting queue has a request (a holder may wait)."""

    def census(
        self, scheduled_tokens: int, num_running: int, lateral: Lateral
    ) -> StepObservation:
        """The holders counted, without a view per holder."""

    def views(self) -> list[HolderView]:
        """One view per holder (built only for a log line)."""


class StallWatch:
    """Gauges, the wedge alarm and the resolution line (see the module docstring)."""

    def __init__(
        self, config: GuardConfig, ledger: BlockLedger, stats: GuardStats
    ) -> None:
        self.config = config
        self._ledger = ledger
        self._stats = stats
        self.clock: Callable[[], float] = time.monotonic
        # The stall being watched: zero-token steps while holders wait, none
        # runs and no receive is in flight; its start on ``clock``.
        self._stall_steps = 0
        self._stall_since = 0.0
        self._alarm_raised = False
        # When observe_step last counted the holders (census_due).
        self._last_census = -math.inf
        # Since when no step scheduled a token (None: the last one did).
        self._idle_since: float | None = None

    def after_schedule(
        self,
        scheduled_tokens: int,
        num_running: int,
        lateral: Lateral,
        holders: HolderCensus,
    ) -> None:
        """Steps 1-3 of the module docstring, once per ``schedule()`` call."""
        if scheduled_tokens > 0:
            if self._idle_since is not None:
                self.clear_stuck("tokens scheduled again")
        else:
            self._no_progress()
        if (
            (scheduled_tokens > 0 or num_running)
            and not lateral
            and not self.census_due(holders.may_wait())
        ):
            self.note_no_stall()
            return
        step = holders.census(scheduled_tokens, num_running, lateral)
        self.observe_step(step, holders.views)

    def census_due(self, holders_may_wait: bool) -> bool:
        """Whether a busy step (one that scheduled tokens or runs requests)
        recounts the waiting holders for :meth:`observe_step`.

        Only once ``gauge_interval_s`` has passed since the last count: the
        holder gauges are then at most that old while tokens flow, and a
        busy step, which cannot be a stall, costs nothing here. Always when
        no holder can be waiting (``holders_may_wait`` False: the queues
        are empty), so the gauges reach 0 on the step the last holder left,
        even if the engine then goes idle. Every step that scheduled nothing
        is counted: that is the step a wedge is made of.
        """
        if not holders_may_wait:
            return True
        return self.clock() - self._last_census >= self.config.gauge_interval_s

    def _no_progress(self) -> None:
        now = self.clock()
        if self._idle_since is None:
            self._idle_since = now
            return
        stats = self._stats
        idle = now - self._idle_since
        if not stats.stuck and idle >= self.config.recv_deadline_s:
            stats.stuck = 1
            logger.warning(
                "wedge guard: no token scheduled for %.1f s while requests wait "
                "(recv_deadline_s=%g); this rank reports itself stuck "
                "(vllm:kv_guard_stuck=1)",
                idle,
                self.config.recv_deadline_s,
            )

    def clear_stuck(self, why: str) -> None:
        """The spell without progress is over (a token was scheduled, or the
        engine has nothing left to do: it stops stepping, so no later step
        would say so); a stuck flag comes down with one INFO line."""
        self._idle_since = None
        if self._stats.stuck:
            self._stats.stuck = 0
            logger.info("wedge guard: %s; this rank is not stuck", why)

    def note_no_stall(self) -> None:
        """This step is no stall: the stall watch starts over (the alarm
        re-arms); the gauges keep their last count."""
        self._stall_steps = self._stats.stalled_steps = 0
        self._alarm_raised = False

    def observe_step(
        self, step: StepObservation, views: Callable[[], Sequence[HolderView]]
    ) -> None:
        """Gauges, the resolution WARNING and the wedge alarm, from a step
        whose holders were counted (every step that scheduled nothing; a
        busy one when :meth:`census_due`).

        ``views`` builds the holders' views; called only for a log line.
        """
        self._last_census = self.clock()
        stats = self._stats
        stats.recv_done_holders_waiting = step.recv_done_holders
        stats.blocks_held_by_non_running = step.blocks_held
        if step.lateral:
            self._report_resolution(step.lateral, views())
        # A receive in flight is a slow transfer, not a wedge: it will land.
        stalled = (
            step.scheduled_tokens == 0
            and not step.num_running
            and step.num_holders > 0
            and not step.recv_in_flight
        )
        if not stalled:
            self.note_no_stall()
            return
        if self._stall_steps == 0:
            self._stall_since = self.clock()
        self._stall_steps += 1
        stats.stalled_steps = self._stall_steps
        if not self._alarm_raised and self._stall_is_a_wedge():
            self._alarm_raised = True
            stats.wedges_detected += 1
            logger.error(
                "wedge alarm: no token scheduled for %d steps (%.1f s) while %d "
                "waiting request(s) hold %d KV blocks, none runs and no receive "
                "is in flight; policy=%s; holders: %s",
                self._stall_steps,
                self.clock() - self._stall_since,
                step.num_holders,
                stats.blocks_held_by_non_running,
                self.config.policy.value,
                self._ledger.snapshot(views()),
            )

    def _stall_is_a_wedge(self) -> bool:
        config = self.config
        if self._stall_steps >= config.stall_alarm_steps:
            return True
        return self.clock() - self._stall_since >= config.stall_alarm_s

    def _report_resolution(self, lateral: Lateral, views: Sequence[HolderView]) -> None:
        self._stats.wedges_resolved += 1
        moves = ", ".join(
            f"{v.req_id} ({v.reason.value}, owner={v.owner}, {v.num_blocks} blocks) "
            f"for {target}"
            for v, target in lateral
        )
        logger.warning(
            "wedge guard: admission failed with nothing running; lateral "
            "preemption of %s; waiting holders now: %s",
            moves,
            self._ledger.snapshot(views),
        )


__all__ = ["HolderCensus", "Lateral", "StallWatch", "StepObservation"]
