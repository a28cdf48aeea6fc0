"""Receive notices: a worker output's load reports, filtered once, before vLLM.

A room of the guard's scheduler side (``docs/architecture.md``). A worker's
``KVConnectorOutput`` names receives that finished (``finished_recving``),
that failed (``failed_recving``, 0.30+) and blocks a load did not fill
(``invalid_block_ids``). vLLM reads ``failed_recving`` at the top of
``Scheduler.update_from_output``, before it calls the connector's
``update_connector_output``, so the one caller is the guarded scheduler's
``update_from_output``, and :meth:`ReceiveNotices.filter` runs once per
output that reports a load (or when a load never started):

0. the worker's own receive notices end their receives in the receive
   watch (``receive_watch.py``) and their writers' quarantines
   (``quarantine.py``); a receive the guard is failing that the worker
   reports in the same output keeps the worker's outcome;
1. loads a raising child never started (``containment.py``, handed over by
   :meth:`ReceiveNotices.load_not_started` at allocation) and receives the
   guard failed (:meth:`ReceiveNotices.fail_receive`: past the deadline, or
   the sender dead) are added: an async one as a failed receive (before
   0.30: a finished receive with its blocks invalid), a sync one as invalid
   blocks;
2. each finished receive goes past the ledger: a duplicate (two children
   reporting one request, upstream #53049) or a late notice (the request is
   gone) is dropped -- passed on, it would trip vLLM's assert or free
   blocks twice. vLLM's state wins over the ledger's: a notice vLLM still
   waits on (``awaited``) is passed on whatever the ledger says, and one the
   ledger expects but vLLM no longer waits on is dropped; each such
   disagreement is counted and logged once per request;
3. ``failed_recving`` is cut to the accepted receives (a duplicate failure
   notice would fail a request whose KV arrived); before 0.30, the blocks
   of a dropped notice leave ``invalid_block_ids`` instead, since that is
   where the failure it carried is.

The guarded scheduler then counts the failed loads against the retry
budget (``ownership.py``). Nothing here imports vLLM's scheduler: outputs,
requests and blocks are read by attribute.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import fields
from typing import TYPE_CHECKING

from vllm_mooncake import logger_for
from vllm_mooncake.compat.releases import kv_output_has_failed_recving
from vllm_mooncake.guard.ledger import (
    BlockLedger,
    Disagreement,
    DroppedNotices,
    RecvState,
)
from vllm_mooncake.guard.quarantine import Quarantine
from vllm_mooncake.guard.receive_watch import ReceiveWatch
from vllm_mooncake.guard.stats import GuardStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logger_for(__name__)

Awaited = Callable[[str], bool]
"""Whether vLLM's scheduler still waits on a receive notice for a request."""

BlockIdsOf = Callable[[str], Sequence[int]]
"""A live request's block ids in vLLM's first KV cache group (empty if gone)."""

_LOGGED_ONCE_MAX = 65536
_NO_IDS: frozenset[str] = frozenset()
_DROPPED_KINDS = tuple(f.name for f in fields(DroppedNotices))
_dropped_counts = operator.attrgetter(*_DROPPED_KINDS)


class ReceiveNotices:
    """The one filter of a worker output's load reports (see the module docstring)."""

    def __init__(
        self,
        ledger: BlockLedger,
        stats: GuardStats,
        block_size: int,
        receives: ReceiveWatch,
        quarantine: Quarantine,
    ) -> None:
        self._ledger = ledger
        self._stats = stats
        self._block_size = block_size
        self._receives = receives
        self._quarantine = quarantine
        # Receives the guard is failing, not yet reported to vLLM -> the block
        # ids reported invalid with them (before 0.30), and what to call once
        # the failure is reported (it counts and logs it).
        self._failing: dict[str, tuple[tuple[int, ...], Callable[[], None]]] = {}
        # 0.30+: a failed receive is named in failed_recving; before, it is a
        # finished receive whose blocks are in invalid_block_ids.
        self._failed_recving = kv_output_has_failed_recving()
        # Loads whose owner raised before starting them (load_not_started):
        # reported by the next filter() -- async ones as failed receives,
        # sync ones (and async ones before 0.30) as invalid blocks.
        self._unstarted_recvs: set[str] = set()
        self._unstarted_blocks: set[int] = set()
        # Requests whose ledger disagreement was logged (once per request).
        self._disagreement_logged: dict[str, None] = {}

    @property
    def pending(self) -> bool:
        """Whether a load that never started waits to be reported."""
        return bool(self._unstarted_recvs or self._unstarted_blocks)

    def load_not_started(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        start: int,
        num_external_tokens: int,
    ) -> None:
        """The owner raised before starting ``request``'s load: fail the load.

        vLLM already counts the external tokens (from token ``start``) as
        (to be) computed. An async load is reported as a failed receive by
        the next :meth:`filter` (the request waits in WAITING_FOR_REMOTE_KVS
        for exactly that); a sync load's blocks are reported invalid, as a
        worker reports a sync load that failed. Either way
        ``kv_load_failure_policy`` decides: ``recompute`` prefills it
        locally, ``fail`` ends it with an error.
        """
        req_id = request.request_id
        if self._ledger.recv_state(req_id) is RecvState.IN_FLIGHT:
            self._unstarted_recvs.add(req_id)
            if self._failed_recving:
                return
            # Before 0.30 a failed receive is reported as finished with its
            # blocks invalid: fall through to name the blocks.
        end = start + num_external_tokens
        block_ids = blocks.get_block_ids()[0] if blocks.blocks else []
        first, last = start // self._block_size, -(-end // self._block_size)
        self._unstarted_blocks.update(block_ids[first:last])

    def fail_receive(
        self, req_id: str, block_ids: Sequence[int], reported: Callable[[], None]
    ) -> None:
        """Report ``req_id``'s receive as failed in the next :meth:`filter`,
        then call ``reported`` -- unless the worker reports that receive in
        the same output: its outcome stands.

        Its sender is dead or silent past the deadline (``stranded.py``,
        which quarantined its blocks first). vLLM's
        ``kv_load_failure_policy`` then ends the request with an error or
        recomputes it from token 0. Before 0.30 the failure is the request's
        ``block_ids`` reported invalid -- all of them, so that recomputing
        starts from token 0 in new blocks, never in the quarantined ones.
        """
        self._unstarted_recvs.add(req_id)
        if self._failed_recving:
            self._failing[req_id] = ((), reported)
        else:
            self._failing[req_id] = (tuple(block_ids), reported)
            self._unstarted_blocks.update(block_ids)

    def filter(
        self,
        kv_output: KVConnectorOutput,
        awaited: Awaited,
        block_ids_of: BlockIdsOf,
    ) -> None:
        """Steps 0-3 of the module docstring on ``kv_output``, in place.

        ``awaited`` and ``block_ids_of`` read vLLM's scheduler (the guarded
        scheduler passes its own); the ledger's view never overrules them.
        """
        if len(self._receives) or len(self._quarantine) or self._failing:
            self._writers_reported(kv_output)
        # Before 0.30 a dropped notice's failure is in invalid_block_ids.
        received = (
            None if self._failed_recving else set(kv_output.finished_recving or ())
        )
        if self._unstarted_recvs or self._unstarted_blocks:
            self._report_unstarted_loads(kv_output)
        failed: AbstractSet[str] = getattr(kv_output, "failed_recving", None) or _NO_IDS
        kept: set[str] = set()
        if kv_output.finished_recving:
            kept = self._accepted_recvs(kv_output.finished_recving, failed, awaited)
            kv_output.finished_recving = kept or None
        if failed:
            kv_output.failed_recving = {r for r in failed if r in kept}
        if received is not None:
            self._drop_invalid_blocks_of_dropped_notices(
                kv_output, received, block_ids_of
            )

    # ---- step 0: what the worker reported of its transfers ------------------------
    def _writers_reported(self, kv_output: KVConnectorOutput) -> None:
        told = set(kv_output.finished_recving or ())
        told.update(getattr(kv_output, "failed_recving", None) or ())
        for req_id in told:
            self._receives.ended(req_id)
            if req_id in self._failing:  # the worker's outcome, not ours
                self._unstarted_recvs.discard(req_id)
                block_ids, _ = self._failing.pop(req_id)
                self._unstarted_blocks.difference_update(block_ids)
            self._quarantine.writer_done(req_id)

    # ---- step 1: loads that never started ------------------------------------------
    def _report_unstarted_loads(self, kv_output: KVConnectorOutput) -> None:
        if self._failing:
            for _, reported in self._failing.values():
                reported()
            self._failing.clear()
        if self._unstarted_recvs:
            live = {r for r in self._unstarted_recvs if self._ledger.get(r)}
            self._unstarted_recvs.clear()
            if live:
                finished = set(kv_output.finished_recving or ())
                kv_output.finished_recving = finished | live
                if self._failed_recving:
                    failed = set(kv_output.failed_recving or ())
                    kv_output.failed_recving = failed | live
                # else (before 0.30) their blocks are in _unstarted_blocks.
        if self._unstarted_blocks:
            invalid = set(kv_output.invalid_block_ids or ())
            kv_output.invalid_block_ids = invalid | self._unstarted_blocks
            self._unstarted_blocks.clear()

    # ---- step 2: duplicate and late notices; vLLM's state wins -----------------------
    def _accepted_recvs(
        self,
        finished: Iterable[str],
        failed: AbstractSet[str],
        awaited: Awaited,
    ) -> set[str]:
        kept = set()
        ledger = self._ledger
        before = _dropped_counts(ledger.dropped)
        for req_id in finished:
            vllm_waits = awaited(req_id)
            if vllm_waits == ledger.expects_recv(req_id):
                if ledger.accept_recv_complete(req_id, req_id in failed):
                    kept.add(req_id)
            elif vllm_waits:
                overruled = ledger.overrule_recv_complete(req_id, req_id in failed)
                self._note_disagreement(req_id, overruled)
                kept.add(req_id)
            else:
                ledger.accept_recv_complete(req_id, req_id in failed)
                self._note_disagreement(req_id, Disagreement.NOT_AWAITED)
        if before != _dropped_counts(ledger.dropped):
            self._count_dropped(dict(zip(_DROPPED_KINDS, before, strict=True)))
        return kept

    def _count_dropped(self, before: dict[str, int]) -> None:
        """Count and log the notices the ledger dropped since ``before``."""
        for kind in _DROPPED_KINDS:
            n = getattr(self._ledger.dropped, kind)
            if n > before[kind]:
                self._stats.dropped_recv_notices[kind] += n - before[kind]
                logger.warning(
                    "wedge guard dropped %d %s receive notice(s)",
                    n - before[kind],
                    kind,
                )

    def _note_disagreement(self, req_id: str, kind: Disagreement) -> None:
        """Count a ledger/vLLM disagreement; log it once per request."""
        self._stats.ledger_disagreements[kind.value] += 1
        if req_id in self._disagreement_logged:
            return
        self._disagreement_logged[req_id] = None
        if len(self._disagreement_logged) > _LOGGED_ONCE_MAX:
            self._disagreement_logged.pop(next(iter(self._disagreement_logged)))
        passed = "dropped" if kind is Disagreement.NOT_AWAITED else "passed on"
        logger.warning(
            "wedge guard ledger disagrees with the scheduler on request %s's "
            "receive notice (%s); the scheduler's state wins: notice %s",
            req_id,
            kind.value,
            passed,
        )

    # ---- step 3, before 0.30: a dropped notice takes its failure with it ------------
    @staticmethod
    def _drop_invalid_blocks_of_dropped_notices(
        kv_output: KVConnectorOutput, received: set[str], block_ids_of: BlockIdsOf
    ) -> None:
        """Before 0.30 a failed receive is a finished one plus its blocks in
        ``invalid_block_ids``. When a receive notice is dropped (duplicate or
        late), the failure it carried goes too: the blocks of that request
        leave the invalid set, as 0.30+'s ``failed_recving`` is cut to the
        accepted receives -- else a loaded, even running, request would be
        failed by another's duplicate report."""
        invalid = kv_output.invalid_block_ids
        if not invalid:
            return
        for req_id in received - set(kv_output.finished_recving or ()):
            invalid.difference_update(block_ids_of(req_id))


__all__ = ["Awaited", "BlockIdsOf", "ReceiveNotices"]
