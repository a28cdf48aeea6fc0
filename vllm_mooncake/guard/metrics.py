"""The guard's Prometheus metrics: names, help texts, and what sets them.

The guard's counters and gauges (``stats.py``) travel on vLLM's
KV-connector stats path as the guard's own entry (``kv_stats.py`` says how,
release by release). In the front-end, ``PrometheusStatLogger`` builds its
connector metrics once with ``WedgeGuardConnector.build_prom_metrics``
(:class:`WedgeGuardPromMetrics`: :class:`GuardPromMetrics` for the guard's
entry, MultiConnector's for the children) and calls ``observe(data,
engine_idx)`` with every payload. The metric names below are what an
operator reads on ``/metrics`` (``docs/runbook.md``).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_mooncake import logger_for
from vllm_mooncake.guard.kv_stats import (
    DROPPED_KINDS,
    GuardKVConnectorStats,
    rebuild_guard_entry,
)

logger = logger_for(__name__)

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
    (
        "vllm:kv_guard_stranded_receives",
        "stranded_receives",
        "Async KV receives in flight for more than half of recv_deadline_s, "
        "or whose sender refused a liveness probe, as of the last check.",
    ),
    (
        "vllm:kv_guard_quarantined_blocks",
        "quarantined_blocks",
        "KV cache blocks kept out of the free pool because a receive the "
        "guard failed may still be written into by its sender; released when "
        "the transfer reports its end or the sender is known dead.",
    ),
    (
        "vllm:kv_guard_stuck",
        "stuck",
        "1 while this engine is stuck: no token scheduled for recv_deadline_s "
        "seconds while requests wait; else 0. A readiness probe "
        "(python -m vllm_mooncake.tools.ready) reports the rank unready then.",
    ),
)

LATERAL_PREEMPTIONS_METRIC = "vllm:kv_guard_lateral_preemptions"
DROPPED_RECV_NOTICES_METRIC = "vllm:kv_guard_dropped_recv_notices"
CHILD_ERRORS_METRIC = "vllm:kv_guard_child_errors"
LEDGER_DISAGREEMENTS_METRIC = "vllm:kv_guard_ledger_disagreements"
LOAD_RETRY_CUTOFFS_METRIC = "vllm:kv_guard_load_retry_cutoffs"
RECEIVES_FAILED_METRIC = "vllm:kv_guard_receives_failed"
QUARANTINE_RELEASES_METRIC = "vllm:kv_guard_quarantine_releases"
RECEIVE_FAILURE_REASONS = ("deadline", "sender_dead")
QUARANTINE_RELEASE_REASONS = ("transfer_ended", "sender_dead")
DISAGREEMENT_KINDS = ("no_entry", "no_recv", "not_awaited")


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
        self._receives_failed = self._counter_cls(
            name=RECEIVES_FAILED_METRIC,
            documentation="Number of async KV receives the KV wedge guard "
            "failed through kv_load_failure_policy. reason: deadline (in "
            "flight longer than recv_deadline_s) or sender_dead (the sending "
            "prefill refused two liveness probes in a row); child: the KV "
            "connector that owned the receive.",
            labelnames=[*labelnames, "reason", "child"],
        )
        self._quarantine_releases = self._counter_cls(
            name=QUARANTINE_RELEASES_METRIC,
            documentation="Number of failed receives whose quarantined KV "
            "blocks went back to the free pool. reason: transfer_ended (the "
            "transfer reported its end) or sender_dead.",
            labelnames=[*labelnames, "reason"],
        )
        # The kinds are known: expose them at 0 from the start.
        for labelvalues in per_engine_labelvalues.values():
            for kind in DROPPED_KINDS:
                self._dropped_recv_notices.labels(*labelvalues, kind)
            for kind in DISAGREEMENT_KINDS:
                self._ledger_disagreements.labels(*labelvalues, kind)
            for reason in QUARANTINE_RELEASE_REASONS:
                self._quarantine_releases.labels(*labelvalues, reason)

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
        for key, n in stats.receives_failed.items():
            reason, _, child = key.partition("|")
            if n > 0:
                self._receives_failed.labels(*labelvalues, reason, child).inc(n)
        for reason, n in stats.quarantine_releases.items():
            if n > 0:
                self._quarantine_releases.labels(*labelvalues, reason).inc(n)
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
    "CHILD_ERRORS_METRIC",
    "COUNTER_METRICS",
    "DISAGREEMENT_KINDS",
    "DROPPED_RECV_NOTICES_METRIC",
    "GAUGE_METRICS",
    "LATERAL_PREEMPTIONS_METRIC",
    "LEDGER_DISAGREEMENTS_METRIC",
    "LOAD_RETRY_CUTOFFS_METRIC",
    "QUARANTINE_RELEASES_METRIC",
    "QUARANTINE_RELEASE_REASONS",
    "RECEIVES_FAILED_METRIC",
    "RECEIVE_FAILURE_REASONS",
    "GuardPromMetrics",
    "WedgeGuardPromMetrics",
]
