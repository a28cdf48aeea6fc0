"""The waiting requests that hold KV blocks, read from vLLM's scheduler.

What the guarded scheduler's parts read of vLLM's waiting state, in one
place (the queues and the "holds blocks" predicate differ by release:
``compat/releases.py``'s ``SchedulerAccess``):

- :meth:`WaitingHolders.views` -- one :class:`~vllm_mooncake.guard.ledger.HolderView`
  per holder, for the valve's victim choice, the log lines and the
  observers;
- :meth:`WaitingHolders.census` -- the same holders counted, for the gauges
  and the stall watch (``stall_watch.py``), without an object per holder;
- :meth:`WaitingHolders.failed_loads` -- which requests a worker output
  fails, as vLLM will see it (for the load-retry budget).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from vllm_mooncake.compat.releases import SchedulerAccess
from vllm_mooncake.guard.ledger import HolderView, WaitStatus
from vllm_mooncake.guard.stall_watch import Lateral, StepObservation

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput

_STATUS = {
    RequestStatus.WAITING_FOR_REMOTE_KVS: WaitStatus.WAITING_FOR_REMOTE_KVS,
    RequestStatus.WAITING: WaitStatus.WAITING,
    RequestStatus.PREEMPTED: WaitStatus.PREEMPTED,
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: WaitStatus.WAITING_FOR_GRAMMAR,
    RequestStatus.RUNNING: WaitStatus.RUNNING,
}


class WaitingHolders:
    """One scheduler's waiting block holders (see the module docstring)."""

    def __init__(self, scheduler: Any, access: SchedulerAccess) -> None:
        self._s = scheduler
        self._access = access

    def may_wait(self) -> bool:
        """Whether any waiting queue has a request (a holder may wait)."""
        return any(self._access.holder_queues())

    def views(self) -> list[HolderView]:
        """Every waiting request that holds KV blocks, as the guard sees it."""
        scheduler = self._s
        views = []
        get_blocks = scheduler.kv_cache_manager.get_blocks
        recv_done = scheduler.finished_recving_kv_req_ids
        for queue in self._access.holder_queues():
            for request in queue:
                if not self._access.holds_blocks(request):
                    continue
                req_id = request.request_id
                blocks = get_blocks(req_id).blocks  # counted, no id lists built
                views.append(
                    HolderView(
                        req_id=req_id,
                        status=_STATUS.get(request.status, WaitStatus.OTHER),
                        num_computed_tokens=request.num_computed_tokens,
                        num_blocks=len(blocks[0]) if blocks else 0,
                        recv_finished=req_id in recv_done,
                    )
                )
        return views

    def census(
        self, scheduled_tokens: int, num_running: int, lateral: Lateral
    ) -> StepObservation:
        """The waiting holders counted for the gauges and the stall watch.

        Counted, not viewed: no object per holder (the views are built only
        for a log line), and vLLM's own predicate called directly.
        """
        scheduler = self._s
        num_holders = recv_done = in_flight = blocks_held = 0
        get_blocks = scheduler.kv_cache_manager.get_blocks
        holds_blocks = self._access.holds_blocks_test()
        recv_done_ids = scheduler.finished_recving_kv_req_ids
        waiting_for_kvs = RequestStatus.WAITING_FOR_REMOTE_KVS
        for queue in self._access.holder_queues():
            for request in queue:
                if not holds_blocks(request):
                    continue
                num_holders += 1
                blocks = get_blocks(request.request_id).blocks
                blocks_held += len(blocks[0]) if blocks else 0
                if request.status == waiting_for_kvs:
                    if request.request_id in recv_done_ids:
                        recv_done += 1
                    else:
                        in_flight += 1
        return StepObservation(
            scheduled_tokens,
            num_running,
            lateral,
            num_holders,
            recv_done,
            blocks_held,
            in_flight,
        )

    def failed_loads(self, kv_output: KVConnectorOutput) -> set[str]:
        """Requests whose load failed in this output, as vLLM will see it.

        ``failed_recving`` (filtered) names async loads that failed; vLLM
        acts on those still in WAITING_FOR_REMOTE_KVS. ``invalid_block_ids``
        names blocks a load did not fill: vLLM maps them to waiting async
        loads and to running (sync-loaded) requests holding them.
        """
        scheduler = self._s
        waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
        # Before 0.30 there is no failed_recving: a failed async load is a
        # finished receive whose blocks are invalid (handled below).
        failed = {
            req_id
            for req_id in getattr(kv_output, "failed_recving", None) or ()
            if (request := scheduler.requests.get(req_id)) is not None
            and request.status == waiting
        }
        invalid = kv_output.invalid_block_ids
        if invalid:
            holders = [r for q in self._access.holder_queues() for r in q]
            for request in [*holders, *scheduler.running]:
                if request.status not in (waiting, RequestStatus.RUNNING):
                    continue
                block_ids = scheduler.kv_cache_manager.get_block_ids(request.request_id)
                if block_ids and not invalid.isdisjoint(block_ids[0]):
                    failed.add(request.request_id)
        return failed


__all__ = ["WaitingHolders"]
