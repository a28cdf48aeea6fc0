"""The guard's counters and gauges on vLLM's KV-connector stats path.

How they reach ``/metrics`` (vLLM 0.32):

1. Engine core: after every step ``Scheduler.update_from_output`` calls
   ``connector.get_kv_connector_stats()``. ``WedgeGuardConnector`` returns
   MultiConnector's per-child stats plus a :data:`GUARD_STATS_KEY` entry, a
   :class:`GuardKVConnectorStats` holding the counters accumulated since the
   previous call and the gauges as of this step. The scheduler sends
   ``to_dict()`` of it to the front-end in ``SchedulerStats.kv_connector_stats``.
2. Front-end: ``PrometheusStatLogger`` builds its connector metrics once with
   ``WedgeGuardConnector.build_prom_metrics`` (:class:`GuardPromMetrics` for
   our entry, MultiConnector's for the children) and calls ``observe(data,
   engine_idx)`` with every payload; ``LoggingStatLogger`` rebuilds the
   payload with ``WedgeGuardConnector.build_kv_connector_stats`` and logs
   :meth:`GuardKVConnectorStats.reduce` in its "KV Transfer metrics" line.

No engine-core state crosses the process boundary: the payload is the plain
dict of :meth:`GuardStats.to_dict` plus a ``gauges_changed`` flag.

Older releases (``compat/releases.py`` says which) differ in two places:

- before 0.30 the scheduler sends the stats objects themselves, which reach
  the front-end as ``{"data": {...}}`` per connector (and vLLM's
  ``KVConnectorStats`` has no ``to_dict``): :func:`rebuild_guard_entry`
  unwraps the guard's entry, the children's stay as vLLM's MultiConnector
  expects them;
- before 0.24 step 1 happens only on steps where a worker reported stats of
  its own; the guarded scheduler gives every step with a pending guard report
  an empty :func:`stats_carrier`, so a lateral preemption reaches
  ``/metrics`` in the step it happened.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_mooncake import CONNECTOR_NAME, logger_for
from vllm_mooncake.guard.ledger import DroppedNotices
from vllm_mooncake.guard.stats import GuardStats

logger = logger_for(__name__)

GUARD_STATS_KEY = CONNECTOR_NAME
"""The guard's entry in the connector stats dict (MultiConnector keys its
children by class name; a front-end resolves entries by registered name)."""

GAUGES_CHANGED = "gauges_changed"
"""Payload key: the gauges in this payload are current and must be set."""

DROPPED_KINDS = tuple(f.name for f in fields(DroppedNotices))

# Prometheus name, GuardStats attribute, help text.
COUNTER_METRICS: tuple[tuple[str, str, str], ...] = (
    (
        "vllm:kv_guard_attempts_exhausted",
        "attempts_exhausted",
        "Number of times the KV wedge guard wanted another lateral preemption "
        "in one scheduler step but had used max_attempts. A growing value "
        "means admission keeps failing; consider raising max_attempts.",
    ),
    (
        "vllm:kv_guard_wedges_detected",
        "wedges_detected",
        "Number of wedge alarms: stall_alarm_steps consecutive scheduler steps "
        "(or stall_alarm_s seconds) that scheduled no token while waiting "
        "requests held KV blocks, nothing ran and no receive was in flight. "
        "Each alarm means the engine was stuck.",
    ),
    (
        "vllm:kv_guard_wedges_resolved",
        "wedges_resolved",
        "Number of scheduler steps in which the KV wedge guard ended a stall "
        "by lateral preemption (one per step, however many requests it "
        "preempted).",
    ),
    (
        "vllm:kv_guard_unroutable_requests",
        "unroutable_requests",
        "Number of requests asking for a remote prefill whose "
        "kv_transfer_params matched no configured child KV connector; they "
        "were prefilled locally instead.",
    ),
    (
        "vllm:kv_guard_ledger_errors",
        "ledger_errors",
        "Number of inconsistencies between the KV wedge guard's block ledger "
        "and the scheduler's requests (logged, or raised when strict).",
    ),
)

GAUGE_METRICS: tuple[tuple[str, str, str], ...] = (
    (
        "vllm:kv_guard_recv_done_holders_waiting",
        "recv_done_holders_waiting",
        "Requests whose KV receive has finished but that still wait for "
        "admission while holding their KV blocks, as of the last scheduler "
        "step.",
    ),
    (
        "vllm:kv_guard_blocks_held_by_non_running",
        "blocks_held_by_non_running",
        "KV cache blocks held by waiting (not running) requests, as of the "
        "last scheduler step.",
    ),
    (
        "vllm:kv_guard_stalled_steps",
        "stalled_steps",
        "Consecutive scheduler steps that scheduled no token while nothing "
        "ran, waiting requests held KV blocks and no receive was in flight "
        "(0 when not stalled). The wedge alarm fires when it reaches "
        "stall_alarm_steps or the stall lasts stall_alarm_s seconds.",
    ),
)

LATERAL_PREEMPTIONS_METRIC = "vllm:kv_guard_lateral_preemptions"
DROPPED_RECV_NOTICES_METRIC = "vllm:kv_guard_dropped_recv_notices"
CHILD_ERRORS_METRIC = "vllm:kv_guard_child_errors"
LEDGER_DISAGREEMENTS_METRIC = "vllm:kv_guard_ledger_disagreements"
LOAD_RETRY_CUTOFFS_METRIC = "vllm:kv_guard_load_retry_cutoffs"
DISAGREEMENT_KINDS = ("no_entry", "no_recv", "not_awaited")


@dataclass
class GuardKVConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """One report of the guard's stats: a :class:`GuardStats` delta.

    ``data`` is ``GuardStats.to_dict()`` of the counters accumulated since the
    previous report with the gauges as of this report, plus ``gauges_changed``
    (whether the gauges are to be set; an empty report carries zeros that are
    not measurements).
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    @classmethod
    def from_guard_stats(
        cls, stats: GuardStats, gauges_changed: bool = True
    ) -> GuardKVConnectorStats:
        data = stats.to_dict()
        data[GAUGES_CHANGED] = gauges_changed
        return cls(data=data)

    @classmethod
    def of_gauges(cls, stats: GuardStats) -> GuardKVConnectorStats:
        """A report that sets the gauges and adds to no counter."""
        data = GuardStats.gauges_dict(stats)
        data[GAUGES_CHANGED] = True
        return cls(data=data)

    def to_dict(self) -> dict[str, Any]:
        """The payload (vLLM 0.30+ asks every stats object for it; older
        releases' base class has no such method)."""
        return self.data

    @property
    def guard_stats(self) -> GuardStats:
        return GuardStats.from_dict(self.data)

    @property
    def gauges_changed(self) -> bool:
        return bool(self.data.get(GAUGES_CHANGED, False))

    def reset(self) -> None:
        self.data = GuardStats().to_dict()
        self.data[GAUGES_CHANGED] = False

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Counters added; gauges from ``other`` (the newer) if it has any."""
        if not isinstance(other, GuardKVConnectorStats):
            raise TypeError(
                f"cannot aggregate {type(other).__name__} into GuardKVConnectorStats"
            )
        mine, theirs = self.guard_stats, other.guard_stats
        merged = mine.merge(theirs)
        if not other.gauges_changed:
            for name in GuardStats.GAUGES:
                setattr(merged, name, getattr(mine, name))
        gauges_changed = self.gauges_changed or other.gauges_changed
        self.data = merged.to_dict()
        self.data[GAUGES_CHANGED] = gauges_changed
        return self

    def reduce(self) -> dict[str, int | float]:
        stats = self.guard_stats
        return {
            "Lateral preemptions": stats.total_lateral_preemptions,
            "Wedges detected": stats.wedges_detected,
            "Wedges resolved": stats.wedges_resolved,
            "Attempts exhausted": stats.attempts_exhausted,
            "Dropped recv notices": sum(stats.dropped_recv_notices.values()),
            "Unroutable requests": stats.unroutable_requests,
            "Child connector errors": sum(stats.child_errors.values()),
            "Ledger disagreements": sum(stats.ledger_disagreements.values()),
            "Load retry cutoffs": sum(stats.load_retry_cutoffs.values()),
            "Ledger errors": stats.ledger_errors,
            "Recv-done holders waiting": stats.recv_done_holders_waiting,
            "Blocks held by non-running": stats.blocks_held_by_non_running,
            "Stalled steps": stats.stalled_steps,
        }

    def is_empty(self) -> bool:
        """No counter moved and no gauge to set. Read from ``data`` as it is
        (vLLM asks after every step): what ``guard_stats.is_empty()`` says,
        without rebuilding the stats."""
        data = self.data
        if data.get(GAUGES_CHANGED):
            return False
        return not any(data.get(name) for name in _COUNTER_KEYS)


_COUNTER_KEYS = (*GuardStats.COUNTERS, "lateral_preemptions", *GuardStats.LABELED)


def guard_stats_report(
    current: GuardStats, last_reported: GuardStats
) -> GuardKVConnectorStats | None:
    """What changed since ``last_reported``, or None if nothing did."""
    delta = current.delta_since(last_reported)
    gauges_changed = any(
        getattr(current, name) != getattr(last_reported, name)
        for name in GuardStats.GAUGES
    )
    if delta.is_empty() and not gauges_changed:
        return None
    return GuardKVConnectorStats.from_guard_stats(delta, gauges_changed)


def with_guard_report(
    stats: KVConnectorStats | None, report: GuardKVConnectorStats | None
) -> KVConnectorStats | None:
    """MultiConnector's per-child ``stats`` plus the guard's entry, if any."""
    if report is None:
        return stats
    if stats is None:
        stats = MultiKVConnectorStats()
    stats.data[GUARD_STATS_KEY] = report
    return stats


def stats_carrier() -> KVConnectorStats:
    """An empty per-child stats object: on releases that ask the connector
    for stats only when a worker reported some (before 0.24), a step's
    ``kv_connector_stats`` set to this makes vLLM ask."""
    return MultiKVConnectorStats()


def rebuild_guard_entry(
    data: dict[str, Any],
) -> tuple[dict[str, Any], GuardKVConnectorStats | None]:
    """Split a serialized stats dict into the children's part and ours."""
    rest = dict(data)
    raw = rest.pop(GUARD_STATS_KEY, None)
    if raw is None or isinstance(raw, GuardKVConnectorStats):
        return rest, raw
    if isinstance(raw, KVConnectorStats):
        raw = raw.data
    elif _is_serialized_dataclass(raw):  # before 0.30: {"data": {...}}
        raw = raw["data"]
    return rest, GuardKVConnectorStats(data=dict(raw))


def _is_serialized_dataclass(raw: Any) -> bool:
    """A stats object serialized whole, as releases before 0.30 send it: its
    one field ``data`` (the guard's own payload never has such a key)."""
    return isinstance(raw, dict) and len(raw) == 1 and isinstance(raw.get("data"), dict)


class GuardPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The guard's Prometheus counters and gauges, per engine.

    Counters are exposed with prometheus_client's ``_total`` suffix (e.g.
    ``vllm:kv_guard_lateral_preemptions_total``), like vLLM's own counters.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, attr, doc in COUNTER_METRICS:
            metric = self._counter_cls(
                name=name, documentation=doc, labelnames=labelnames
            )
            self._counters[attr] = create_metric_per_engine(
                metric, per_engine_labelvalues
            )
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, attr, doc in GAUGE_METRICS:
            metric = self._gauge_cls(
                name=name,
                documentation=doc,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            self._gauges[attr] = create_metric_per_engine(
                metric, per_engine_labelvalues
            )
        # The owner label takes child names, known only once the connector is
        # built: these children are created on first use.
        self._lateral_preemptions = self._counter_cls(
            name=LATERAL_PREEMPTIONS_METRIC,
            documentation="Number of waiting requests the KV wedge guard "
            "preempted to free KV blocks for a request that could not be "
            "admitted while nothing ran. reason: recv_done (its KV receive had "
            "finished) or promoted_idle (admitted after its load, never run "
            "since); owner: the child KV connector that loaded its KV.",
            labelnames=[*labelnames, "reason", "owner"],
        )
        self._dropped_recv_notices = self._counter_cls(
            name=DROPPED_RECV_NOTICES_METRIC,
            documentation="Number of KV receive-completion notices the KV wedge "
            "guard dropped before the scheduler saw them. kind: duplicate (a "
            "second completion for one receive), late (for a request already "
            "finished) or unexpected (for a request with no receive).",
            labelnames=[*labelnames, "kind"],
        )
        self._child_errors = self._counter_cls(
            name=CHILD_ERRORS_METRIC,
            documentation="Number of exceptions a child KV connector raised in a "
            "per-request scheduler hook that the KV wedge guard contained "
            "instead of letting them end the engine. child: the connector; "
            "hook: get_num_new_matched_tokens (prefilled locally), "
            "update_state_after_alloc (reported as a failed load) or "
            "request_finished (blocks freed).",
            labelnames=[*labelnames, "child", "hook"],
        )
        self._ledger_disagreements = self._counter_cls(
            name=LEDGER_DISAGREEMENTS_METRIC,
            documentation="Number of KV receive-completion notices on which the "
            "KV wedge guard's ledger and the scheduler disagreed; the scheduler's "
            "state won and the request ended normally. kind: no_entry or no_recv "
            "(the scheduler waited on a notice the ledger had no entry or no "
            "receive for: passed on) or not_awaited (the ledger expected a "
            "notice the scheduler no longer waits on: dropped).",
            labelnames=[*labelnames, "kind"],
        )
        self._load_retry_cutoffs = self._counter_cls(
            name=LOAD_RETRY_CUTOFFS_METRIC,
            documentation="Number of requests whose KV loads from one child KV "
            "connector failed max_failed_loads times; the KV wedge guard then "
            "reported no external hit for them and they were prefilled locally. "
            "child: the connector whose loads failed.",
            labelnames=[*labelnames, "child"],
        )
        # The kinds are known: expose them at 0 from the start.
        for labelvalues in per_engine_labelvalues.values():
            for kind in DROPPED_KINDS:
                self._dropped_recv_notices.labels(*labelvalues, kind)
            for kind in DISAGREEMENT_KINDS:
                self._ledger_disagreements.labels(*labelvalues, kind)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        report = GuardKVConnectorStats(data=dict(transfer_stats_data))
        stats = report.guard_stats
        for attr, per_engine in self._counters.items():
            value = getattr(stats, attr)
            if value > 0:
                per_engine[engine_idx].inc(value)
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for (reason, owner), n in stats.lateral_preemptions.items():
            if n > 0:
                self._lateral_preemptions.labels(*labelvalues, reason, owner).inc(n)
        for kind, n in stats.dropped_recv_notices.items():
            if n > 0:
                self._dropped_recv_notices.labels(*labelvalues, kind).inc(n)
        for key, n in stats.child_errors.items():
            child, _, hook = key.partition("|")
            if n > 0:
                self._child_errors.labels(*labelvalues, child, hook).inc(n)
        for kind, n in stats.ledger_disagreements.items():
            if n > 0:
                self._ledger_disagreements.labels(*labelvalues, kind).inc(n)
        for child, n in stats.load_retry_cutoffs.items():
            if n > 0:
                self._load_retry_cutoffs.labels(*labelvalues, child).inc(n)
        if report.gauges_changed:
            for attr, per_engine in self._gauges.items():
                per_engine[engine_idx].set(getattr(stats, attr))


class WedgeGuardPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The guard's metrics next to MultiConnector's per-child metrics.

    ``observe`` gets the whole connector stats dict: the guard's entry goes to
    :class:`GuardPromMetrics`, the rest to MultiConnector's prom metrics
    (which dispatch by child class name).
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        children: KVConnectorPromMetrics | None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.children = children
        self._children_without_prom: set[str] = set()
        self.guard = GuardPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        rest, report = rebuild_guard_entry(transfer_stats_data)
        if report is not None:
            self.guard.observe(report.data, engine_idx)
        if self.children is None:
            return
        for child, data in rest.items():
            if child in self._children_without_prom:
                continue
            try:
                self.children.observe({child: data}, engine_idx)
            except (AssertionError, KeyError):
                # MultiConnector's prom metrics assert that every child with
                # stats has Prometheus metrics; vLLM 0.32's MooncakeConnector
                # reports stats but builds none, and the failed assert ends
                # the API server's output handler (seen on a real 1P2D).
                self._children_without_prom.add(child)
                logger.info(
                    "KV connector %s reports stats without Prometheus metrics; "
                    "they stay in the log line only",
                    child,
                )


__all__ = [
    "KVConnectorPromMetrics",
    "KVConnectorStats",
    "COUNTER_METRICS",
    "DROPPED_RECV_NOTICES_METRIC",
    "GAUGE_METRICS",
    "GUARD_STATS_KEY",
    "LATERAL_PREEMPTIONS_METRIC",
    "GuardKVConnectorStats",
    "GuardPromMetrics",
    "WedgeGuardPromMetrics",
    "guard_stats_report",
    "rebuild_guard_entry",
    "stats_carrier",
    "with_guard_report",
]
