"""The lateral valve: admission failed with nothing running -- undo a holder's.

The guarded scheduler's one intervention in ``schedule()``, which it never
copies (see ``scheduler.py`` for the wedge it resolves). Per call:

1. :meth:`LateralValve.arm` resets the per-call budget (``max_attempts``)
   and shadows ``allocate_slots`` on the scheduler's KVCacheManager instance
   only if a lateral preemption may happen in the call (or an observer
   watches admissions: ``observer.py``);
2. on a ``None`` from vLLM's ``allocate_slots`` for a request being
   *admitted* (WAITING / PREEMPTED; a RUNNING one is the running loop's own
   preemption), with nothing running (``only_when_idle``) and budget left,
   the ledger picks a victim among the waiting holders
   (``GuardSchedulerSide.pick_victim``: recv-done or promoted-but-idle;
   never in flight, never RUNNING, never the target);
3. :meth:`LateralValve.preempt` undoes the victim's admission (below) and
   the allocation is retried against a fresh reservation -- until it fits,
   no victim is left, or the budget is spent. With no victim, a stale
   reservation the target holds against itself is dropped instead (W2);
4. the observers hear of each preemption and of the valve's answer.

Undoing an admission leaves vLLM's state as if the victim had never been
admitted, less what it cached: out of the holder queue, loaded blocks cached,
out of the receive sets, blocks freed, out of the reservation set (and, on
0.34, its parked reservation and load-cap slot given back),
``num_preemptions`` counted, and back at the front of ``waiting`` as WAITING
(the worker never saw it: it must arrive as new) or PREEMPTED (it ran
before: it resumes). 0.19-0.20 ask ``can_fit_full_sequence`` before
``allocate_slots``; the same valve wraps that gate there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.v1.engine import EngineCoreEventType
from vllm.v1.request import Request, RequestStatus

from vllm_mooncake import logger_for
from vllm_mooncake.compat.releases import SchedulerAccess
from vllm_mooncake.guard.holders import WaitingHolders
from vllm_mooncake.guard.ledger import HolderView, Victim
from vllm_mooncake.guard.observer import GuardObserver
from vllm_mooncake.guard.scheduler_side import GuardSchedulerSide

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

logger = logger_for(__name__)

_ADMITTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


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


class LateralValve:
    """One scheduler's valve (see the module docstring)."""

    def __init__(
        self,
        scheduler: Any,
        side: GuardSchedulerSide,
        access: SchedulerAccess,
        holders: WaitingHolders,
        observers: list[GuardObserver],
    ) -> None:
        self.scheduler = scheduler
        self.side = side
        self._access = access
        self._holders = holders
        self._observers = observers  # the scheduler's list, shared
        # Whether an observer watches admissions: the valve is then armed
        # on every call, so that it sees every one (set by the scheduler).
        self.watched = False
        self._budget = 0
        # This call's lateral preemptions: (victim, admission target id).
        self.lateral: list[tuple[Victim, str]] = []
        self._install_admission_valve()
        if access.release.full_sequence_gate:
            self._install_full_sequence_valve()

    # ---- 1. arming, per schedule() call ----------------------------------------
    def _install_admission_valve(self) -> None:
        """Build the ``allocate_slots`` wrapper :meth:`arm` shadows vLLM's with.

        Why: the admission loop's allocation failure is not a hook; it
        ``break``s inside ``schedule()``, which must not be copied.
        How: an instance attribute shadows the bound method; only this
        scheduler's manager is affected, and the wrapper calls vLLM's method
        of the manager's class at call time (or whatever shadowed it before
        the guard).
        Upstream: vLLM closed the lateral-preemption PR (#40968) and merged
        an admission-time reservation (#44560) instead.
        Removal: when vLLM offers an admission-failure hook or resolves
        W1/W2 itself.
        """
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        # What shadowed the method before us, if anything (put back when the
        # valve is off for a call).
        self._valve_base = base = _instance_attribute(manager, "allocate_slots")
        self._valve_on = False  # whether arm() last put the valve on
        observers = self._observers

        def allocate(request: Request, args: Any, kwargs: Any) -> Any:
            if base is not None:
                return base(request, *args, **kwargs)
            return type(manager).allocate_slots(manager, request, *args, **kwargs)

        def allocate_slots(
            request: Request, *args: Any, **kwargs: Any
        ) -> KVCacheBlocks | None:
            blocks = allocate(request, args, kwargs)
            while blocks is None and self._may_preempt_for(request):
                if not self._preempt_one_for(request):
                    break
                if kwargs.get("reserved_blocks"):
                    kwargs["reserved_blocks"] = (
                        scheduler._inflight_prefill_reserved_blocks()
                        + self._access.reservation_extras()
                    )
                blocks = allocate(request, args, kwargs)
            if self.watched and request.status in _ADMITTING:
                for observer in observers:
                    observer.admission(request, blocks)
            return blocks

        self._valve: Callable[..., KVCacheBlocks | None] = allocate_slots

    def arm(self) -> None:
        """Start a ``schedule()`` call: the budget refilled, the valve
        shadowing ``allocate_slots`` only if a lateral preemption may happen
        in this call (or an observer watches admissions).

        Under ``only_when_idle`` a call that starts with requests running
        admits nothing laterally: vLLM's admission loop runs only when no
        running request was preempted in the same call, so ``running`` is
        still non-empty when it runs. That is the common call, and it costs
        two reads here: the valve is already off.
        """
        config = self.side.config
        self._budget = config.max_attempts
        if self.lateral:  # an empty one is reused
            self.lateral = []
        armed = self.watched or (
            config.valve and not (config.only_when_idle and self.scheduler.running)
        )
        if not armed and not self._valve_on:
            return
        manager = self.scheduler.kv_cache_manager
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
        manager = self.scheduler.kv_cache_manager
        stock_fits = manager.can_fit_full_sequence

        def can_fit_full_sequence(request: Request, *args: Any, **kwargs: Any) -> bool:
            fits = bool(stock_fits(request, *args, **kwargs))
            while not fits and self._may_preempt_for(request):
                victim, views = self._choose_victim(request)
                if victim is None:
                    break
                self._lateral(victim, request, views)
                fits = bool(stock_fits(request, *args, **kwargs))
            return fits

        manager.can_fit_full_sequence = can_fit_full_sequence

    # ---- 2. whether, and whom ------------------------------------------------------
    def _may_preempt_for(self, request: Request) -> bool:
        config = self.side.config
        if not config.valve:
            return False
        if request.status not in _ADMITTING:
            return False  # RUNNING: the running loop's own preemption applies
        if config.only_when_idle and self.scheduler.running:
            return False  # running requests will free blocks: not a wedge
        if self._budget <= 0:
            self.side.note_attempts_exhausted()
            return False
        return True

    def _choose_victim(self, target: Request) -> tuple[Victim | None, list[HolderView]]:
        views = self._holders.views()
        return self.side.pick_victim(views, target.request_id), views

    def _preempt_one_for(self, request: Request) -> bool:
        """One lateral preemption for ``request``, or the stale
        self-reservation dropped; False if neither was possible."""
        victim, views = self._choose_victim(request)
        if victim is not None:
            self._lateral(victim, request, views)
            return True
        return self._drop_stale_self_reservation(request)

    def _lateral(
        self, victim: Victim, target: Request, views: list[HolderView]
    ) -> None:
        observers = self._observers
        for observer in observers:
            observer.before_lateral(victim, target, views)
        self.preempt(victim, target)
        for observer in observers:
            observer.after_lateral(victim, target)

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
        scheduler = self.scheduler
        access = self._access
        if access.release.parked and request in scheduler._parked_reservations:
            # 0.34 caches the same self-reservation as a parked one (set at
            # its promotion after the failed load): give it back. vLLM parks
            # it again if this admission starts a load, and drops it anyway
            # when the request is admitted.
            access.release_parked(request)
            logger.info(
                "wedge guard: %s's parked reservation counted against its own "
                "admission; given back",
                request.request_id,
            )
            return request not in scheduler._parked_reservations
        if not access.in_reservation(request) or access.holds_blocks(request):
            return False
        scheduler._inflight_prefills.discard(request)
        logger.info(
            "wedge guard: %s reserved blocks against its own admission after a "
            "failed load; reservation dropped",
            request.request_id,
        )
        return True

    # ---- 3. undoing an admission ---------------------------------------------------
    def preempt(self, victim: Victim, target: Request) -> None:
        """Undo ``victim``'s admission (see the module docstring)."""
        scheduler = self.scheduler
        access = self._access
        request = scheduler.requests[victim.req_id]
        req_id = request.request_id
        self._budget -= 1
        self.lateral.append((victim, target.request_id))
        access.remove_waiting(request)
        if (
            request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and req_id in scheduler.finished_recving_kv_req_ids
        ):
            # Cache what the receive loaded so re-admission hits the prefix
            # cache (frees the blocks itself after a failed load).
            scheduler._update_waiting_for_remote_kv(request)
        scheduler.finished_recving_kv_req_ids.discard(req_id)
        scheduler.failed_recving_kv_req_ids.discard(req_id)
        access.free_blocks(request)
        scheduler.encoder_cache_manager.free(request)
        # Out of the reservation set (0.23+), its parked reservation given
        # back (0.34), its deferred load dropped (0.33+).
        access.drop_reservation(request)
        request.num_computed_tokens = 0
        executed = self.side.has_executed(req_id)
        request.status = RequestStatus.PREEMPTED if executed else RequestStatus.WAITING
        request.num_preemptions += 1
        if scheduler.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED, time.monotonic())
        scheduler.waiting.prepend_request(request)
        access.note_preempted(req_id)
        self.side.on_lateral_preemption(victim)


__all__ = ["LateralValve"]
