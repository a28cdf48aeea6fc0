"""Guard counters and gauges: a plain object the scheduler, the simulator and
the Prometheus adapter all read (no vLLM import)."""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GuardStats:
    # (reason, owning child) -> lateral preemptions
    lateral_preemptions: Counter[tuple[str, str]] = field(default_factory=Counter)
    # schedule() calls that wanted another lateral preemption past max_attempts
    attempts_exhausted: int = 0
    # wedge alarms raised (stall_alarm_steps zero-token steps with holders)
    wedges_detected: int = 0
    # stalls that the valve ended (one per schedule() call that preempted)
    wedges_resolved: int = 0
    # receive notices dropped: duplicate / late / unexpected
    dropped_recv_notices: Counter[str] = field(default_factory=Counter)
    # requests whose remote prefill no child could serve (recomputed locally)
    unroutable_requests: int = 0
    # ledger inconsistencies logged (raised instead when strict)
    ledger_errors: int = 0
    # "child|hook" -> raises of a child connector the guard contained
    child_errors: Counter[str] = field(default_factory=Counter)
    # kind -> receive notices on which the ledger and vLLM disagreed (vLLM's
    # state won): no_entry / no_recv (vLLM waited on a notice the ledger
    # would have dropped: passed on) or not_awaited (the ledger expected a
    # notice vLLM no longer waits on: dropped)
    ledger_disagreements: Counter[str] = field(default_factory=Counter)
    # child -> requests whose loads from that child failed max_failed_loads
    # times and that are computed locally from then on
    load_retry_cutoffs: Counter[str] = field(default_factory=Counter)
    # "reason|child" -> async receives the guard failed: deadline (in flight
    # past recv_deadline_s) or sender_dead (the sender refused its probes)
    receives_failed: Counter[str] = field(default_factory=Counter)
    # reason -> quarantines ended: transfer_ended (the worker reported the
    # receive's end) or sender_dead
    quarantine_releases: Counter[str] = field(default_factory=Counter)
    # gauges, as of the last step
    recv_done_holders_waiting: int = 0
    blocks_held_by_non_running: int = 0
    stalled_steps: int = 0
    # receives in flight past half recv_deadline_s, or whose sender refused a
    # probe; blocks kept out of the free pool because a failed receive's
    # writer may still write them; 1 while no token was scheduled for
    # recv_deadline_s with requests waiting (readiness: tools/ready.py)
    stranded_receives: int = 0
    quarantined_blocks: int = 0
    stuck: int = 0

    COUNTERS = (
        "attempts_exhausted",
        "wedges_detected",
        "wedges_resolved",
        "unroutable_requests",
        "ledger_errors",
    )
    GAUGES = (
        "recv_done_holders_waiting",
        "blocks_held_by_non_running",
        "stalled_steps",
        "stranded_receives",
        "quarantined_blocks",
        "stuck",
    )
    # Counters by one string label (the Counter's key).
    LABELED = (
        "dropped_recv_notices",
        "child_errors",
        "ledger_disagreements",
        "load_retry_cutoffs",
        "receives_failed",
        "quarantine_releases",
    )

    def fingerprint(self) -> tuple[int, tuple[int, ...]]:
        """(counters' total, gauges): equal for two moments of one stats
        object with nothing changed in between -- a cheap check before
        building a report. Every counter only grows, so any increment raises
        the total."""
        total = sum(_COUNTER_VALUES(self)) + sum(self.lateral_preemptions.values())
        for counter in _LABELED_COUNTERS(self):
            total += sum(counter.values())
        return total, _GAUGE_VALUES(self)

    @classmethod
    def gauges_dict(cls, stats: GuardStats) -> dict[str, Any]:
        """``to_dict()`` of stats with no counters and ``stats``'s gauges."""
        out: dict[str, Any] = dict.fromkeys(cls.COUNTERS, 0)
        out.update({name: getattr(stats, name) for name in cls.GAUGES})
        out["lateral_preemptions"] = {}
        for name in cls.LABELED:
            out[name] = {}
        return out

    @property
    def total_lateral_preemptions(self) -> int:
        return sum(self.lateral_preemptions.values())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in self.COUNTERS}
        out.update({name: getattr(self, name) for name in self.GAUGES})
        out["lateral_preemptions"] = {
            f"{reason}|{owner}": n
            for (reason, owner), n in self.lateral_preemptions.items()
        }
        for name in self.LABELED:
            out[name] = dict(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GuardStats:
        stats = cls()
        for name in cls.COUNTERS + cls.GAUGES:
            setattr(stats, name, int(data.get(name, 0)))
        for key, n in data.get("lateral_preemptions", {}).items():
            reason, _, owner = key.partition("|")
            stats.lateral_preemptions[(reason, owner)] = int(n)
        for name in cls.LABELED:
            getattr(stats, name).update(data.get(name, {}))
        return stats

    def delta_since(self, earlier: GuardStats) -> GuardStats:
        """Counters accumulated since ``earlier``; gauges as now."""
        out = GuardStats.from_dict(self.to_dict())
        for name in self.COUNTERS:
            setattr(out, name, getattr(self, name) - getattr(earlier, name))
        out.lateral_preemptions = self.lateral_preemptions - earlier.lateral_preemptions
        for name in self.LABELED:
            setattr(out, name, getattr(self, name) - getattr(earlier, name))
        return out

    def merge(self, other: GuardStats) -> GuardStats:
        """Counters added; gauges taken from ``other`` (the newer one)."""
        out = GuardStats.from_dict(other.to_dict())
        for name in self.COUNTERS:
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.lateral_preemptions = self.lateral_preemptions + other.lateral_preemptions
        for name in self.LABELED:
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def is_empty(self) -> bool:
        return not any(getattr(self, n) for n in self.COUNTERS) and not (
            self.lateral_preemptions or any(getattr(self, n) for n in self.LABELED)
        )


_COUNTER_VALUES = operator.attrgetter(*GuardStats.COUNTERS)
_GAUGE_VALUES = operator.attrgetter(*GuardStats.GAUGES)
_LABELED_COUNTERS = operator.attrgetter(*GuardStats.LABELED)


__all__ = [
    "GuardStats",
]
