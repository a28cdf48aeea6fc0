"""The block ledger: what every request holds, who loads it, where its receive is.

A plain class with no vLLM import. The guard connector feeds it from vLLM's
scheduler-side connector hooks; the guarded scheduler asks it for a lateral
victim. Life cycle of a request, as the ledger sees it::

    1. arrived     on_arrival          (connector.on_new_request)
    2. looked up   on_lookup           (get_num_new_matched_tokens: the owning
                                        child -- the guard's one record of it
                                        --, whether the load is async, and
                                        where it starts)
    3. allocated   on_alloc            (update_state_after_alloc)
                   -> recv IN_FLIGHT if an async load started
    4. received    accept_recv_complete (update_from_output, before vLLM
                                        reads the notices)
                   -> recv DONE or FAILED; duplicates and late notices dropped,
                   unless vLLM still waits on the notice: then vLLM's state
                   wins (overrule_recv_complete) and the disagreement is
                   counted
                   on_load_failed      (a failed or partly invalid load):
                   counts toward the owner's load-retry budget; past it the
                   request is computed locally (cut_off)
    5. promoted / running
                   on_scheduled        (build_connector_meta: the worker now
                                        knows the request; ``executed`` is set)
    6. preempted   on_preempted        (running-side, vLLM's own) or
                   on_lateral_preempt  (ours): blocks gone, back to 2.
    7. finished    on_finished         (request_finished): the entry goes,
                   unless a receive is still in flight -- then it drains
                   until that receive lands (its blocks are freed then).

Lateral candidates (:meth:`BlockLedger.pick_victim`) are waiting requests
that hold blocks and whose receive is not in flight: recv-done
WAITING_FOR_REMOTE_KVS requests, and promoted-but-never-run WAITING /
PREEMPTED holders. Never RUNNING, never waiting for a grammar, never the
request being admitted. Least progressed first, ties by latest arrival.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, KeysView, Sequence
from dataclasses import dataclass

ReqId = str


class LedgerError(RuntimeError):
    """A hook arrived that the request's current state does not allow."""


class RecvState(enum.Enum):
    # No async receive: no load, a synchronous load, or blocks already given up.
    NONE = "none"
    # An async receive started; a transfer may still be writing the blocks.
    IN_FLIGHT = "in_flight"
    # The receive completed; the blocks hold the loaded KV.
    DONE = "done"
    # The receive completed with a failure (fully or partly invalid KV).
    FAILED = "failed"


class WaitStatus(enum.Enum):
    """The scheduler's status of a request, as far as the guard cares."""

    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    WAITING = "waiting"
    PREEMPTED = "preempted"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    RUNNING = "running"
    OTHER = "other"


class VictimReason(enum.Enum):
    # WAITING_FOR_REMOTE_KVS whose receive finished but was never promoted.
    RECV_DONE = "recv_done"
    # Promoted after its load (WAITING / PREEMPTED) and not run since.
    PROMOTED_IDLE = "promoted_idle"


@dataclass(slots=True)
class LedgerEntry:
    req_id: ReqId
    arrival: int  # arrival order, 0-based
    owner: str | None = None  # child connector that owns the load
    recv: RecvState = RecvState.NONE
    num_blocks: int = 0  # blocks held, as of the last allocation we saw
    computed_tokens: int = 0
    executed: bool = False  # ever sent to the worker as a new request
    finished: bool = False  # finished while a receive was in flight
    pending_async: bool = False  # the last lookup offered an async load
    # tokens computed locally when the load was looked up: the load fills the
    # blocks from there (a load that never starts fails from there)
    load_start: int = 0
    # child -> loads of this request from that child that failed (made on
    # the first failure: most requests never have one)
    failed_loads: dict[str, int] | None = None
    # children whose hits this request no longer takes (retry budget spent)
    cut_off: set[str] | None = None


@dataclass(frozen=True)
class HolderView:
    """What the scheduler sees of one waiting request right now."""

    req_id: ReqId
    status: WaitStatus
    num_computed_tokens: int
    num_blocks: int
    recv_finished: bool  # in the scheduler's finished-receive set


@dataclass(frozen=True)
class Victim:
    req_id: ReqId
    reason: VictimReason
    owner: str | None
    num_blocks: int
    num_computed_tokens: int


class Disagreement(enum.Enum):
    """How the ledger and vLLM disagreed on a receive notice (vLLM wins)."""

    # vLLM waits on the notice; the ledger has no entry for the request
    # (never saw it, or removed it when the request finished).
    NO_ENTRY = "no_entry"
    # vLLM waits on the notice; the ledger saw no receive in flight.
    NO_RECV = "no_recv"
    # The ledger expects the notice; vLLM no longer waits on it.
    NOT_AWAITED = "not_awaited"


@dataclass
class DroppedNotices:
    duplicate: int = 0  # a second completion for a receive already completed
    late: int = 0  # a completion for a request the ledger no longer tracks
    unexpected: int = 0  # a completion for a request with no receive


class BlockLedger:
    """Per-request KV ownership and receive state, fed by connector hooks."""

    def __init__(self) -> None:
        # Added by on_arrival; removed by on_finished (or, for a request that
        # finished mid-receive, by the completion of that receive).
        self._entries: dict[ReqId, LedgerEntry] = {}
        # Requests whose entries were removed: completions for them are late.
        # Bounded: we keep the most recent ids only.
        self._gone: dict[ReqId, None] = {}
        # Entries the per-step update must look at: not yet executed, or with
        # a receive state. Every other entry is a request that runs (or ran)
        # with nothing to check, so a step that schedules only those costs
        # nothing here. Kept by _track after each transition.
        self._unsettled: set[ReqId] = set()
        self._arrivals = 0
        self.dropped = DroppedNotices()

    # ---- queries -------------------------------------------------------------
    def __contains__(self, req_id: object) -> bool:
        return req_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, req_id: ReqId) -> LedgerEntry | None:
        return self._entries.get(req_id)

    def entries(self) -> list[LedgerEntry]:
        return list(self._entries.values())

    def has_executed(self, req_id: ReqId) -> bool:
        entry = self._entries.get(req_id)
        return entry is not None and entry.executed

    def recv_state(self, req_id: ReqId) -> RecvState | None:
        entry = self._entries.get(req_id)
        return None if entry is None else entry.recv

    def in_flight(self) -> set[ReqId]:
        return {
            e.req_id for e in self._entries.values() if e.recv is RecvState.IN_FLIGHT
        }

    # ---- transitions -----------------------------------------------------------
    def on_arrival(self, req_id: ReqId) -> None:
        if req_id in self._entries:
            raise LedgerError(f"{req_id}: arrived twice (already tracked)")
        self._gone.pop(req_id, None)
        self._entries[req_id] = LedgerEntry(req_id, self._arrivals)
        self._unsettled.add(req_id)
        self._arrivals += 1

    def on_lookup(
        self,
        req_id: ReqId,
        owner: str | None,
        num_tokens: int,
        is_async: bool,
        num_computed_tokens: int = 0,
    ) -> None:
        entry = self._entries.get(req_id)
        if entry is None or entry.finished:  # per request: no _require frame
            entry = self._require(req_id, "lookup")  # raises
        if entry.recv is RecvState.IN_FLIGHT:
            raise LedgerError(
                f"{req_id}: looked up again while its receive is in flight"
            )
        entry.owner = owner if num_tokens > 0 else None
        entry.pending_async = bool(num_tokens > 0 and is_async)
        entry.load_start = num_computed_tokens

    def on_alloc(
        self, req_id: ReqId, num_blocks: int, num_external_tokens: int
    ) -> None:
        entry = self._entries.get(req_id)
        if entry is None or entry.finished:  # per request: no _require frame
            entry = self._require(req_id, "alloc")  # raises
        entry.num_blocks = num_blocks
        if num_external_tokens > 0 and entry.pending_async:
            if entry.recv is RecvState.IN_FLIGHT:
                raise LedgerError(
                    f"{req_id}: a second receive started before the first"
                )
            entry.recv = RecvState.IN_FLIGHT
        entry.pending_async = False
        if entry.executed and entry.recv is RecvState.NONE:  # _track, inlined:
            self._unsettled.discard(req_id)  # on every allocation
        else:
            self._unsettled.add(req_id)

    def on_scheduled(
        self, req_id: ReqId, computed_tokens: int, num_blocks: int
    ) -> None:
        entry = self._entries.get(req_id)
        if entry is None:
            return  # scheduled requests not routed through us (e.g. streaming)
        if entry.recv is RecvState.IN_FLIGHT:
            raise LedgerError(f"{req_id}: scheduled while its receive is in flight")
        entry.executed = True
        entry.computed_tokens = computed_tokens
        entry.num_blocks = num_blocks
        entry.recv = RecvState.NONE
        self._unsettled.discard(req_id)

    def on_scheduled_again(
        self,
        req_ids: Sequence[ReqId],
        computed_tokens: Sequence[int],
        new_block_ids: Sequence[tuple[list[int], ...] | None] | None,
        scheduled: KeysView[ReqId] | None = None,
    ) -> list[tuple[ReqId, int, int]]:
        """The requests scheduled in an earlier step too that need
        :meth:`on_scheduled`'s check, as ``(req_id, computed_tokens,
        num_blocks)``: those that never executed or have a receive state.

        The hot path (every running request, every step): a request that ran
        before with nothing to check costs nothing here; its progress and
        blocks are vLLM's to keep (the guard reads them from the scheduler
        when it needs them). ``new_block_ids`` as vLLM's cached-request data
        gives them (per request, per KV group, or None). ``scheduled``, the
        keys of every request scheduled this step (vLLM's
        ``num_scheduled_tokens``), makes the common answer -- none of them
        is unsettled -- cost a look-up per unsettled entry instead of one
        per running request.
        """
        unsettled = self._unsettled
        if not unsettled:
            return []
        if scheduled is not None:
            # A keys view tests the smaller side against the larger.
            if scheduled.isdisjoint(unsettled):
                return []
        elif unsettled.isdisjoint(req_ids):
            return []
        full_check = []
        for i, req_id in enumerate(req_ids):
            if req_id not in unsettled:
                continue
            ids = new_block_ids[i] if new_block_ids else None
            added = len(ids[0]) if ids else 0
            entry = self._entries[req_id]
            full_check.append((req_id, computed_tokens[i], entry.num_blocks + added))
        return full_check

    def accept_recv_complete(self, req_id: ReqId, failed: bool) -> bool:
        """Record a receive completion; False means drop the notice.

        Only a receive in flight can complete. A second notice (MultiConnector
        unions its children's, upstream #53049) is a duplicate; a notice for a
        request already gone is late -- passing either on trips vLLM's assert
        and can free blocks twice.
        """
        entry = self._entries.get(req_id)
        if entry is None:
            if req_id in self._gone:
                self.dropped.late += 1
            else:
                self.dropped.unexpected += 1
            return False
        if entry.recv is not RecvState.IN_FLIGHT:
            if entry.recv in (RecvState.DONE, RecvState.FAILED):
                self.dropped.duplicate += 1
            else:
                self.dropped.unexpected += 1
            return False
        entry.recv = RecvState.FAILED if failed else RecvState.DONE
        self._track(entry)
        if entry.finished:
            self._remove(req_id)  # its blocks are freed by vLLM now
        return True

    def expects_recv(self, req_id: ReqId) -> bool:
        """Whether a receive notice for ``req_id`` would be accepted."""
        entry = self._entries.get(req_id)
        return entry is not None and entry.recv is RecvState.IN_FLIGHT

    def overrule_recv_complete(self, req_id: ReqId, failed: bool) -> Disagreement:
        """vLLM waits on this notice though the ledger would drop it.

        vLLM's state wins: the notice is passed on (vLLM promotes the request,
        or frees the blocks of one that finished), and the entry, if any,
        takes the completion so its candidate rule matches vLLM again.
        """
        entry = self._entries.get(req_id)
        if entry is None:
            return Disagreement.NO_ENTRY
        entry.recv = RecvState.FAILED if failed else RecvState.DONE
        self._track(entry)
        return Disagreement.NO_RECV

    # ---- the load-retry budget --------------------------------------------------
    def on_load_failed(self, req_id: ReqId) -> tuple[str, int] | None:
        """A load of ``req_id`` failed: (owning child, its failures so far).

        None for a request with no entry or no owner (nothing to budget).
        """
        entry = self._entries.get(req_id)
        if entry is None or entry.owner is None:
            return None
        if entry.failed_loads is None:
            entry.failed_loads = {}
        n = entry.failed_loads.get(entry.owner, 0) + 1
        entry.failed_loads[entry.owner] = n
        return entry.owner, n

    def failed_loads(self, req_id: ReqId, owner: str) -> int:
        entry = self._entries.get(req_id)
        if entry is None or entry.failed_loads is None:
            return 0
        return entry.failed_loads.get(owner, 0)

    def cut_off(self, req_id: ReqId, owner: str) -> bool:
        """Stop taking ``owner``'s hits for ``req_id``; True the first time."""
        entry = self._entries.get(req_id)
        if entry is None or (entry.cut_off is not None and owner in entry.cut_off):
            return False
        if entry.cut_off is None:
            entry.cut_off = set()
        entry.cut_off.add(owner)
        return True

    def on_preempted(self, req_id: ReqId) -> None:
        """vLLM preempted a running request: its blocks are gone."""
        entry = self._entries.get(req_id)
        if entry is not None and entry.recv is not RecvState.IN_FLIGHT:
            entry.num_blocks = 0
            entry.computed_tokens = 0

    def on_lateral_preempt(self, req_id: ReqId) -> None:
        entry = self._require(req_id, "lateral preemption")
        if entry.recv is RecvState.IN_FLIGHT:
            raise LedgerError(
                f"{req_id}: lateral preemption while a receive is in flight"
            )
        entry.recv = RecvState.NONE
        entry.num_blocks = 0
        entry.computed_tokens = 0
        self._track(entry)

    def on_finished(self, req_id: ReqId) -> None:
        entry = self._entries.get(req_id)
        if entry is None:
            return
        if entry.recv is RecvState.IN_FLIGHT:
            entry.finished = True  # drains when the receive lands
        else:
            self._remove(req_id)

    # ---- the candidate rule ---------------------------------------------------
    def candidate_reason(self, view: HolderView, target: ReqId) -> VictimReason | None:
        """Why ``view`` may be preempted laterally to admit ``target``, or None."""
        entry = self._entries.get(view.req_id)
        if view.req_id == target or entry is None or view.num_blocks <= 0:
            return None
        if entry.recv is RecvState.IN_FLIGHT:
            return None  # a transfer may still be writing into those blocks
        if view.status is WaitStatus.WAITING_FOR_REMOTE_KVS:
            if view.recv_finished and entry.recv in (RecvState.DONE, RecvState.FAILED):
                return VictimReason.RECV_DONE
            return None
        if view.status in (WaitStatus.WAITING, WaitStatus.PREEMPTED):
            return VictimReason.PROMOTED_IDLE
        return None  # RUNNING, grammar waits, anything else

    def pick_victim(self, views: Iterable[HolderView], target: ReqId) -> Victim | None:
        """Least progressed candidate; ties go to the latest arrival."""
        best: tuple[tuple[int, int], Victim] | None = None
        for view in views:
            reason = self.candidate_reason(view, target)
            if reason is None:
                continue
            entry = self._entries[view.req_id]
            key = (view.num_computed_tokens, -entry.arrival)
            if best is None or key < best[0]:
                victim = Victim(
                    view.req_id,
                    reason,
                    entry.owner,
                    view.num_blocks,
                    view.num_computed_tokens,
                )
                best = (key, victim)
        return None if best is None else best[1]

    def snapshot(self, views: Iterable[HolderView]) -> str:
        """One line per waiting holder, for the wedge log line."""
        parts = []
        for view in views:
            entry = self._entries.get(view.req_id)
            recv = entry.recv.value if entry else "untracked"
            owner = entry.owner if entry else None
            parts.append(
                f"{view.req_id}[{view.status.value} recv={recv} owner={owner} "
                f"blocks={view.num_blocks} computed={view.num_computed_tokens}]"
            )
        return " ".join(parts) or "(no waiting holders)"

    # ---- internals ------------------------------------------------------------
    def _require(self, req_id: ReqId, what: str) -> LedgerEntry:
        entry = self._entries.get(req_id)
        if entry is None:
            raise LedgerError(
                f"{req_id}: {what} for a request the ledger never saw arrive"
            )
        if entry.finished:
            raise LedgerError(f"{req_id}: {what} after the request finished")
        return entry

    def _track(self, entry: LedgerEntry) -> None:
        """Keep ``entry`` in the per-step update's set while it needs checks."""
        if entry.executed and entry.recv is RecvState.NONE:
            self._unsettled.discard(entry.req_id)
        else:
            self._unsettled.add(entry.req_id)

    def _remove(self, req_id: ReqId) -> None:
        del self._entries[req_id]
        self._unsettled.discard(req_id)
        self._gone[req_id] = None
        if len(self._gone) > 65536:
            self._gone.pop(next(iter(self._gone)))


__all__ = [
    "BlockLedger",
    "Disagreement",
    "DroppedNotices",
    "HolderView",
    "LedgerEntry",
    "LedgerError",
    "RecvState",
    "ReqId",
    "Victim",
    "VictimReason",
    "WaitStatus",
]
