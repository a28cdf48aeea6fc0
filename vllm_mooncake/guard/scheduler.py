"""The guarded schedulers: lateral preemption when admission fails.

Life cycle of a wedge and its resolution (vLLM 0.32):

1. Requests A and B hold KV blocks without having run: B's receive finished,
   A was promoted after its own load. Both wait in ``kv_holding_waiting``
   (``skipped_waiting`` before 0.31; see ``compat/releases.py``).
2. ``schedule()`` peeks A and asks ``KVCacheManager.allocate_slots`` for A's
   next chunk; there are not enough free blocks, it returns ``None`` and the
   admission loop ``break``s. Nothing runs, so vLLM's running-side
   preemption has no victim; every later step repeats 2. -- a wedge.
3. The guard wraps ``allocate_slots`` on this scheduler's instance (the one
   place both loops allocate). On a ``None`` for a request being *admitted*
   (not RUNNING), when nothing is running (``only_when_idle``), it asks the
   guard connector's ledger for a lateral victim (recv-done or
   promoted-but-idle holder; never in flight, never RUNNING, never A), undoes
   the victim's admission, and retries -- at most ``max_attempts`` times per
   ``schedule()`` call.
4. Undoing an admission leaves vLLM's state as if the victim had never been
   admitted, less what it cached: out of the holder queue, loaded blocks
   cached, out of the receive sets, blocks freed, out of the reservation set
   (and, on 0.34, its parked reservation and load-cap slot given back),
   ``num_preemptions`` counted, and back at the front of ``waiting`` as
   WAITING (the worker never saw it: it must arrive as new) or PREEMPTED (it
   ran before: it resumes).

Nothing of ``Scheduler.schedule()`` is copied: the subclasses override
``schedule`` (to reset the per-call budget and watch for stalls),
``update_from_output`` (to drop duplicate and late receive notices before
vLLM reads them -- never one vLLM still waits on -- and to count failed
loads against the retry budget), ``finish_requests`` (to remember requests
aborted mid-receive), ``_inflight_prefill_reserved_blocks`` (policies without
reservation) and ``_handle_blocked_waiting_request`` (status fix for
never-executed victims), each calling ``super()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from copy import copy
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreEventType
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from vllm_mooncake import logger_for
from vllm_mooncake.compat.releases import SchedulerAccess, installed_layout
from vllm_mooncake.guard.config import GuardConfigError
from vllm_mooncake.guard.connector import WedgeGuardConnector
from vllm_mooncake.guard.ledger import HolderView, Victim, WaitStatus
from vllm_mooncake.guard.metrics import stats_carrier
from vllm_mooncake.guard.scheduler_side import GuardSchedulerSide, StepObservation

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput

logger = logger_for(__name__)

_STATUS = {
    RequestStatus.WAITING_FOR_REMOTE_KVS: WaitStatus.WAITING_FOR_REMOTE_KVS,
    RequestStatus.WAITING: WaitStatus.WAITING,
    RequestStatus.PREEMPTED: WaitStatus.PREEMPTED,
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: WaitStatus.WAITING_FOR_GRAMMAR,
    RequestStatus.RUNNING: WaitStatus.RUNNING,
}


def _instance_attribute(obj: object, name: str) -> Any:
    """``obj.__dict__.get(name)``, without reading ``obj.__dict__``.

    CPython 3.11 keeps an object's attributes in an inline array until
    something reads its ``__dict__``; from then on every attribute read on
    that object goes through a dict and costs about twice as much. vLLM reads
    the KVCacheManager's attributes hundreds of times per step, so the valve
    finds its own shadow by comparing what the instance answers with what
    its class would bind instead.
    """
    found = getattr(obj, name)
    on_class = getattr(type(obj), name)
    bind = getattr(type(on_class), "__get__", None)
    unshadowed = on_class if bind is None else bind(on_class, obj, type(obj))
    return None if found == unshadowed else found


def _reports_loads(kv_output: KVConnectorOutput) -> bool:
    """Whether a worker output says anything of loads: a receive that
    finished or failed, or blocks a load did not fill. Most steps' outputs
    say nothing, and the guard then has nothing to filter or count."""
    return bool(
        kv_output.finished_recving
        or getattr(kv_output, "failed_recving", None)
        or kv_output.invalid_block_ids
    )


def _require_supported_vllm() -> None:
    """Fail at start-up, by name, if this vLLM moved what the guard touches."""
    from vllm_mooncake.compat.internals import missing_internals
    from vllm_mooncake.compat.versions import (
        UnsupportedVllmVersion,
        check_vllm_version,
    )

    check_vllm_version()
    problems = missing_internals()
    if problems:
        raise UnsupportedVllmVersion(
            "the wedge guard cannot run on this vLLM: " + "; ".join(problems)
        )


class WedgeGuardMixin(Scheduler):  # type: ignore[misc]
    """Adds the lateral-preemption valve to a vLLM ``Scheduler`` subclass.

    Compose it in front of any Scheduler class:
    ``class MyGuarded(WedgeGuardMixin, MyScheduler): pass`` -- the MRO puts
    the guard's overrides first, then MyScheduler's, then Scheduler's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _require_supported_vllm()
        super().__init__(*args, **kwargs)
        connector = self.connector
        if not isinstance(connector, WedgeGuardConnector):
            got = type(connector).__name__ if connector else None
            raise GuardConfigError(
                f"{type(self).__name__} needs kv_transfer_config.kv_connector="
                f"'WedgeGuardConnector', got {got}; configure the guard "
                "connector or use vLLM's own scheduler class"
            )
        # The guard's state and its narrow API (guard/scheduler_side.py).
        self.wedge_guard: GuardSchedulerSide = connector.scheduler_side
        self._access = SchedulerAccess(self, installed_layout())
        self._lateral_budget = 0
        self._lateral_this_call: list[tuple[Victim, str]] = []
        # Requests finished (aborted) while their receive was in flight:
        # vLLM keeps them, blocks and all, until the receive notice lands.
        self._finished_mid_recv: set[str] = set()
        self._install_admission_valve()
        if self._access.release.full_sequence_gate:
            self._install_full_sequence_valve()
        self._log_start()

    def _log_start(self) -> None:
        """One INFO line per engine: the guard is on, and how."""
        config = self.wedge_guard.config
        logger.info(
            "wedge guard active: %s over [%s]; policy=%s max_attempts=%d "
            "only_when_idle=%s max_failed_loads=%d",
            type(self).__name__,
            ", ".join(self.wedge_guard.child_names),
            config.policy.value,
            config.max_attempts,
            config.only_when_idle,
            config.max_failed_loads,
        )

    # ---- the valve -------------------------------------------------------------
    def _install_admission_valve(self) -> None:
        """Wrap ``allocate_slots`` on this scheduler's KVCacheManager instance.

        Why: the admission loop's allocation failure is not a hook; it
        ``break``s inside ``schedule()``, which must not be copied.
        How: an instance attribute shadows the bound method; only this
        scheduler's manager is affected, and the wrapper calls the original.
        Upstream: vLLM closed the lateral-preemption PR (#40968) and merged
        an admission-time reservation (#44560) instead.
        Removal: when vLLM offers an admission-failure hook or resolves
        W1/W2 itself.

        The wrapper is armed per ``schedule()`` call, only when it can act
        (:meth:`_arm_valve`): the running loop's hundreds of allocations per
        step then call vLLM's method directly, at no cost.
        """
        manager = self.kv_cache_manager
        stock_allocate = manager.allocate_slots
        # What shadowed the method before us, if anything (put back when the
        # valve is off for a call).
        self._valve_base = _instance_attribute(manager, "allocate_slots")
        self._valve: Callable[..., KVCacheBlocks | None]
        self._valve_on = False  # whether _arm_valve last put the valve on

        def allocate_slots(
            request: Request, *args: Any, **kwargs: Any
        ) -> KVCacheBlocks | None:
            blocks = stock_allocate(request, *args, **kwargs)
            while blocks is None and self._may_preempt_for(request):
                victim = self._choose_victim(request)
                if victim is not None:
                    self._preempt_laterally(victim, request)
                elif not self._drop_stale_self_reservation(request):
                    break
                if kwargs.get("reserved_blocks"):
                    kwargs["reserved_blocks"] = (
                        self._inflight_prefill_reserved_blocks()
                        + self._access.reservation_extras()
                    )
                blocks = stock_allocate(request, *args, **kwargs)
            return blocks

        self._valve = allocate_slots

    def _arm_valve(self) -> None:
        """Shadow ``allocate_slots`` for this call only if a lateral
        preemption may happen in it.

        Under ``only_when_idle`` a call that starts with requests running
        admits nothing laterally: vLLM's admission loop runs only when no
        running request was preempted in the same call, so ``running`` is
        still non-empty when it runs. That is the common call, and it costs
        two reads here: the valve is already off.
        """
        config = self.wedge_guard.config
        armed = config.valve and not (config.only_when_idle and self.running)
        if not armed and not self._valve_on:
            return
        manager = self.kv_cache_manager
        shadow = _instance_attribute(manager, "allocate_slots")
        if shadow is not self._valve and shadow is not self._valve_base:
            return  # replaced by someone else after us (a test's mock): theirs
        if armed:
            manager.allocate_slots = self._valve
        elif self._valve_base is not None:
            manager.allocate_slots = self._valve_base
        elif shadow is not None:
            del manager.allocate_slots  # vLLM's own method again
        self._valve_on = bool(armed)

    def _install_full_sequence_valve(self) -> None:
        """0.19-0.20: the admission loop asks ``can_fit_full_sequence``
        before ``allocate_slots`` and ``break``s on False (from 0.21 the
        check is inside ``allocate_slots``). The same valve wraps it on this
        scheduler's KVCacheManager instance: with nothing running, undo a
        lateral victim's admission and ask again. (No async-load reservation
        exists on these releases, so there is no stale one to drop.)
        """
        manager = self.kv_cache_manager
        stock_fits = manager.can_fit_full_sequence

        def can_fit_full_sequence(request: Request, *args: Any, **kwargs: Any) -> bool:
            fits = bool(stock_fits(request, *args, **kwargs))
            while not fits and self._may_preempt_for(request):
                victim = self._choose_victim(request)
                if victim is None:
                    break
                self._preempt_laterally(victim, request)
                fits = bool(stock_fits(request, *args, **kwargs))
            return fits

        manager.can_fit_full_sequence = can_fit_full_sequence

    def _may_preempt_for(self, request: Request) -> bool:
        config = self.wedge_guard.config
        if not config.valve:
            return False
        if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return False  # RUNNING: the running loop's own preemption applies
        if config.only_when_idle and self.running:
            return False  # running requests will free blocks: not a wedge
        if self._lateral_budget <= 0:
            self.wedge_guard.note_attempts_exhausted()
            return False
        return True

    def _drop_stale_self_reservation(self, request: Request) -> bool:
        """Stop ``request`` reserving blocks against its own admission (W2).

        After a load fails entirely under ``kv_load_failure_policy=recompute``
        vLLM frees the request's blocks but leaves it in ``_inflight_prefills``;
        re-admitted through another async load, it reserves its own remaining
        blocks against itself and never fits when the pool is smaller than
        twice its need -- with no other holder, there is no victim either (found
        by the property tests). A request being admitted holds no blocks and
        has no transfer in flight, so it is no in-flight prefill; vLLM adds it
        back if this admission starts a load. True if there was one to drop.
        """
        if self._access.release.parked and request in self._parked_reservations:
            # 0.34 caches the same self-reservation as a parked one (set at
            # its promotion after the failed load): give it back. vLLM parks
            # it again if this admission starts a load, and drops it anyway
            # when the request is admitted.
            self._access.release_parked(request)
            logger.info(
                "wedge guard: %s's parked reservation counted against its own "
                "admission; given back",
                request.request_id,
            )
            return request not in self._parked_reservations
        if not self._access.in_reservation(request) or self._access.holds_blocks(
            request
        ):
            return False
        self._inflight_prefills.discard(request)
        logger.info(
            "wedge guard: %s reserved blocks against its own admission after a "
            "failed load; reservation dropped",
            request.request_id,
        )
        return True

    def _holder_views(self) -> list[HolderView]:
        """Every waiting request that holds KV blocks, as the guard sees it."""
        views = []
        get_blocks = self.kv_cache_manager.get_blocks
        recv_done = self.finished_recving_kv_req_ids
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

    def _choose_victim(self, target: Request) -> Victim | None:
        return self.wedge_guard.pick_victim(self._holder_views(), target.request_id)

    def _preempt_laterally(self, victim: Victim, target: Request) -> None:
        """Undo ``victim``'s admission (see the module docstring, step 4)."""
        request = self.requests[victim.req_id]
        req_id = request.request_id
        self._lateral_budget -= 1
        self._lateral_this_call.append((victim, target.request_id))
        self._access.remove_waiting(request)
        if (
            request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and req_id in self.finished_recving_kv_req_ids
        ):
            # Cache what the receive loaded so re-admission hits the prefix
            # cache (frees the blocks itself after a failed load).
            self._update_waiting_for_remote_kv(request)
        self.finished_recving_kv_req_ids.discard(req_id)
        self.failed_recving_kv_req_ids.discard(req_id)
        self._access.free_blocks(request)
        self.encoder_cache_manager.free(request)
        # Out of the reservation set (0.23+), its parked reservation given
        # back (0.34), its deferred load dropped (0.33+).
        self._access.drop_reservation(request)
        request.num_computed_tokens = 0
        executed = self.wedge_guard.has_executed(req_id)
        request.status = RequestStatus.PREEMPTED if executed else RequestStatus.WAITING
        request.num_preemptions += 1
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED, time.monotonic())
        self.waiting.prepend_request(request)
        self._access.note_preempted(req_id)
        self.wedge_guard.on_lateral_preemption(victim)

    # ---- overrides (each calls super) -------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self._lateral_budget = self.wedge_guard.config.max_attempts
        if self._lateral_this_call:  # an empty one is reused
            self._lateral_this_call = []
        self._arm_valve()
        output = super().schedule(*args, **kwargs)
        self._after_schedule(output)
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: Any
    ) -> Any:
        """Filter receive notices before vLLM reads ``failed_recving``, and
        report loads a raising child never started (guard/containment.py)."""
        kv_output = getattr(model_runner_output, "kv_connector_output", None)
        unstarted = self.wedge_guard.has_unstarted_loads()
        carry_stats = self._needs_stats_carrier(kv_output)
        if kv_output is None and (unstarted or carry_stats):
            # A copy: the output may be vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT.
            kv_output = KVConnectorOutput()
            model_runner_output = copy(model_runner_output)
            model_runner_output.kv_connector_output = kv_output
        if carry_stats and kv_output is not None:
            kv_output.kv_connector_stats = stats_carrier()
        if kv_output is not None and (unstarted or _reports_loads(kv_output)):
            self._filter_load_reports(kv_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._finished_mid_recv:
            self._finished_mid_recv &= self.requests.keys()
        return outputs

    def _needs_stats_carrier(self, kv_output: KVConnectorOutput | None) -> bool:
        """Before 0.24 vLLM asks the connector for stats only on steps where a
        worker reported stats: without one, the guard's counters and gauges
        would wait for an unrelated transfer (seconds on a real server)."""
        if self._access.release.stats_every_step:
            return False
        if kv_output is not None and kv_output.kv_connector_stats:
            return False
        return bool(self.connector.guard_stats_pending())

    def _filter_load_reports(self, kv_output: KVConnectorOutput) -> None:
        """Drop duplicate and late receive notices (never one vLLM awaits)
        and count the failed loads, before vLLM reads the output."""
        # Before 0.30 a dropped notice's failure is in invalid_block_ids.
        received = (
            None
            if self._access.release.failed_recving
            else set(kv_output.finished_recving or ())
        )
        self.wedge_guard.filter_recv_notices(kv_output, self._awaits_recv_notice)
        if received is not None:
            self._drop_invalid_blocks_of_dropped_notices(kv_output, received)
        failed = self._failed_loads(kv_output)
        if failed:
            self.wedge_guard.record_failed_loads(failed)

    def _drop_invalid_blocks_of_dropped_notices(
        self, kv_output: KVConnectorOutput, received: set[str]
    ) -> None:
        """Before 0.30 a failed receive is a finished one plus its blocks in
        ``invalid_block_ids``. When the guard drops a receive notice
        (duplicate or late), the failure it carried goes too: the blocks of
        that request leave the invalid set, as 0.30+'s ``failed_recving`` is
        cut to the accepted receives -- else a loaded, even running, request
        would be failed by another's duplicate report."""
        invalid = kv_output.invalid_block_ids
        if not invalid:
            return
        dropped = received - set(kv_output.finished_recving or ())
        for req_id in dropped:
            if req_id in self.requests:
                block_ids = self.kv_cache_manager.get_block_ids(req_id)
                invalid.difference_update(block_ids[0] if block_ids else ())

    def add_request(self, request: Request) -> None:
        """Before 0.22 vLLM does not tell the connector of a new request
        (``on_new_request``): the guard's ledger is told here instead."""
        if self._access.release.new_request_hook:
            super().add_request(request)
            return
        new = request.request_id not in self.requests
        super().add_request(request)
        if new:
            self.wedge_guard.on_arrival(request.request_id)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        """Remember which finished requests still wait on their receive.

        vLLM frees a request aborted in WAITING_FOR_REMOTE_KVS (its receive
        not yet reported) only when the receive notice lands: that notice
        must reach vLLM whatever the ledger says (:meth:`_awaits_recv_notice`).
        """
        if isinstance(request_ids, str):
            ids: list[str] | None = [request_ids]
        else:
            ids = None if request_ids is None else list(request_ids)
        mid_recv = {
            req_id
            for req_id in (self.requests if ids is None else ids)
            if (request := self.requests.get(req_id)) is not None
            and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and req_id not in self.finished_recving_kv_req_ids
        }
        finished = super().finish_requests(ids, finished_status)
        self._finished_mid_recv |= mid_recv & self.requests.keys()
        return finished

    def _awaits_recv_notice(self, req_id: str) -> bool:
        """Whether vLLM still needs ``req_id``'s receive notice.

        What vLLM 0.32's ``_update_from_kv_xfer_finished`` does with one: a
        WAITING_FOR_REMOTE_KVS request not yet in the finished-receive set is
        promoted by it; a finished request kept for its receive is freed by
        it. Anything else (gone, running, already reported) does not need it.
        """
        request = self.requests.get(req_id)
        if request is None:
            return False
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return req_id not in self.finished_recving_kv_req_ids
        return req_id in self._finished_mid_recv

    def _failed_loads(self, kv_output: KVConnectorOutput) -> set[str]:
        """Requests whose load failed in this output, as vLLM will see it.

        ``failed_recving`` (filtered) names async loads that failed; vLLM
        acts on those still in WAITING_FOR_REMOTE_KVS. ``invalid_block_ids``
        names blocks a load did not fill: vLLM maps them to waiting async
        loads and to running (sync-loaded) requests holding them.
        """
        waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
        # Before 0.30 there is no failed_recving: a failed async load is a
        # finished receive whose blocks are invalid (handled below).
        failed = {
            req_id
            for req_id in getattr(kv_output, "failed_recving", None) or ()
            if (request := self.requests.get(req_id)) is not None
            and request.status == waiting
        }
        invalid = kv_output.invalid_block_ids
        if invalid:
            holders = [r for q in self._access.holder_queues() for r in q]
            for request in [*holders, *self.running]:
                if request.status not in (waiting, RequestStatus.RUNNING):
                    continue
                block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
                if block_ids and not invalid.isdisjoint(block_ids[0]):
                    failed.add(request.request_id)
        return failed

    def _inflight_prefill_reserved_blocks(self) -> int:
        if not self.wedge_guard.config.reserves:
            return 0
        return int(super()._inflight_prefill_reserved_blocks())

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        """0.31+ promotion hook (see :meth:`_as_new_unless_executed`)."""
        ready = bool(super()._handle_blocked_waiting_request(request))
        if request.status == RequestStatus.PREEMPTED:  # else nothing to fix
            self._as_new_unless_executed(request)
        return ready

    def _try_promote_blocked_waiting_request(self, request: Request) -> bool:
        """0.19-0.30 promotion hook (see :meth:`_as_new_unless_executed`)."""
        ready = bool(super()._try_promote_blocked_waiting_request(request))
        if request.status == RequestStatus.PREEMPTED:  # else nothing to fix
            self._as_new_unless_executed(request)
        return ready

    def _as_new_unless_executed(self, request: Request) -> None:
        """vLLM promotes to PREEMPTED when num_preemptions > 0; a lateral
        victim that never ran must reach the worker as a new request."""
        if request.status == RequestStatus.PREEMPTED and not (
            self.wedge_guard.has_executed(request.request_id)
        ):
            request.status = RequestStatus.WAITING

    # ---- observation: gauges, the WARNING line, the wedge alarm -----------------
    def _after_schedule(self, output: SchedulerOutput) -> None:
        """Gauges and the stall watch, once per ``schedule()`` call.

        A busy call (tokens scheduled, or requests running) is no stall; it
        recounts the waiting holders only when their gauges are due (see
        :meth:`GuardSchedulerSide.census_due`). A call that scheduled
        nothing, or made a lateral preemption, always recounts.
        """
        busy = output.total_num_scheduled_tokens > 0 or bool(self.running)
        side = self.wedge_guard
        if (
            busy
            and not self._lateral_this_call
            and not side.census_due(any(self._access.holder_queues()))
        ):
            side.note_no_stall()
            return
        self._count_holders(output)

    def _count_holders(self, output: SchedulerOutput) -> None:
        """Count the waiting holders for the gauges and the stall watch.

        Counted, not viewed: no object per holder (the views are built only
        for a log line), and vLLM's own predicate called directly.
        """
        num_holders = recv_done = in_flight = blocks_held = 0
        get_blocks = self.kv_cache_manager.get_blocks
        holds_blocks = self._access.holds_blocks_test()
        recv_done_ids = self.finished_recving_kv_req_ids
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
        step = StepObservation(
            output.total_num_scheduled_tokens,
            len(self.running),
            self._lateral_this_call,
            num_holders,
            recv_done,
            blocks_held,
            in_flight,
        )
        self.wedge_guard.observe_step(step, self._holder_views)


class WedgeGuardScheduler(WedgeGuardMixin, Scheduler):  # type: ignore[misc]
    """vLLM's ``Scheduler`` with the wedge guard."""


class WedgeGuardAsyncScheduler(WedgeGuardMixin, AsyncScheduler):  # type: ignore[misc]
    """vLLM's ``AsyncScheduler`` (on by default) with the wedge guard.

    MRO: WedgeGuardMixin -> AsyncScheduler -> Scheduler, so the guard's
    overrides wrap AsyncScheduler's, which wrap Scheduler's.
    """


__all__ = [
    "WedgeGuardAsyncScheduler",
    "WedgeGuardMixin",
    "WedgeGuardScheduler",
]
