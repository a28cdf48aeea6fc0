"""The guard's stats reach Prometheus the way vLLM's front-end records them.

Each test drives vLLM's real scheduler through the W1 wedge with the guard,
takes the ``SchedulerStats`` the engine core returns (round-tripped through
vLLM's msgpack codec, as between engine core and front-end), and records them
with vLLM's own front-end code: ``KVConnectorProm`` / ``KVConnectorLogging``
(which call ``WedgeGuardConnector.build_prom_metrics`` and
``build_kv_connector_stats``) or the whole ``PrometheusStatLogger``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorStats,
)
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.request import RequestStatus
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_mooncake import CONNECTOR_NAME
from vllm_mooncake.guard.connector import WedgeGuardConnector
from vllm_mooncake.guard.kv_stats import (
    GUARD_STATS_KEY,
    GuardKVConnectorStats,
    rebuild_guard_entry,
)
from vllm_mooncake.guard.stats import GuardStats
from vllm_mooncake.testing.configs import guarded, pd_transfer, store_hit
from vllm_mooncake.testing.driver import SchedulerDriver, StepResult
from vllm_mooncake.testing.prom import prom_in
from vllm_mooncake.testing.wedges import W1, play

LABELNAMES = ["model_name", "engine"]
ENGINE_LABELS: dict[int, list[object]] = {0: ["tiny", "0"]}
GUARD_LOGGER = "vllm.vllm_mooncake.guard.stall_watch"


# ---- helpers --------------------------------------------------------------------
def connector_of(d: SchedulerDriver) -> WedgeGuardConnector:
    connector = d.scheduler.connector
    assert isinstance(connector, WedgeGuardConnector)
    return connector


def reported_payloads(results: list[StepResult]) -> list[dict[str, Any]]:
    """``SchedulerStats.kv_connector_stats`` of every step, as the front-end
    receives them (msgpack round trip of the engine core's outputs)."""
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    payloads = []
    for result in results:
        for outputs in result.engine_outputs.values():
            received = decoder.decode(encoder.encode(outputs))
            stats = received.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                payloads.append(stats.kv_connector_stats)
    return payloads


def samples(exposition: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Parse ``/metrics`` text: (sample name, labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(
    parsed: dict[tuple[str, frozenset[tuple[str, str]]], float],
    name: str,
    **labels: str,
) -> float | None:
    """The one sample named ``name`` whose labels include ``labels``."""
    hits = [
        v
        for (n, ls), v in parsed.items()
        if n == name and set(labels.items()) <= set(ls)
    ]
    assert len(hits) <= 1, f"{name} {labels}: {len(hits)} samples"
    return hits[0] if hits else None


def messages(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == GUARD_LOGGER and r.levelno == level and text in r.getMessage()
    ]


# ---- W1 resolved by the valve: the counters on /metrics ---------------------------
def test_w1_lateral_preemption_reaches_prometheus() -> None:
    d = SchedulerDriver.build(W1.shape, guarded())
    results = play(d, W1, max_steps=300)
    assert d.finished == {"X": "length", "Y": "length"}
    connector = connector_of(d)
    assert connector.scheduler_side.stats.lateral_preemptions == {
        ("recv_done", "ScriptedLoadConnector[1]"): 1
    }

    payloads = reported_payloads(results)
    assert payloads and all(set(p) == {GUARD_STATS_KEY} for p in payloads)

    # The front-end resolves the connector class from kv_transfer_config ...
    ktc = d.scheduler.vllm_config.kv_transfer_config
    connector_cls = KVConnectorFactory.get_connector_class(ktc)
    assert connector_cls is WedgeGuardConnector
    # ... rebuilds each payload with it ...
    rebuilt = [connector_cls.build_kv_connector_stats(p) for p in payloads]
    assert all(isinstance(s, MultiKVConnectorStats) for s in rebuilt)
    entries = [s.data[GUARD_STATS_KEY] for s in rebuilt if s is not None]
    assert len(entries) == len(payloads)
    assert all(isinstance(e, GuardKVConnectorStats) for e in entries)
    # ... and the reports are deltas: together they are the scheduler's stats.
    total = GuardKVConnectorStats()
    for entry in entries:
        total.aggregate(entry)
    assert total.guard_stats == connector.scheduler_side.stats
    assert total.reduce()["Lateral preemptions"] == 1
    assert total.reduce()["Wedges resolved"] == 1

    # Nothing changed since the last step: nothing more to report.
    assert connector.get_kv_connector_stats() is None

    # Prometheus, through vLLM's KVConnectorProm -> build_prom_metrics.
    registry = CollectorRegistry()
    prom = prom_in(registry)(d.scheduler.vllm_config, LABELNAMES, ENGINE_LABELS)
    for payload in payloads:
        prom.observe(payload, 0)
    exposition = generate_latest(registry).decode()
    assert "vllm:kv_guard_lateral_preemptions" in exposition
    parsed = samples(exposition)
    assert (
        value(
            parsed,
            "vllm:kv_guard_lateral_preemptions_total",
            reason="recv_done",
            owner="ScriptedLoadConnector[1]",
            model_name="tiny",
            engine="0",
        )
        == 1
    )
    assert value(parsed, "vllm:kv_guard_wedges_resolved_total") == 1
    assert value(parsed, "vllm:kv_guard_wedges_detected_total") == 0
    assert value(parsed, "vllm:kv_guard_attempts_exhausted_total") == 0
    assert value(parsed, "vllm:kv_guard_unroutable_requests_total") == 0
    for kind in ("duplicate", "late", "unexpected"):
        assert value(parsed, "vllm:kv_guard_dropped_recv_notices_total", kind=kind) == 0
    # Gauges as of the last step: the wedge is gone.
    assert value(parsed, "vllm:kv_guard_stalled_steps") == 0
    assert value(parsed, "vllm:kv_guard_blocks_held_by_non_running") == 0
    assert value(parsed, "vllm:kv_guard_recv_done_holders_waiting") == 0

    # The CLI log path rebuilds and reduces the same payloads.
    logging_ = KVConnectorLogging(ktc)
    for payload in payloads:
        logging_.observe(payload)
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "'Lateral preemptions': 1" in lines[0]


def test_w1_through_vllm_prometheus_stat_logger() -> None:
    """The whole front-end logger, on the global registry /metrics serves."""
    d = SchedulerDriver.build(W1.shape, guarded())
    vllm_config = d.scheduler.vllm_config
    stat_logger = PrometheusStatLogger(vllm_config, engine_indexes=[0])
    try:
        encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
        for result in play(d, W1, max_steps=300):
            for outputs in result.engine_outputs.values():
                received = decoder.decode(encoder.encode(outputs))
                if received.scheduler_stats is not None:
                    stat_logger.record(received.scheduler_stats, None, engine_idx=0)
        parsed = samples(generate_latest(REGISTRY).decode())
    finally:
        unregister_vllm_metrics()
    model = str(vllm_config.model_config.served_model_name)
    assert (
        value(
            parsed,
            "vllm:kv_guard_lateral_preemptions_total",
            reason="recv_done",
            model_name=model,
            engine="0",
        )
        == 1
    )
    assert value(parsed, "vllm:kv_guard_wedges_resolved_total", model_name=model) == 1


def test_each_step_carries_what_the_guard_did_in_it() -> None:
    """The step of the lateral preemption reports it, and every step whose
    gauges moved reports them -- not a later step that happens to carry a
    worker's transfer stats (vLLM before 0.24 asks the connector only then;
    on a real server a preemption showed up seconds late). The scripted
    workers here report no stats of their own."""
    d = SchedulerDriver.build(W1.shape, guarded())
    side = connector_of(d).scheduler_side
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    before = [GuardStats()]
    reported_steps: list[int] = []

    def check(result: StepResult) -> None:
        now = GuardStats.from_dict(side.stats.to_dict())
        payload: dict[str, Any] = {}
        for outputs in result.engine_outputs.values():
            stats = decoder.decode(encoder.encode(outputs)).scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                payload = stats.kv_connector_stats
        moved = now.fingerprint() != before[0].fingerprint()
        assert bool(payload) == moved, f"step {result.index}: moved={moved}"
        if moved:
            rest, report = rebuild_guard_entry(payload)
            assert report is not None and rest == {}
            lateral = report.guard_stats.total_lateral_preemptions
            earlier = before[0].total_lateral_preemptions
            assert lateral == now.total_lateral_preemptions - earlier
            assert report.guard_stats.stalled_steps == now.stalled_steps
            reported_steps.append(result.index)
        before[0] = now

    play(d, W1, max_steps=300, after_step=check)
    assert side.stats.total_lateral_preemptions == 1
    assert len(reported_steps) >= 2


# ---- the log lines ------------------------------------------------------------
def test_w1_admission_failure_is_logged(guard_log: pytest.LogCaptureFixture) -> None:
    d = SchedulerDriver.build(W1.shape, guarded())
    play(d, W1, max_steps=300)
    warnings = messages(guard_log, logging.WARNING, "wedge guard: admission failed")
    assert len(warnings) == 1
    assert "lateral preemption of Y (recv_done" in warnings[0]
    assert "for X" in warnings[0]
    assert not messages(guard_log, logging.ERROR, "wedge alarm")


def test_w1_under_reserve_raises_the_wedge_alarm(
    guard_log: pytest.LogCaptureFixture,
) -> None:
    d = SchedulerDriver.build(W1.shape, guarded(policy="reserve", stall_alarm_steps=20))
    results = play(d, W1, max_steps=100)
    stats = connector_of(d).scheduler_side.stats
    # "reserve" observes only: the wedge stays, the alarm fires once.
    assert d.finished == {}
    alarms = messages(guard_log, logging.ERROR, "wedge alarm")
    assert len(alarms) == 1
    assert "no token scheduled for 20 steps" in alarms[0]
    assert "policy=reserve" in alarms[0]
    assert stats.wedges_detected == 1
    assert stats.total_lateral_preemptions == 0
    assert not messages(guard_log, logging.WARNING, "wedge guard: admission failed")

    registry = CollectorRegistry()
    prom = prom_in(registry)(d.scheduler.vllm_config, LABELNAMES, ENGINE_LABELS)
    for payload in reported_payloads(results):
        prom.observe(payload, 0)
    parsed = samples(generate_latest(registry).decode())
    assert value(parsed, "vllm:kv_guard_wedges_detected_total") == 1
    assert value(parsed, "vllm:kv_guard_wedges_resolved_total") == 0
    assert value(parsed, "vllm:kv_guard_lateral_preemptions_total") is None
    assert value(parsed, "vllm:kv_guard_stalled_steps") == stats.stalled_steps > 20
    assert value(parsed, "vllm:kv_guard_blocks_held_by_non_running") == 90
    assert value(parsed, "vllm:kv_guard_recv_done_holders_waiting") == 1


# ---- the holder gauges on a busy rank ---------------------------------------------
def _busy_rank_with_a_holder(interval: float) -> tuple[SchedulerDriver, list[float]]:
    """R decodes; H then waits for a P->D receive that lands after 6 steps."""
    d = SchedulerDriver.build(W1.shape, guarded(gauge_interval_s=interval))
    now = [0.0]
    connector_of(d).scheduler_side.watch.clock = lambda: now[0]
    d.add("R", 64, max_tokens=40)
    for _ in range(3):
        d.step()
    d.add("H", 64, max_tokens=4, kv_transfer_params=pd_transfer(6))
    d.step()  # H allocated, its receive in flight; R still decodes
    assert d.scheduler.requests["H"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return d, now


def test_busy_steps_recount_the_holder_gauges_once_per_interval() -> None:
    """While R decodes, H's blocks show once gauge_interval_s has passed
    (the clock is frozen in between), and 0 on the step H leaves, with no
    time passed: empty queues are always counted."""
    d, now = _busy_rank_with_a_holder(interval=0.1)
    stats = connector_of(d).scheduler_side.stats
    d.step()
    assert stats.blocks_held_by_non_running == 0  # not recounted yet
    now[0] += 0.1
    d.step()
    held = stats.blocks_held_by_non_running
    assert held == len(d.scheduler.kv_cache_manager.get_block_ids("H")[0]) > 0
    while d.scheduler.requests["H"].status != RequestStatus.RUNNING:
        d.step()
        assert d.scheduler.running
    assert stats.blocks_held_by_non_running == 0


def test_gauge_interval_zero_recounts_every_step() -> None:
    d, _ = _busy_rank_with_a_holder(interval=0.0)
    d.step()
    assert connector_of(d).scheduler_side.stats.blocks_held_by_non_running > 0


# ---- the stats object ---------------------------------------------------------
def test_guard_stats_payload_aggregates_counters_and_keeps_newest_gauges() -> None:
    older = GuardStats(wedges_resolved=1, stalled_steps=5)
    older.lateral_preemptions[("recv_done", "NixlConnector")] += 1
    newer = GuardStats(wedges_resolved=2, stalled_steps=0)
    newer.lateral_preemptions[("recv_done", "NixlConnector")] += 2
    newer.dropped_recv_notices["late"] += 1

    a = GuardKVConnectorStats.from_guard_stats(older)
    a.aggregate(GuardKVConnectorStats.from_guard_stats(newer))
    merged = a.guard_stats
    assert merged.wedges_resolved == 3
    assert merged.lateral_preemptions[("recv_done", "NixlConnector")] == 3
    assert merged.dropped_recv_notices["late"] == 1
    assert merged.stalled_steps == 0
    # An empty report (no gauge measurement) does not overwrite gauges.
    a.aggregate(GuardKVConnectorStats())
    assert a.guard_stats.stalled_steps == 0 and a.gauges_changed
    b = GuardKVConnectorStats.from_guard_stats(older)
    b.aggregate(GuardKVConnectorStats())
    assert b.guard_stats.stalled_steps == 5

    assert GuardKVConnectorStats().is_empty()
    assert not GuardKVConnectorStats.from_guard_stats(GuardStats()).is_empty()
    assert GuardKVConnectorStats.from_guard_stats(GuardStats(), False).is_empty()
    a.reset()
    assert a.is_empty() and a.guard_stats == GuardStats()


@pytest.mark.parametrize(
    "moved",
    ["none", "counter", "lateral", "labeled", "gauge"],
)
def test_report_emptiness_read_from_data_matches_the_stats(moved: str) -> None:
    """``is_empty`` reads the report's data directly (vLLM asks every step);
    it must say what the rebuilt stats say."""
    stats = GuardStats()
    if moved == "counter":
        stats.wedges_resolved = 1
    elif moved == "lateral":
        stats.lateral_preemptions[("recv_done", "nixl")] = 1
    elif moved == "labeled":
        stats.load_retry_cutoffs["store"] = 1
    elif moved == "gauge":
        stats.stalled_steps = 3
    report = GuardKVConnectorStats.from_guard_stats(stats, moved == "gauge")
    assert report.is_empty() == (report.guard_stats.is_empty() and moved != "gauge")
    assert report.is_empty() == (moved == "none")
    gauges = GuardKVConnectorStats.of_gauges(stats)
    assert not gauges.is_empty()
    assert gauges.guard_stats.stalled_steps == stats.stalled_steps
    assert gauges.guard_stats.total_lateral_preemptions == 0


def test_build_kv_connector_stats_keeps_objects_and_handles_none() -> None:
    assert isinstance(
        WedgeGuardConnector.build_kv_connector_stats(None), MultiKVConnectorStats
    )
    entry = GuardKVConnectorStats.from_guard_stats(GuardStats(wedges_detected=1))
    rebuilt = WedgeGuardConnector.build_kv_connector_stats({CONNECTOR_NAME: entry})
    assert rebuilt is not None and rebuilt.data[CONNECTOR_NAME] is entry


# ---- a contained child fault on /metrics ------------------------------------------
def test_contained_child_fault_reaches_prometheus() -> None:
    d = SchedulerDriver.build(W1.shape, guarded(kv_load_failure_policy="recompute"))
    d.add("X", 64, max_tokens=2, kv_transfer_params=pd_transfer(1, raise_in="alloc"))
    results = d.run(40)
    assert d.finished == {"X": "length"}
    registry = CollectorRegistry()
    prom = prom_in(registry)(d.scheduler.vllm_config, LABELNAMES, ENGINE_LABELS)
    for payload in reported_payloads(results):
        prom.observe(payload, 0)
    parsed = samples(generate_latest(registry).decode())
    assert (
        value(
            parsed,
            "vllm:kv_guard_child_errors_total",
            child="ScriptedLoadConnector[1]",
            hook="update_state_after_alloc",
        )
        == 1
    )


# ---- the load-retry budget and ledger disagreements on /metrics --------------------
def test_load_retry_cutoff_and_ledger_disagreement_reach_prometheus() -> None:
    """A store that always fails (recompute: cut off after 3 loads) and a
    receive vLLM waits on that the ledger never saw start (passed on)."""
    d = SchedulerDriver.build(W1.shape, guarded(kv_load_failure_policy="recompute"))
    d.add("S", 64, max_tokens=2, kv_transfer_params=store_hit(64, 1, outcome="fail"))
    r = d.add("R", 32, max_tokens=2)
    r.status = RequestStatus.WAITING_FOR_REMOTE_KVS  # started unseen by the ledger
    results = [d.step(finished_recving={"R"})]
    results += d.run(60)
    assert d.finished == {"S": "length", "R": "length"}
    registry = CollectorRegistry()
    prom = prom_in(registry)(d.scheduler.vllm_config, LABELNAMES, ENGINE_LABELS)
    for payload in reported_payloads(results):
        prom.observe(payload, 0)
    exposition = generate_latest(registry).decode()
    parsed = samples(exposition)
    cutoffs = "vllm:kv_guard_load_retry_cutoffs_total"
    assert value(parsed, cutoffs, child="ScriptedLoadConnector[0]") == 1
    disagreements = "vllm:kv_guard_ledger_disagreements_total"
    assert value(parsed, disagreements, kind="no_recv") == 1
    for kind in ("no_entry", "not_awaited"):  # exposed at 0 from the start
        assert value(parsed, disagreements, kind=kind) == 0
    assert "# HELP vllm:kv_guard_load_retry_cutoffs_total" in exposition
    assert "# HELP vllm:kv_guard_ledger_disagreements_total" in exposition
    total = GuardKVConnectorStats()
    for payload in reported_payloads(results):
        rebuilt = WedgeGuardConnector.build_kv_connector_stats(payload)
        assert rebuilt is not None
        total.aggregate(rebuilt.data[GUARD_STATS_KEY])
    assert total.reduce()["Load retry cutoffs"] == 1
    assert total.reduce()["Ledger disagreements"] == 1


def test_every_counter_and_gauge_moves_the_stats_fingerprint() -> None:
    """The connector skips a report when the fingerprint did not move: every
    counter, label and gauge must move it (a new field included)."""
    stats = GuardStats()
    seen = {stats.fingerprint()}
    for name in GuardStats.COUNTERS + GuardStats.GAUGES:
        setattr(stats, name, getattr(stats, name) + 1)
        seen.add(stats.fingerprint())
    stats.lateral_preemptions[("recv_done", "nixl")] += 1
    seen.add(stats.fingerprint())
    for name in GuardStats.LABELED:
        getattr(stats, name)["x"] += 1
        seen.add(stats.fingerprint())
    moves = len(GuardStats.COUNTERS + GuardStats.GAUGES + GuardStats.LABELED) + 1
    assert len(seen) == 1 + moves
