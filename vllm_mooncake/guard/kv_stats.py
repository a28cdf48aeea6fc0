"""The guard's entry in vLLM's KV-connector stats: built, carried, rebuilt.

How the guard's counters and gauges (``stats.py``) reach ``/metrics``
(vLLM 0.32):

1. Engine core: after every step ``Scheduler.update_from_output`` calls
   ``connector.get_kv_connector_stats()``. ``WedgeGuardConnector`` returns
   MultiConnector's per-child stats plus a :data:`GUARD_STATS_KEY` entry, a
   :class:`GuardKVConnectorStats` holding the counters accumulated since the
   previous call and the gauges as of this step (:func:`guard_stats_report`,
   :func:`with_guard_report`). The scheduler sends ``to_dict()`` of it to the
   front-end in ``SchedulerStats.kv_connector_stats``.
2. Front-end: ``PrometheusStatLogger`` observes every payload with the
   metrics ``WedgeGuardConnector.build_prom_metrics`` built (``metrics.py``);
   ``LoggingStatLogger`` rebuilds the payload with
   ``WedgeGuardConnector.build_kv_connector_stats``
   (:func:`rebuild_guard_entry`) and logs
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

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorStats,
)

from vllm_mooncake import CONNECTOR_NAME
from vllm_mooncake.guard.ledger import DroppedNotices
from vllm_mooncake.guard.stats import GuardStats

GUARD_STATS_KEY = CONNECTOR_NAME
"""The guard's entry in the connector stats dict (MultiConnector keys its
children by class name; a front-end resolves entries by registered name)."""

GAUGES_CHANGED = "gauges_changed"
"""Payload key: the gauges in this payload are current and must be set."""

DROPPED_KINDS = tuple(f.name for f in fields(DroppedNotices))
"""The kinds of receive notice the guard drops (a label of its metric)."""


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
            "Receives failed": sum(stats.receives_failed.values()),
            "Quarantine releases": sum(stats.quarantine_releases.values()),
            "Ledger errors": stats.ledger_errors,
            "Recv-done holders waiting": stats.recv_done_holders_waiting,
            "Blocks held by non-running": stats.blocks_held_by_non_running,
            "Stalled steps": stats.stalled_steps,
            "Stranded receives": stats.stranded_receives,
            "Quarantined blocks": stats.quarantined_blocks,
            "Stuck": stats.stuck,
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


__all__ = [
    "DROPPED_KINDS",
    "GAUGES_CHANGED",
    "GUARD_STATS_KEY",
    "GuardKVConnectorStats",
    "guard_stats_report",
    "rebuild_guard_entry",
    "stats_carrier",
    "with_guard_report",
]
