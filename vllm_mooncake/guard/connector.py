"""``WedgeGuardConnector``: vLLM's MultiConnector plus a block ledger.

A facade: every worker-side call is MultiConnector's, unchanged. On the
scheduler side each hook is forwarded to MultiConnector (or, for a request
whose ``kv_transfer_params`` name a child, to that child alone) and then fed
to :class:`~vllm_mooncake.guard.ledger.BlockLedger`:

=========================  ============================================
vLLM hook                  ledger
=========================  ============================================
on_new_request             on_arrival
get_num_new_matched_tokens on_lookup (owner child, async or not)
update_state_after_alloc   on_alloc (receive in flight if async)
build_connector_meta       on_scheduled / on_preempted
update_connector_output    accept_recv_complete (drops duplicate and late
                           notices *before* vLLM's scheduler reads them;
                           the guarded scheduler filters earlier, see
                           filter_recv_notices)
request_finished[_all...]  on_finished
=========================  ============================================

The guarded scheduler (``guard/scheduler.py``) asks :meth:`pick_victim`
for a lateral victim and reports what it did with
:meth:`on_lateral_preemption`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.logger import init_logger

from vllm_mooncake.guard.config import GuardConfig, validate_children
from vllm_mooncake.guard.containment import ALLOC, ChildFault, ContainedChild
from vllm_mooncake.guard.ledger import (
    BlockLedger,
    HolderView,
    LedgerError,
    RecvState,
    Victim,
)
from vllm_mooncake.guard.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    WedgeGuardPromMetrics,
    guard_stats_report,
    rebuild_guard_entry,
    with_guard_report,
)
from vllm_mooncake.guard.routing import ChildRouter, UnroutableRequest
from vllm_mooncake.guard.stats import GuardStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)
T = TypeVar("T")


class WedgeGuardConnector(MultiConnector):  # type: ignore[misc]
    """MultiConnector that knows who holds which KV blocks, and why."""

    _connectors: list[Any]  # MultiConnector's children (contained: scheduler side)

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        ktc = vllm_config.kv_transfer_config
        extra = ktc.kv_connector_extra_config if ktc is not None else {}
        # Validate before any child is built: errors at start-up, by field.
        self.guard_config = GuardConfig.from_extra_config(extra)
        validate_children(extra)
        super().__init__(vllm_config, role, kv_cache_config)
        self.ledger = BlockLedger()
        self.stats = GuardStats()
        self.router = ChildRouter.for_children(self._connectors)
        self._is_scheduler = role == KVConnectorRole.SCHEDULER
        # The output filter_recv_notices last filtered (filter once per step).
        self._filtered_output: KVConnectorOutput | None = None
        self._block_size = vllm_config.cache_config.block_size
        # Loads whose owner raised before starting them (guard/containment.py):
        # async ones are reported as failed receives, sync ones as invalid
        # blocks, on the next update_from_output.
        self._unstarted_recvs: set[str] = set()
        self._unstarted_blocks: set[int] = set()
        self._alloc_fault: ChildFault | None = None
        self._last_lookup: tuple[str, int] = ("", 0)
        if self._is_scheduler:
            self._connectors = [
                ContainedChild(child, name, self._on_child_fault)
                for child, name in zip(self._connectors, self.router.names, strict=True)
            ]

    @property
    def child_names(self) -> tuple[str, ...]:
        return self.router.names

    # ---- ledger calls: log (or raise, when strict) inconsistencies --------------
    def _ledger(self, call: Callable[..., T], *args: Any) -> T | None:
        try:
            return call(*args)
        except LedgerError:
            self.stats.ledger_errors += 1
            if self.guard_config.strict:
                raise
            logger.exception("wedge guard ledger inconsistency (continuing)")
            return None

    # ---- scheduler side -----------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        super().on_new_request(request)
        self._ledger(self.ledger.on_arrival, request.request_id)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        self._last_lookup = (req_id, num_computed_tokens)
        try:
            owner = self.router.owner_for(request.kv_transfer_params)
        except UnroutableRequest as exc:
            self.stats.unroutable_requests += 1
            logger.error("request %s: %s Computing it locally instead.", req_id, exc)
            self._requests_to_connector.pop(req_id, None)
            self._ledger(self.ledger.on_lookup, req_id, None, 0, False)
            return 0, False
        if owner is None:
            num_tokens, is_async = super().get_num_new_matched_tokens(
                request, num_computed_tokens
            )
            if num_tokens is None:
                return None, False
            owner = self._requests_to_connector.get(req_id) if num_tokens else None
        else:
            child = self._connectors[owner]
            num_tokens, is_async = child.get_num_new_matched_tokens(
                request, num_computed_tokens
            )
            if num_tokens is None:
                return None, False
        if num_tokens and owner is not None:
            self._requests_to_connector[req_id] = owner
        else:
            self._requests_to_connector.pop(req_id, None)
        owner_name = self.child_names[owner] if owner is not None else None
        self._ledger(self.ledger.on_lookup, req_id, owner_name, num_tokens, is_async)
        return num_tokens, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Tell the owning child first, then the others (with 0 tokens).

        MultiConnector goes in config order; a non-owner that runs first can
        consume shared ``kv_transfer_params`` (NIXL sets ``do_remote_prefill``
        to False on a request it does not load), and the owner then never
        asks its worker to fetch -- the request would wait forever.
        """
        owner = self._requests_to_connector.get(request.request_id, -1)
        order = sorted(range(len(self._connectors)), key=lambda i: i != owner)
        self._alloc_fault = None
        for i in order:
            tokens = num_external_tokens if i == owner else 0
            self._connectors[i].update_state_after_alloc(request, blocks, tokens)
        num_blocks = len(blocks.get_block_ids()[0]) if blocks.blocks else 0
        self._ledger(
            self.ledger.on_alloc, request.request_id, num_blocks, num_external_tokens
        )
        fault, self._alloc_fault = self._alloc_fault, None
        if fault is not None and fault.num_external_tokens > 0:
            self.on_load_not_started(request, blocks, num_external_tokens)

    # ---- child faults (guard/containment.py) --------------------------------------
    def _on_child_fault(self, fault: ChildFault) -> None:
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
            return
        looked_up, computed = self._last_lookup
        start = computed if looked_up == req_id else request.num_computed_tokens
        end = start + num_external_tokens
        block_ids = blocks.get_block_ids()[0] if blocks.blocks else []
        first, last = start // self._block_size, -(-end // self._block_size)
        self._unstarted_blocks.update(block_ids[first:last])

    def _report_unstarted_loads(self, connector_output: KVConnectorOutput) -> None:
        if self._unstarted_recvs:
            live = {r for r in self._unstarted_recvs if self.ledger.get(r)}
            self._unstarted_recvs.clear()
            if live:
                finished = set(connector_output.finished_recving or ())
                failed = set(connector_output.failed_recving or ())
                connector_output.finished_recving = finished | live
                connector_output.failed_recving = failed | live
        if self._unstarted_blocks:
            invalid = set(connector_output.invalid_block_ids or ())
            connector_output.invalid_block_ids = invalid | self._unstarted_blocks
            self._unstarted_blocks.clear()

    def has_unstarted_loads(self) -> bool:
        return bool(self._unstarted_recvs or self._unstarted_blocks)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        for req_id in scheduler_output.preempted_req_ids or ():
            self.ledger.on_preempted(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            self._ledger(
                self.ledger.on_scheduled,
                new.req_id,
                new.num_computed_tokens,
                len(new.block_ids[0]) if new.block_ids else 0,
            )
        cached = scheduler_output.scheduled_cached_reqs
        new_ids = cached.new_block_ids or [None] * len(cached.req_ids)
        added = [len(ids[0]) if ids else 0 for ids in new_ids]
        for req_id, computed, blocks in self.ledger.on_scheduled_again(
            cached.req_ids, cached.num_computed_tokens, added
        ):
            self._ledger(self.ledger.on_scheduled, req_id, computed, blocks)
        return meta

    def filter_recv_notices(self, connector_output: KVConnectorOutput) -> None:
        """Drop duplicate and late receive notices from ``connector_output``.

        A duplicate (two children reporting one request, upstream #53049) or
        a late notice for a finished request would trip vLLM's assert or free
        blocks twice; a duplicate *failure* notice would fail (or reset) a
        request whose KV arrived. vLLM reads ``failed_recving`` at the top of
        ``update_from_output``, before it calls
        :meth:`update_connector_output`, so the guarded scheduler calls this
        first (found by the property tests); the failed set is cut to the
        accepted receives even when no receive finished. Once per output.
        """
        if connector_output is self._filtered_output:
            return
        self._filtered_output = connector_output
        self._report_unstarted_loads(connector_output)
        failed = connector_output.failed_recving or set()
        kept = set()
        if connector_output.finished_recving:
            kept = self._accepted_recvs(connector_output.finished_recving, failed)
            connector_output.finished_recving = kept or None
        if failed:
            connector_output.failed_recving = {r for r in failed if r in kept}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Drop duplicate and late receive notices (if not yet), then forward.

        vLLM's scheduler calls this *before* it reads ``finished_recving``
        itself, so the filtered set is also what the scheduler acts on.
        """
        self.filter_recv_notices(connector_output)
        self._filtered_output = None
        super().update_connector_output(connector_output)

    def _accepted_recvs(self, finished: Iterable[str], failed: set[str]) -> set[str]:
        kept = set()
        before = self.ledger.dropped.__dict__.copy()
        for req_id in finished:
            if self.ledger.accept_recv_complete(req_id, req_id in failed):
                kept.add(req_id)
        for kind, n in self.ledger.dropped.__dict__.items():
            if n > before[kind]:
                self.stats.dropped_recv_notices[kind] += n - before[kind]
                logger.warning(
                    "wedge guard dropped %d %s receive notice(s)",
                    n - before[kind],
                    kind,
                )
        return kept

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        result = super().request_finished(request, block_ids)
        self.ledger.on_finished(request.request_id)
        return result  # type: ignore[no-any-return]

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        result = super().request_finished_all_groups(request, block_ids)
        self.ledger.on_finished(request.request_id)
        return result  # type: ignore[no-any-return]

    # ---- the guard's own API, for the guarded scheduler ---------------------------
    def pick_victim(self, views: Iterable[HolderView], target: str) -> Victim | None:
        return self.ledger.pick_victim(views, target)

    def on_lateral_preemption(self, victim: Victim) -> None:
        self._ledger(self.ledger.on_lateral_preempt, victim.req_id)
        self._requests_to_connector.pop(victim.req_id, None)
        key = (victim.reason.value, victim.owner or "none")
        self.stats.lateral_preemptions[key] += 1

    # ---- stats export: vLLM's KV-connector stats and Prometheus path --------------
    # See guard/metrics.py for the flow. The engine-core scheduler calls
    # get_kv_connector_stats() after every step; the front-end rebuilds the
    # payload with build_kv_connector_stats() and records it with the object
    # build_prom_metrics() returned.
    _guard_stats_reported: GuardStats | None = None  # snapshot at the last report

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The children's stats plus the guard's counters since the last call."""
        stats = super().get_kv_connector_stats()
        if not self._is_scheduler:
            return stats
        last = self._guard_stats_reported or GuardStats()
        report = guard_stats_report(self.stats, last)
        if report is not None:
            self._guard_stats_reported = GuardStats.from_dict(self.stats.to_dict())
        return with_guard_report(stats, report)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Rebuild the guard's entry here; the children's as MultiConnector does."""
        if data is None:
            return super().build_kv_connector_stats(data=None)
        rest, report = rebuild_guard_entry(data)
        return with_guard_report(super().build_kv_connector_stats(data=rest), report)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """The guard's Prometheus metrics next to MultiConnector's children's."""
        children = super().build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
        return WedgeGuardPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, children
        )
