"""Where a vLLM release keeps its waiting requests, and the guard's access to them.

vLLM rewrites its admission loop every few releases. The guard needs four
things from it, which differ by release; each is answered here, by an
explicit layout per supported series (``versions.SUPPORTED_VLLM``):

- queues to search: 0.31+ (``HOLDING``) ``kv_holding_waiting`` then
  ``waiting``; 0.19-0.30 (``SKIPPED``) ``skipped_waiting`` then ``waiting``;
- the "holds blocks" predicate: ``Scheduler._holds_kv_blocks`` (0.31+), or
  computed tokens / WAITING_FOR_REMOTE_KVS (0.30);
- reservation extras: ``_spec_decode_step_blocks`` (an attribute in 0.32, a
  method in 0.31), none (0.30);
- per-request waiting state to clear: the KV-fetch stage gauge (0.32) and
  the deferred set (0.31+), none (0.30).
"""

from __future__ import annotations

import enum
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

    NONE = "none"  # 0.30: no such term
    METHOD = "method"  # 0.31: self._spec_decode_step_blocks()
    ATTRIBUTE = "attribute"  # 0.32: self._spec_decode_step_blocks, set once


@dataclass(frozen=True)
class ReleaseLayout:
    """Everything the guard reads or writes that differs by release series."""

    queues: QueueLayout
    spec_decode_blocks: SpecDecodeBlocks
    kv_fetch_stage: bool  # Scheduler._set_kv_fetch_stage exists (0.32)


LAYOUT_BY_SERIES = {
    "0.30": ReleaseLayout(QueueLayout.SKIPPED, SpecDecodeBlocks.NONE, False),
    "0.31": ReleaseLayout(QueueLayout.HOLDING, SpecDecodeBlocks.METHOD, False),
    "0.32": ReleaseLayout(QueueLayout.HOLDING, SpecDecodeBlocks.ATTRIBUTE, True),
}


def installed_layout() -> ReleaseLayout:
    return LAYOUT_BY_SERIES[check_vllm_version()]


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

    def remove_waiting(self, request: Request) -> None:
        """Take ``request`` out of whichever waiting queue holds it."""
        holder_queue, waiting = self.holder_queues()
        if request in holder_queue:
            holder_queue.remove_request(request)
        else:
            waiting.remove_request(request)
        if self.release.kv_fetch_stage:
            self._s._set_kv_fetch_stage(request, None)
        if self.layout is QueueLayout.HOLDING:
            self._s.deferred_waiting.discard(request)
