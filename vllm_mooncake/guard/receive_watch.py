"""The receive watch: async receives that never land are found, per event.

A room of the guard's scheduler side (``docs/architecture.md``). A receive
in flight is never a lateral victim: its sender may still write into its
blocks. That rule is right while the sender lives; when the sender died or
went silent, the receive never lands and its blocks are held for nobody.
vLLM bounds that only by Mooncake's 480 s pull timeout, and never for NIXL
reads. The watch bounds it:

1. a receive starts (:meth:`ReceiveWatch.started`, from the allocation that
   put it in flight): its deadline (``recv_deadline_s``), its halfway mark
   and, if its sender is known (``senders.py``), its first probe go on a
   heap of events;
2. it ends (:meth:`ReceiveWatch.ended`: its notice arrived, or the guard
   failed it): its events are void;
3. an event comes due (:meth:`ReceiveWatch.due`, asked by the guarded
   scheduler before each ``schedule()`` only once the earliest event is
   due): a deadline fails the receive (reason ``deadline``); a halfway mark
   counts it stranded; a probe asks the sender's liveness again and fails
   the receive once the sender is dead (reason ``sender_dead``).

The cost is per event -- a receive starts, ends, or one of its times comes
-- never per request per step: a step with nothing due compares one float.
The ledger's receive state is checked at each event (vLLM's state reaches
it through the notices), so a receive that landed is never failed. What a
failed receive becomes is the guarded scheduler's (``stranded.py``).

No vLLM import.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from vllm_mooncake.guard.config import GuardConfig
from vllm_mooncake.guard.ledger import BlockLedger, RecvState
from vllm_mooncake.guard.senders import Sender, SenderProbes
from vllm_mooncake.guard.stats import GuardStats


class FailureReason(enum.Enum):
    DEADLINE = "deadline"
    SENDER_DEAD = "sender_dead"


class Stranded(NamedTuple):
    """A receive the guard fails now."""

    req_id: str
    owner: str | None
    sender: Sender | None
    reason: FailureReason
    age_s: float


class _Event(enum.IntEnum):
    DEADLINE = 0
    HALFWAY = 1
    PROBE = 2


@dataclass(slots=True)
class _Receive:
    owner: str | None
    sender: Sender | None
    started: float
    token: int  # which start of the request this is (older events are void)


class ReceiveWatch:
    """Deadlines, halfway marks and sender probes of the receives in flight."""

    def __init__(
        self,
        config: GuardConfig,
        ledger: BlockLedger,
        stats: GuardStats,
        probes: SenderProbes,
    ) -> None:
        self.config = config
        self._ledger = ledger
        self._stats = stats
        self._probes = probes
        self.clock: Callable[[], float] = time.monotonic
        self._live: dict[str, _Receive] = {}
        self._events: list[tuple[float, int, _Event, str]] = []
        self._tokens = itertools.count()
        self._stranded: set[str] = set()
        # When the earliest event comes due (inf: none).
        self.next_due = math.inf

    def __len__(self) -> int:
        return len(self._live)

    def started(self, req_id: str, owner: str | None, sender: Sender | None) -> None:
        """``req_id``'s async receive from ``owner`` is in flight from now."""
        now = self.clock()
        token = next(self._tokens)
        self._live[req_id] = _Receive(owner, sender, now, token)
        deadline = self.config.recv_deadline_s
        self._push(now + deadline, token, _Event.DEADLINE, req_id)
        self._push(now + deadline / 2, token, _Event.HALFWAY, req_id)
        probe_s = self.config.sender_probe_s
        if sender is not None and probe_s > 0:
            self._push(now + probe_s, token, _Event.PROBE, req_id)

    def ended(self, req_id: str) -> None:
        """``req_id``'s receive is over (landed, failed, or failed by us)."""
        if self._live.pop(req_id, None) is not None and req_id in self._stranded:
            self._stranded.discard(req_id)
            self._stats.stranded_receives = len(self._stranded)

    def due(self, now: float) -> list[Stranded]:
        """The events due by ``now``; the receives to fail now."""
        out: list[Stranded] = []
        events = self._events
        while events and events[0][0] <= now:
            _, token, kind, req_id = heapq.heappop(events)
            receive = self._live.get(req_id)
            if receive is None or receive.token != token:
                continue  # that receive is over
            if self._ledger.recv_state(req_id) is not RecvState.IN_FLIGHT:
                self.ended(req_id)  # landed: the notice said so
                continue
            if kind is _Event.DEADLINE:
                out.append(self._fail(req_id, receive, FailureReason.DEADLINE, now))
            elif kind is _Event.HALFWAY:
                self._mark_stranded(req_id)
            else:
                failed = self._probe(req_id, receive, now)
                if failed is not None:
                    out.append(failed)
        self.next_due = events[0][0] if events else math.inf
        return out

    def _probe(self, req_id: str, receive: _Receive, now: float) -> Stranded | None:
        sender = receive.sender
        assert sender is not None  # only receives with a sender get probes
        if self._probes.is_dead(sender):
            return self._fail(req_id, receive, FailureReason.SENDER_DEAD, now)
        if self._probes.refused(sender):
            self._mark_stranded(req_id)
        self._probes.ask(sender)
        next_probe = now + self.config.sender_probe_s
        self._push(next_probe, receive.token, _Event.PROBE, req_id)
        return None

    def _fail(
        self, req_id: str, receive: _Receive, reason: FailureReason, now: float
    ) -> Stranded:
        self.ended(req_id)
        age = now - receive.started
        return Stranded(req_id, receive.owner, receive.sender, reason, age)

    def _mark_stranded(self, req_id: str) -> None:
        if req_id not in self._stranded:
            self._stranded.add(req_id)
            self._stats.stranded_receives = len(self._stranded)

    def _push(self, when: float, token: int, kind: _Event, req_id: str) -> None:
        heapq.heappush(self._events, (when, token, kind, req_id))
        if when < self.next_due:
            self.next_due = when


__all__ = ["FailureReason", "ReceiveWatch", "Stranded"]
