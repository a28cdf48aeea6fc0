"""``WedgeGuardConnector``: vLLM's MultiConnector plus the guard, as a facade.

Worker side: MultiConnector's, unchanged (the worker builds none of the
guard). Scheduler side: each hook goes to MultiConnector -- or, for a request
whose ``kv_transfer_params`` name a child, to that child alone -- and one
call reports it to the guard's state,
:class:`~vllm_mooncake.guard.scheduler_side.GuardSchedulerSide`
(``docs/architecture.md`` follows a request through them):

=========================  ============================================
vLLM hook                  the guard's scheduler side
=========================  ============================================
on_new_request             on_arrival
get_num_new_matched_tokens ownership.look_up (route to the named child;
                           no hit past max_failed_loads; owner recorded)
update_state_after_alloc   ownership.allocate (owner first; receive in
                           flight if async; a load never started is failed)
build_connector_meta       observe_scheduler_output (scheduled / preempted)
request_finished[_all...]  record_finished
=========================  ============================================

``update_connector_output`` is MultiConnector's: the guarded scheduler
(``guard/scheduler.py``) has filtered the receive notices before vLLM reads
them, and talks to the scheduler side directly, through
:attr:`WedgeGuardConnector.scheduler_side`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)

from vllm_mooncake.guard.config import GuardConfig, validate_children
from vllm_mooncake.guard.containment import ContainedChild
from vllm_mooncake.guard.kv_stats import (
    GuardKVConnectorStats,
    guard_stats_report,
    rebuild_guard_entry,
    with_guard_report,
)
from vllm_mooncake.guard.metrics import WedgeGuardPromMetrics
from vllm_mooncake.guard.routing import ChildRouter
from vllm_mooncake.guard.scheduler_side import GuardSchedulerSide
from vllm_mooncake.guard.stats import GuardStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["WedgeGuardConnector"]


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
        guard_config = GuardConfig.from_extra_config(extra)
        validate_children(extra)
        super().__init__(vllm_config, role, kv_cache_config)
        self._side: GuardSchedulerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            router = ChildRouter.for_children(self._connectors)
            self._side = GuardSchedulerSide(
                guard_config,
                router,
                self._requests_to_connector,
                vllm_config.cache_config.block_size,
            )
            self._connectors = [
                ContainedChild(child, name, self._side.ownership.on_child_fault)
                for child, name in zip(self._connectors, router.names, strict=True)
            ]

    @property
    def scheduler_side(self) -> GuardSchedulerSide:
        """The guard's state; only the SCHEDULER role has it."""
        assert self._side is not None, "the guard's state lives on the scheduler side"
        return self._side

    # ---- scheduler side: route, delegate, report ----------------------------
    # The hooks below run in the scheduler process only, where ``_side`` is
    # set; they read it directly (per-request paths: no property call).
    def on_new_request(self, request: Request) -> None:
        super().on_new_request(request)
        self._side.on_arrival(request.request_id)  # type: ignore[union-attr]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._side.ownership.look_up(  # type: ignore[union-attr]
            request,
            num_computed_tokens,
            self._connectors,
            super().get_num_new_matched_tokens,
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Tell the owning child first, then the others (with 0 tokens):
        see ``LoadOwnership.allocate``."""
        self._side.ownership.allocate(  # type: ignore[union-attr]
            request, blocks, num_external_tokens, self._connectors
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        self._side.observe_scheduler_output(scheduler_output)  # type: ignore[union-attr]
        return meta

    # The request whose finish request_finished recorded last: MultiConnector's
    # all-groups finish goes through request_finished when a child lacks HMA.
    _finish_recorded: str | None = None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        result = super().request_finished(request, block_ids)
        self._side.record_finished(request.request_id)  # type: ignore[union-attr]
        self._finish_recorded = request.request_id
        return result  # type: ignore[no-any-return]

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._finish_recorded = None
        result = super().request_finished_all_groups(request, block_ids)
        if self._finish_recorded != request.request_id:  # not yet, by the above
            self._side.record_finished(request.request_id)  # type: ignore[union-attr]
        return result  # type: ignore[no-any-return]

    # ---- stats export: vLLM's KV-connector stats and Prometheus path --------------
    # See guard/metrics.py for the flow. The engine-core scheduler calls
    # get_kv_connector_stats() after every step; the front-end rebuilds the
    # payload with build_kv_connector_stats() and records it with the object
    # build_prom_metrics() returned.
    _guard_stats_reported: GuardStats | None = None  # snapshot at the last report
    _guard_fingerprint = GuardStats().fingerprint()  # of that snapshot

    def guard_stats_pending(self) -> bool:
        """Whether the guard's stats moved since its last report (the guarded
        scheduler asks on releases where vLLM does not ask every step)."""
        side = self._side
        return side is not None and side.stats.fingerprint() != self._guard_fingerprint

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The children's stats plus the guard's counters since the last call.

        Called after every step. When nothing moved since the last report the
        guard adds nothing; when only gauges moved (holders come and go) it
        reports them without computing a counter delta.
        """
        stats = super().get_kv_connector_stats()
        if self._side is None:
            return stats
        self._side.before_stats_report()
        current = self._side.stats
        fingerprint = current.fingerprint()
        if fingerprint == self._guard_fingerprint:
            return stats
        last = self._guard_stats_reported or GuardStats()
        report: GuardKVConnectorStats | None
        if fingerprint[0] == self._guard_fingerprint[0]:  # only gauges moved
            report = GuardKVConnectorStats.of_gauges(current)
            for name in GuardStats.GAUGES:
                setattr(last, name, getattr(current, name))
            self._guard_stats_reported = last
        else:
            report = guard_stats_report(current, last)
            if report is None:
                return stats
            self._guard_stats_reported = GuardStats.from_dict(current.to_dict())
        self._guard_fingerprint = fingerprint
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
