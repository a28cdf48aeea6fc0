"""The guard's scheduler side: every piece of state the guard keeps.

Built once per engine, by :class:`~vllm_mooncake.guard.connector.WedgeGuardConnector`
in its SCHEDULER role only (workers build none of it). It owns:

- the :class:`~vllm_mooncake.guard.ledger.BlockLedger` (blocks, owner, receive
  state of every request);
- the :class:`~vllm_mooncake.guard.stats.GuardStats` behind the metrics;
- the :class:`~vllm_mooncake.guard.routing.ChildRouter` (which child a
  request's ``kv_transfer_params`` name);
- the faults of children that raised (``guard/containment.py``) and the loads
  they never started;
- the receive-notice filter (vLLM's own state wins over the ledger's: a
  notice vLLM still waits on is never dropped);
- the load-retry budget (``max_failed_loads`` failed loads of one request
  from one child, then the request is computed locally).

Two audiences, two small APIs:

* the connector facade reports vLLM's connector hooks: :meth:`route`,
  :meth:`record_lookup`, :meth:`owner_first`, :meth:`record_alloc`,
  :meth:`observe_scheduler_output`, :meth:`record_finished`;
* the guarded scheduler asks and reports: :meth:`pick_victim`,
  :meth:`on_lateral_preemption`, :meth:`filter_recv_notices`,
  :meth:`record_failed_loads`, :meth:`has_unstarted_loads`,
  :meth:`has_executed`, :meth:`census_due`, :meth:`observe_step`,
  :meth:`note_no_stall`.

Nothing here imports vLLM's scheduler: requests, blocks and outputs are
read by attribute, so the class runs in unit tests with plain objects.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import fields
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from vllm_mooncake import logger_for
from vllm_mooncake.compat.releases import kv_output_has_failed_recving
from vllm_mooncake.guard.config import GuardConfig
from vllm_mooncake.guard.containment import ALLOC, ChildFault
from vllm_mooncake.guard.ledger import (
    BlockLedger,
    Disagreement,
    DroppedNotices,
    HolderView,
    LedgerError,
    RecvState,
    Victim,
    WaitStatus,
)
from vllm_mooncake.guard.routing import ChildRouter, UnroutableRequest
from vllm_mooncake.guard.stats import GuardStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logger_for(__name__)
T = TypeVar("T")

UNROUTABLE = -1
""":meth:`GuardSchedulerSide.route`'s answer for a request no child can load."""

Awaited = Callable[[str], bool]
"""Whether vLLM's scheduler still waits on a receive notice for a request."""

_LOGGED_ONCE_MAX = 65536
_NO_IDS: frozenset[str] = frozenset()
_DROPPED_KINDS = tuple(f.name for f in fields(DroppedNotices))
_dropped_counts = operator.attrgetter(*_DROPPED_KINDS)


class StepObservation(NamedTuple):
    """What one ``schedule()`` call did, as the guard's gauges need it.

    The holder counts come from the scheduler's queues after the call; the
    views themselves are built only when a log line names them. A named
    tuple: one is made per step, and a frozen dataclass costs a
    ``object.__setattr__`` per field to make.
    """

    scheduled_tokens: int
    num_running: int
    lateral: Sequence[tuple[Victim, str]]  # (victim, admission target)
    num_holders: int = 0  # waiting requests that hold KV blocks
    recv_done_holders: int = 0  # of them, WAITING_FOR_REMOTE_KVS, recv done
    blocks_held: int = 0  # the blocks they hold
    recv_in_flight: int = 0  # holders whose receive has not landed yet

    @classmethod
    def of(
        cls,
        scheduled_tokens: int,
        num_running: int,
        lateral: Sequence[tuple[Victim, str]],
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


class GuardSchedulerSide:
    """The ledger, stats, router, fault and notice state of one scheduler."""

    def __init__(
        self,
        config: GuardConfig,
        router: ChildRouter,
        requests_to_connector: dict[str, int],
        block_size: int,
    ) -> None:
        self.config = config
        self.ledger = BlockLedger()
        self.stats = GuardStats()
        self.router = router
        # MultiConnector's own map of request -> loading child (shared, not
        # copied): the facade's stock paths read and write it too.
        self._requests_to_connector = requests_to_connector
        self._block_size = block_size
        # The output filter_recv_notices last filtered (filter once per step).
        self._filtered_output: KVConnectorOutput | None = None
        # Loads whose owner raised before starting them: async ones are
        # reported as failed receives, sync ones as invalid blocks, on the
        # next update_from_output (see on_load_not_started).
        self._unstarted_recvs: set[str] = set()
        self._unstarted_blocks: set[int] = set()
        self._alloc_fault: ChildFault | None = None
        # (owner or 0, number of children) -> owner_first's order
        self._alloc_orders: dict[tuple[int, int], tuple[int, ...]] = {}
        self._last_lookup: tuple[str, int] = ("", 0)
        # The stall being watched: zero-token steps while holders wait, none
        # runs and no receive is in flight; its start on ``clock``.
        self._stall_steps = 0
        self._stall_since = 0.0
        self._alarm_raised = False
        self.clock: Callable[[], float] = time.monotonic
        # When observe_step last counted the holders (census_due).
        self._last_census = -math.inf
        # Requests whose ledger disagreement was logged (once per request).
        self._disagreement_logged: dict[str, None] = {}

    @property
    def child_names(self) -> tuple[str, ...]:
        return self.router.names

    # ---- ledger calls: log (or raise, when strict) inconsistencies --------------
    def _ledger(self, call: Callable[..., T], *args: Any) -> T | None:
        try:
            return call(*args)
        except LedgerError:
            self._ledger_refused()
            return None

    def _ledger_refused(self) -> None:
        """Called inside ``except LedgerError``: count it, then raise it again
        (strict) or log it with its traceback. The per-request hooks catch
        the error themselves (no :meth:`_ledger` frame on their path)."""
        self.stats.ledger_errors += 1
        if self.config.strict:
            raise  # the LedgerError being handled
        logger.exception("wedge guard ledger inconsistency (continuing)")

    # ---- connector hooks, reported by the facade ----------------------------------
    def on_arrival(self, req_id: str) -> None:
        try:
            self.ledger.on_arrival(req_id)
        except LedgerError:
            self._ledger_refused()

    def route(self, request: Request, num_computed_tokens: int) -> int | None:
        """The child whose ``kv_transfer_params`` ``request`` carries.

        ``None``: no child claims them (MultiConnector asks each in turn);
        :data:`UNROUTABLE`: they name no child that can load them -- the
        request is computed locally, counted and logged.
        """
        req_id = request.request_id
        self._last_lookup = (req_id, num_computed_tokens)
        try:
            return self.router.owner_for(request.kv_transfer_params)
        except UnroutableRequest as exc:
            self.stats.unroutable_requests += 1
            logger.error("request %s: %s Computing it locally instead.", req_id, exc)
            self.record_lookup(req_id, None, 0, False)
            return UNROUTABLE

    def record_lookup(
        self, req_id: str, owner: int | None, num_tokens: int, is_async: bool
    ) -> None:
        """``owner`` offers ``num_tokens`` for ``req_id``: remember who loads it."""
        if num_tokens and owner is not None:
            self._requests_to_connector[req_id] = owner
        else:
            self._requests_to_connector.pop(req_id, None)
        owner_name = self.router.names[owner] if owner is not None else None
        try:
            self.ledger.on_lookup(req_id, owner_name, num_tokens, is_async)
        except LedgerError:
            self._ledger_refused()

    def owner_first(self, req_id: str, num_children: int) -> list[int]:
        """Children in the order ``update_state_after_alloc`` must tell them:
        the owner of the load first, the others in config order."""
        return list(self.alloc_order(req_id, num_children)[1])

    def alloc_order(
        self, req_id: str, num_children: int
    ) -> tuple[int | None, tuple[int, ...]]:
        """The loading child of ``req_id`` (or None) and :meth:`owner_first`'s
        order, in one call per allocation (the orders are made once)."""
        owner = self._requests_to_connector.get(req_id)
        self._alloc_fault = None
        key = (owner or 0, num_children)
        order = self._alloc_orders.get(key)
        if order is None:
            rest = [i for i in range(num_children) if i != key[0]]
            order = self._alloc_orders[key] = (key[0], *rest)
        return owner, order

    def owner_of(self, req_id: str) -> int | None:
        """The child loading ``req_id`` (MultiConnector's choice or ours)."""
        return self._requests_to_connector.get(req_id)

    def within_retry_budget(
        self, req_id: str, owner: int | None, num_tokens: int
    ) -> bool:
        """Whether ``owner``'s hit for ``req_id`` may be taken.

        False once ``max_failed_loads`` loads of the request from that child
        have failed: the guard then reports no external hit, and vLLM
        prefills the request locally instead of loading it again (under
        ``kv_load_failure_policy=recompute`` a store that keeps failing the
        load would otherwise be offered it forever). Counted and logged once
        per request and child.
        """
        if not num_tokens or owner is None or not self.config.valve:
            return True  # reserve / no-reserve: upstream's behaviour
        child = self.router.names[owner]
        failures = self.ledger.failed_loads(req_id, child)
        if failures < self.config.max_failed_loads:
            return True
        if self.ledger.cut_off(req_id, child):
            self.stats.load_retry_cutoffs[child] += 1
            logger.warning(
                "request %s: %d loads from %s failed (max_failed_loads=%d); "
                "computing it locally instead of loading it again",
                req_id,
                failures,
                child,
                self.config.max_failed_loads,
            )
        return False

    def record_failed_loads(self, req_ids: Iterable[str]) -> None:
        """Loads of ``req_ids`` failed (in full or in part) this step.

        The guarded scheduler reports them from ``update_from_output``:
        ``failed_recving`` for async loads, ``invalid_block_ids`` for blocks
        of waiting (async) or running (sync) requests. Each counts against
        the load's owning child (see :meth:`within_retry_budget`).
        """
        for req_id in req_ids:
            self.ledger.on_load_failed(req_id)

    def record_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """The children know of the allocation; the ledger now learns of it."""
        num_blocks = len(blocks.blocks[0]) if blocks.blocks else 0
        try:
            self.ledger.on_alloc(request.request_id, num_blocks, num_external_tokens)
        except LedgerError:
            self._ledger_refused()
        fault = self._alloc_fault
        if fault is not None:
            self._alloc_fault = None
            if fault.num_external_tokens > 0:
                self.on_load_not_started(request, blocks, num_external_tokens)

    def on_child_fault(self, fault: ChildFault) -> None:
        """A contained child raised (guard/containment.py): count it."""
        self.stats.child_errors[f"{fault.child}|{fault.hook}"] += 1
        if fault.hook == ALLOC:
            self._alloc_fault = fault

    def on_load_not_started(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """The owner raised before starting ``request``'s load: fail the load.

        vLLM already counts the external tokens as (to be) computed. An
        async load is reported as a failed receive on the next step (the
        request waits in WAITING_FOR_REMOTE_KVS for exactly that); a sync
        load's blocks are reported invalid, as a worker reports a sync load
        that failed. Either way ``kv_load_failure_policy`` decides:
        ``recompute`` prefills it locally, ``fail`` ends it with an error.
        """
        req_id = request.request_id
        if self.ledger.recv_state(req_id) is RecvState.IN_FLIGHT:
            self._unstarted_recvs.add(req_id)
            if kv_output_has_failed_recving():
                return
            # Before 0.30 a failed receive is reported as finished with its
            # blocks invalid: fall through to name the blocks.
        looked_up, computed = self._last_lookup
        start = computed if looked_up == req_id else request.num_computed_tokens
        end = start + num_external_tokens
        block_ids = blocks.get_block_ids()[0] if blocks.blocks else []
        first, last = start // self._block_size, -(-end // self._block_size)
        self._unstarted_blocks.update(block_ids[first:last])

    def has_unstarted_loads(self) -> bool:
        return bool(self._unstarted_recvs or self._unstarted_blocks)

    def observe_scheduler_output(self, scheduler_output: SchedulerOutput) -> None:
        """What this step scheduled and preempted (from build_connector_meta)."""
        ledger = self.ledger
        for req_id in scheduler_output.preempted_req_ids or ():
            ledger.on_preempted(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = new.block_ids
            self._scheduled(
                new.req_id,
                new.num_computed_tokens,
                len(block_ids[0]) if block_ids else 0,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed, blocks in ledger.on_scheduled_again(
            cached.req_ids,
            cached.num_computed_tokens,
            cached.new_block_ids,
            scheduler_output.num_scheduled_tokens.keys(),
        ):
            self._scheduled(req_id, computed, blocks)

    def _scheduled(self, req_id: str, computed_tokens: int, num_blocks: int) -> None:
        try:
            self.ledger.on_scheduled(req_id, computed_tokens, num_blocks)
        except LedgerError:
            self._ledger_refused()

    def record_finished(self, req_id: str) -> None:
        """vLLM freed ``req_id`` (or keeps it for its receive): see
        :meth:`BlockLedger.on_finished`. A second call for the same request
        (MultiConnector's all-groups finish goes through ``request_finished``)
        finds nothing to do."""
        self.ledger.on_finished(req_id)

    # ---- receive notices ------------------------------------------------------------
    def filter_recv_notices(
        self, connector_output: KVConnectorOutput, awaited: Awaited | None = None
    ) -> None:
        """Drop duplicate and late receive notices from ``connector_output``.

        ``awaited`` (from the guarded scheduler) tells whether vLLM still
        waits on a request's notice; vLLM's state wins over the ledger's: a
        notice vLLM waits on is passed on whatever the ledger says, and one
        the ledger expects but vLLM no longer waits on is dropped. Each such
        disagreement is counted and logged once per request. Without
        ``awaited`` (a scheduler without the guard) the ledger decides.

        A duplicate (two children reporting one request, upstream #53049) or
        a late notice for a finished request would trip vLLM's assert or free
        blocks twice; a duplicate *failure* notice would fail (or reset) a
        request whose KV arrived. vLLM reads ``failed_recving`` at the top of
        ``update_from_output``, before it calls the connector's
        ``update_connector_output``, so the guarded scheduler calls this
        first; the failed set is cut to the accepted receives even when no
        receive finished. Once per output (see :meth:`end_output`).
        """
        if connector_output is self._filtered_output:
            return
        self._filtered_output = connector_output
        if self._unstarted_recvs or self._unstarted_blocks:
            self._report_unstarted_loads(connector_output)
        # Before 0.30 a failed receive is a finished one with invalid blocks.
        failed: AbstractSet[str] = (
            getattr(connector_output, "failed_recving", None) or _NO_IDS
        )
        kept: set[str] = set()
        if connector_output.finished_recving:
            kept = self._accepted_recvs(
                connector_output.finished_recving, failed, awaited
            )
            connector_output.finished_recving = kept or None
        if failed:
            connector_output.failed_recving = {r for r in failed if r in kept}

    def end_output(self) -> None:
        """The connector forwarded the output: the next one is filtered anew."""
        self._filtered_output = None

    def _report_unstarted_loads(self, connector_output: KVConnectorOutput) -> None:
        if self._unstarted_recvs:
            live = {r for r in self._unstarted_recvs if self.ledger.get(r)}
            self._unstarted_recvs.clear()
            if live:
                finished = set(connector_output.finished_recving or ())
                connector_output.finished_recving = finished | live
                if kv_output_has_failed_recving():
                    failed = set(connector_output.failed_recving or ())
                    connector_output.failed_recving = failed | live
                # else (before 0.30) their blocks are in _unstarted_blocks.
        if self._unstarted_blocks:
            invalid = set(connector_output.invalid_block_ids or ())
            connector_output.invalid_block_ids = invalid | self._unstarted_blocks
            self._unstarted_blocks.clear()

    def _accepted_recvs(
        self,
        finished: Iterable[str],
        failed: AbstractSet[str],
        awaited: Awaited | None,
    ) -> set[str]:
        kept = set()
        ledger = self.ledger
        before = _dropped_counts(ledger.dropped)
        for req_id in finished:
            vllm_waits = None if awaited is None else awaited(req_id)
            if vllm_waits is None or vllm_waits == ledger.expects_recv(req_id):
                if ledger.accept_recv_complete(req_id, req_id in failed):
                    kept.add(req_id)
            elif vllm_waits:
                overruled = ledger.overrule_recv_complete(req_id, req_id in failed)
                self._note_disagreement(req_id, overruled)
                kept.add(req_id)
            else:
                ledger.accept_recv_complete(req_id, req_id in failed)
                self._note_disagreement(req_id, Disagreement.NOT_AWAITED)
        if before != _dropped_counts(ledger.dropped):
            self._count_dropped(dict(zip(_DROPPED_KINDS, before, strict=True)))
        return kept

    def _count_dropped(self, before: dict[str, int]) -> None:
        """Count and log the notices the ledger dropped since ``before``."""
        for kind in _DROPPED_KINDS:
            n = getattr(self.ledger.dropped, kind)
            if n > before[kind]:
                self.stats.dropped_recv_notices[kind] += n - before[kind]
                logger.warning(
                    "wedge guard dropped %d %s receive notice(s)",
                    n - before[kind],
                    kind,
                )

    def _note_disagreement(self, req_id: str, kind: Disagreement) -> None:
        """Count a ledger/vLLM disagreement; log it once per request."""
        self.stats.ledger_disagreements[kind.value] += 1
        if req_id in self._disagreement_logged:
            return
        self._disagreement_logged[req_id] = None
        if len(self._disagreement_logged) > _LOGGED_ONCE_MAX:
            self._disagreement_logged.pop(next(iter(self._disagreement_logged)))
        passed = "dropped" if kind is Disagreement.NOT_AWAITED else "passed on"
        logger.warning(
            "wedge guard ledger disagrees with the scheduler on request %s's "
            "receive notice (%s); the scheduler's state wins: notice %s",
            req_id,
            kind.value,
            passed,
        )

    # ---- the guarded scheduler's API -----------------------------------------
    def has_executed(self, req_id: str) -> bool:
        """Whether the worker has seen ``req_id`` (it must resume, not restart)."""
        return self.ledger.has_executed(req_id)

    def pick_victim(self, views: Iterable[HolderView], target: str) -> Victim | None:
        return self.ledger.pick_victim(views, target)

    def on_lateral_preemption(self, victim: Victim) -> None:
        self._ledger(self.ledger.on_lateral_preempt, victim.req_id)
        self._requests_to_connector.pop(victim.req_id, None)
        key = (victim.reason.value, victim.owner or "none")
        self.stats.lateral_preemptions[key] += 1

    def note_attempts_exhausted(self) -> None:
        self.stats.attempts_exhausted += 1

    def census_due(self, holders_may_wait: bool) -> bool:
        """Whether a busy step (one that scheduled tokens or runs requests)
        recounts the waiting holders for :meth:`observe_step`.

        Only once ``gauge_interval_s`` has passed since the last count: the
        holder gauges are then at most that old while tokens flow, and a
        busy step, which cannot be a stall, costs nothing here. Always when
        no holder can be waiting (``holders_may_wait`` False: the queues
        are empty), so the gauges reach 0 on the step the last holder left,
        even if the engine then goes idle. The caller counts every step
        that scheduled nothing: that is the step a wedge is made of.
        """
        if not holders_may_wait:
            return True
        return self.clock() - self._last_census >= self.config.gauge_interval_s

    def note_no_stall(self) -> None:
        """This step is no stall: the stall watch starts over (the alarm
        re-arms); the gauges keep their last count."""
        self._stall_steps = self.stats.stalled_steps = 0
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
        stats = self.stats
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
                self.ledger.snapshot(views()),
            )

    def _stall_is_a_wedge(self) -> bool:
        config = self.config
        if self._stall_steps >= config.stall_alarm_steps:
            return True
        return self.clock() - self._stall_since >= config.stall_alarm_s

    def _report_resolution(
        self, lateral: Sequence[tuple[Victim, str]], views: Sequence[HolderView]
    ) -> None:
        self.stats.wedges_resolved += 1
        moves = ", ".join(
            f"{v.req_id} ({v.reason.value}, owner={v.owner}, {v.num_blocks} blocks) "
            f"for {target}"
            for v, target in lateral
        )
        logger.warning(
            "wedge guard: admission failed with nothing running; lateral "
            "preemption of %s; waiting holders now: %s",
            moves,
            self.ledger.snapshot(views),
        )


__all__ = [
    "GuardSchedulerSide",
    "StepObservation",
    "UNROUTABLE",
]
