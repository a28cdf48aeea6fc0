"""Tests written for surviving mutants of guard/'s connector side (bench/mutation.py).

What an operator reads: the Prometheus help texts and series, the "KV
Transfer metrics" log line, and the log lines of a contained child or a
child without Prometheus metrics. Each test names the behaviour it pins;
bench/RESULTS.md ("Mutation testing") lists the mutants each one kills.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

from vllm_mooncake.guard.kv_stats import GUARD_STATS_KEY, GuardKVConnectorStats
from vllm_mooncake.guard.metrics import GuardPromMetrics, WedgeGuardPromMetrics
from vllm_mooncake.guard.stats import GuardStats
from vllm_mooncake.testing.configs import guarded
from vllm_mooncake.testing.driver import SchedulerDriver
from vllm_mooncake.testing.wedges import W1

LABELNAMES = ["model_name", "engine"]
TWO_ENGINES: dict[int, list[object]] = {0: ["tiny", "0"], 1: ["tiny", "1"]}
METRICS_LOGGER = "vllm.vllm_mooncake.guard.metrics"


@pytest.fixture(scope="module")
def vllm_config() -> Any:
    return SchedulerDriver.build(W1.shape, guarded()).scheduler.vllm_config


def _metric_types(registry: CollectorRegistry) -> dict[type[Any], type[Any]]:
    def bound(base: type[Any]) -> type[Any]:
        class Bound(base):  # type: ignore[misc,valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.setdefault("registry", registry)
                super().__init__(*args, **kwargs)

        return Bound

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def _series(registry: CollectorRegistry) -> dict[tuple[str, tuple[str, ...]], float]:
    """(sample name, sorted label items) -> value, from the exposition text."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = tuple(sorted(f"{k}={v}" for k, v in s.labels.items()))
            out[(s.name, labels)] = s.value
    return out


def _help(registry: CollectorRegistry) -> dict[str, str]:
    text = generate_latest(registry).decode()
    return {f.name: f.documentation for f in text_string_to_metric_families(text)}


def _payload(stats: GuardStats, gauges_changed: bool = True) -> dict[str, Any]:
    return GuardKVConnectorStats.from_guard_stats(stats, gauges_changed).to_dict()


# ---- /metrics: the help texts an operator reads -------------------------------------
LABELLED_HELP = {
    "vllm:kv_guard_lateral_preemptions": (
        "Number of waiting requests the KV wedge guard preempted to free KV "
        "blocks for a request that could not be admitted while nothing ran. "
        "reason: recv_done (its KV receive had finished) or promoted_idle "
        "(admitted after its load, never run since); owner: the child KV "
        "connector that loaded its KV."
    ),
    "vllm:kv_guard_dropped_recv_notices": (
        "Number of KV receive-completion notices the KV wedge guard dropped "
        "before the scheduler saw them. kind: duplicate (a second completion "
        "for one receive), late (for a request already finished) or "
        "unexpected (for a request with no receive)."
    ),
    "vllm:kv_guard_child_errors": (
        "Number of exceptions a child KV connector raised in a per-request "
        "scheduler hook that the KV wedge guard contained instead of letting "
        "them end the engine. child: the connector; hook: "
        "get_num_new_matched_tokens (prefilled locally), "
        "update_state_after_alloc (reported as a failed load) or "
        "request_finished (blocks freed)."
    ),
    "vllm:kv_guard_ledger_disagreements": (
        "Number of KV receive-completion notices on which the KV wedge guard's "
        "ledger and the scheduler disagreed; the scheduler's state won and the "
        "request ended normally. kind: no_entry or no_recv (the scheduler "
        "waited on a notice the ledger had no entry or no receive for: passed "
        "on) or not_awaited (the ledger expected a notice the scheduler no "
        "longer waits on: dropped)."
    ),
    "vllm:kv_guard_load_retry_cutoffs": (
        "Number of requests whose KV loads from one child KV connector failed "
        "max_failed_loads times; the KV wedge guard then reported no external "
        "hit for them and they were prefilled locally. child: the connector "
        "whose loads failed."
    ),
}


def test_labelled_counters_explain_every_label_in_their_help_text(
    vllm_config: Any,
) -> None:
    """``# HELP`` of each labelled counter on ``/metrics``: what it counts
    and what each of its labels' values mean (docs/runbook.md sends the
    operator there)."""
    registry = CollectorRegistry()
    GuardPromMetrics(vllm_config, _metric_types(registry), LABELNAMES, TWO_ENGINES)
    help_texts = _help(registry)
    for name, text in LABELLED_HELP.items():
        assert help_texts[name] == text, name


def test_guard_gauges_show_the_most_recent_value_across_processes(
    vllm_config: Any,
) -> None:
    """With several API-server processes (prometheus multiprocess mode) a
    gauge of the guard is the newest value, not a sum of stale ones."""
    registry = CollectorRegistry()
    prom = GuardPromMetrics(
        vllm_config, _metric_types(registry), LABELNAMES, TWO_ENGINES
    )
    for per_engine in prom._gauges.values():
        for gauge in per_engine.values():
            assert gauge._multiprocess_mode == "mostrecent"


# ---- /metrics: what a report moves ------------------------------------------------
def test_labelled_counters_count_each_report_on_its_own_engine(
    vllm_config: Any,
) -> None:
    """A report observed for engine 1 moves engine 1's series by exactly its
    counts -- one dropped notice counts one -- and a zero in a report makes
    no labelled series appear."""
    registry = CollectorRegistry()
    prom = WedgeGuardPromMetrics(
        vllm_config, _metric_types(registry), LABELNAMES, TWO_ENGINES, None
    )
    stats = GuardStats()
    stats.lateral_preemptions[("recv_done", "store")] = 1
    stats.lateral_preemptions[("promoted_idle", "pd")] = 0
    stats.dropped_recv_notices["duplicate"] = 1
    stats.child_errors["store|request_finished"] = 2
    stats.child_errors["pd|update_state_after_alloc"] = 0
    stats.ledger_disagreements["no_recv"] = 1
    stats.load_retry_cutoffs["store"] = 1
    stats.load_retry_cutoffs["pd"] = 0
    stats.wedges_resolved = 1
    stats.blocks_held_by_non_running = 7
    prom.observe({GUARD_STATS_KEY: _payload(stats)}, 1)
    series = _series(registry)
    e1 = ("engine=1", "model_name=tiny")

    def at(name: str, *labels: str) -> float | None:
        return series.get((name, tuple(sorted((*e1, *labels)))))

    assert (
        at("vllm:kv_guard_lateral_preemptions_total", "owner=store", "reason=recv_done")
        == 1
    )
    assert at("vllm:kv_guard_dropped_recv_notices_total", "kind=duplicate") == 1
    assert at("vllm:kv_guard_dropped_recv_notices_total", "kind=late") == 0
    assert (
        at("vllm:kv_guard_child_errors_total", "child=store", "hook=request_finished")
        == 2
    )
    assert at("vllm:kv_guard_ledger_disagreements_total", "kind=no_recv") == 1
    assert at("vllm:kv_guard_load_retry_cutoffs_total", "child=store") == 1
    assert at("vllm:kv_guard_wedges_resolved_total") == 1
    assert at("vllm:kv_guard_blocks_held_by_non_running") == 7
    # Engine 0 saw nothing.
    e0 = ("engine=0", "model_name=tiny")
    assert series[("vllm:kv_guard_wedges_resolved_total", e0)] == 0
    assert (
        series[
            (
                "vllm:kv_guard_dropped_recv_notices_total",
                (*e0[:1], "kind=duplicate", e0[1]),
            )
        ]
        == 0
    )
    # Zeros in the report: no series for those labels.
    names = {(n, labels) for n, labels in series}
    assert not any("owner=pd" in labels for _, labels in names)
    assert not any("child=pd" in labels for _, labels in names)


def test_a_child_without_prometheus_metrics_is_logged_once_and_skipped(
    vllm_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM 0.32's MooncakeConnector reports stats but builds no metrics:
    MultiConnector's prom metrics assert on it. The guard logs it once
    (naming the child), skips it from then on, and still passes every other
    child's stats on, with the engine index it was given."""

    class Children:
        def __init__(self) -> None:
            self.seen: list[tuple[str, int]] = []

        def observe(self, data: dict[str, Any], engine_idx: int = 0) -> None:
            (child,) = data
            if child == "MooncakeConnector":
                raise AssertionError("no prom metrics for MooncakeConnector")
            self.seen.append((child, engine_idx))

    children = Children()
    registry = CollectorRegistry()
    prom = WedgeGuardPromMetrics(
        vllm_config, _metric_types(registry), LABELNAMES, TWO_ENGINES, children
    )
    log = logging.getLogger(METRICS_LOGGER)
    log.addHandler(caplog.handler)
    saved = log.level, log.propagate
    log.setLevel(logging.DEBUG)
    log.propagate = False  # each record reaches caplog once
    try:
        for _ in range(2):
            prom.observe({"MooncakeConnector": {"n": 1}, "NixlConnector": {"n": 2}}, 1)
    finally:
        log.removeHandler(caplog.handler)
        log.level, log.propagate = saved
    assert children.seen == [("NixlConnector", 1), ("NixlConnector", 1)]
    lines = [r.getMessage() for r in caplog.records if r.name == METRICS_LOGGER]
    assert lines == [
        "KV connector MooncakeConnector reports stats without Prometheus "
        "metrics; they stay in the log line only"
    ]


def test_build_prom_metrics_keeps_multiconnector_children_metrics(
    vllm_config: Any,
) -> None:
    """The front-end's metrics for the guard connector: the guard's own and
    MultiConnector's per-child ones, side by side."""
    from vllm_mooncake.guard.connector import WedgeGuardConnector

    registry = CollectorRegistry()
    prom = WedgeGuardConnector.build_prom_metrics(
        vllm_config, _metric_types(registry), LABELNAMES, TWO_ENGINES
    )
    assert isinstance(prom, WedgeGuardPromMetrics)
    assert prom.children is not None
    assert not isinstance(prom.children, WedgeGuardPromMetrics)


# ---- the "KV Transfer metrics" log line --------------------------------------------
def test_log_line_names_every_counter_and_gauge() -> None:
    """``reduce`` is the guard's part of vLLM's "KV Transfer metrics" log
    line: each counter and gauge under its name, labelled ones summed."""
    stats = GuardStats(
        attempts_exhausted=2,
        wedges_detected=3,
        wedges_resolved=4,
        unroutable_requests=5,
        ledger_errors=6,
        recv_done_holders_waiting=7,
        blocks_held_by_non_running=8,
        stalled_steps=9,
        stranded_receives=16,
        quarantined_blocks=17,
        stuck=1,
    )
    stats.receives_failed["deadline|a"] = 18
    stats.receives_failed["sender_dead|a"] = 1
    stats.quarantine_releases["transfer_ended"] = 20
    stats.lateral_preemptions[("recv_done", "a")] = 10
    stats.lateral_preemptions[("promoted_idle", "b")] = 1
    stats.dropped_recv_notices["duplicate"] = 11
    stats.dropped_recv_notices["late"] = 1
    stats.child_errors["a|request_finished"] = 12
    stats.child_errors["b|request_finished"] = 1
    stats.ledger_disagreements["no_recv"] = 13
    stats.ledger_disagreements["no_entry"] = 1
    stats.load_retry_cutoffs["a"] = 14
    stats.load_retry_cutoffs["b"] = 1
    assert GuardKVConnectorStats.from_guard_stats(stats).reduce() == {
        "Lateral preemptions": 11,
        "Wedges detected": 3,
        "Wedges resolved": 4,
        "Attempts exhausted": 2,
        "Dropped recv notices": 12,
        "Unroutable requests": 5,
        "Child connector errors": 13,
        "Ledger disagreements": 14,
        "Load retry cutoffs": 15,
        "Receives failed": 19,
        "Quarantine releases": 20,
        "Ledger errors": 6,
        "Recv-done holders waiting": 7,
        "Blocks held by non-running": 8,
        "Stalled steps": 9,
        "Stranded receives": 16,
        "Quarantined blocks": 17,
        "Stuck": 1,
    }


def test_an_empty_report_sets_no_gauge_and_aggregates_only_like_reports() -> None:
    """A reset report carries zeros that are no measurement (gauges_changed
    is False, not merely falsy), and a report of another kind is refused
    naming its type."""
    report = GuardKVConnectorStats()
    report.reset()
    assert report.data["gauges_changed"] is False
    assert report.is_empty()

    class Other(GuardKVConnectorStats.__mro__[1]):  # vLLM's KVConnectorStats
        pass

    with pytest.raises(
        TypeError, match="^cannot aggregate Other into GuardKVConnectorStats$"
    ):
        report.aggregate(Other(data={}))
