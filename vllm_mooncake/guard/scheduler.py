"""The guarded schedulers: lateral preemption when admission fails.

Life cycle of a wedge and its resolution (vLLM 0.32; ``docs/architecture.md``
follows a request through every hook):

1. Requests A and B hold KV blocks without having run: B's receive finished,
   A was promoted after its own load. Both wait in ``kv_holding_waiting``
   (``skipped_waiting`` before 0.31; see ``compat/releases.py``).
2. ``schedule()`` peeks A and asks ``KVCacheManager.allocate_slots`` for A's
   next chunk; there are not enough free blocks, it returns ``None`` and the
   admission loop ``break``s. Nothing runs, so vLLM's running-side
   preemption has no victim; every later step repeats 2. -- a wedge.
3. The guard's valve (``valve.py``) wraps ``allocate_slots`` on this
   scheduler's instance (the one place both loops allocate). On a ``None``
   for a request being *admitted* (not RUNNING), when nothing is running
   (``only_when_idle``), it asks the ledger for a lateral victim (recv-done
   or promoted-but-idle holder; never in flight, never RUNNING, never A),
   undoes the victim's admission, and retries -- at most ``max_attempts``
   times per ``schedule()`` call.
4. The stall watch (``stall_watch.py``) counts the holders after the call:
   the gauges, the resolution WARNING, and the wedge alarm when a stall
   goes on with the valve shut.
5. Before each call, receives that will not land -- past
   ``recv_deadline_s``, or their sender dead -- are failed, their blocks
   quarantined while a writer may remain (``stranded.py``).

Nothing of ``Scheduler.schedule()`` is copied: the subclasses override
``schedule`` (to arm the valve and watch for stalls), ``update_from_output``
(to filter the receive notices once, before vLLM reads them -- never one
vLLM still waits on -- and count failed loads against the retry budget),
``finish_requests`` (to remember requests aborted mid-receive),
``add_request`` (before 0.22, to tell the ledger of an arrival),
``_inflight_prefill_reserved_blocks`` (policies without reservation) and the
promotion hook (status fix for never-executed victims), each calling
``super()``. Observers (tests, the simulator) attach with
:meth:`WedgeGuardMixin.add_guard_observer` (``observer.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from copy import copy
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from vllm_mooncake import logger_for
from vllm_mooncake.compat.releases import SchedulerAccess, installed_layout
from vllm_mooncake.guard.config import GuardConfigError
from vllm_mooncake.guard.connector import WedgeGuardConnector
from vllm_mooncake.guard.holders import WaitingHolders
from vllm_mooncake.guard.kv_stats import stats_carrier
from vllm_mooncake.guard.observer import GuardObserver
from vllm_mooncake.guard.scheduler_side import GuardSchedulerSide
from vllm_mooncake.guard.stranded import StrandedReceives
from vllm_mooncake.guard.valve import LateralValve

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

logger = logger_for(__name__)


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
        # The guard's state and its rooms (guard/scheduler_side.py).
        self.wedge_guard: GuardSchedulerSide = connector.scheduler_side
        self._access = SchedulerAccess(self, installed_layout())
        self._guard_observers: list[GuardObserver] = []
        # What the guard reads of the waiting holders, and the valve.
        self.guard_holders = WaitingHolders(self, self._access)
        self.guard_valve = LateralValve(
            self,
            self.wedge_guard,
            self._access,
            self.guard_holders,
            self._guard_observers,
        )
        # Receives whose sender died or went silent (guard/stranded.py).
        self.guard_stranded = StrandedReceives(self, self.wedge_guard, self._access)
        self.wedge_guard.has_work = self.has_unfinished_requests
        # Requests finished (aborted) while their receive was in flight:
        # vLLM keeps them, blocks and all, until the receive notice lands.
        self._finished_mid_recv: set[str] = set()
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

    def add_guard_observer(self, observer: GuardObserver) -> None:
        """Tell ``observer`` what the guard does from the next call on
        (``guard/observer.py``). One that watches admissions has the valve
        armed on every call from then (what the valve does is the same)."""
        self._guard_observers.append(observer)
        if type(observer).admission is not GuardObserver.admission:
            self.guard_valve.watched = True

    # ---- overrides (each calls super) -------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self.guard_stranded.check()
        valve = self.guard_valve
        valve.arm()
        output = super().schedule(*args, **kwargs)
        self.wedge_guard.watch.after_schedule(
            output.total_num_scheduled_tokens,
            len(self.running),
            valve.lateral,
            self.guard_holders,
        )
        if self._guard_observers:
            holders = self.guard_holders.views()
            for observer in self._guard_observers:
                observer.scheduled(output, holders)
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: Any
    ) -> Any:
        """Filter receive notices before vLLM reads ``failed_recving``, and
        report loads a raising child never started (guard/containment.py);
        after vLLM's update, an engine left with no request ends its spell
        without progress (it stops stepping until the next one arrives)."""
        kv_output = getattr(model_runner_output, "kv_connector_output", None)
        unstarted = self.wedge_guard.notices.pending
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
        self.wedge_guard.note_if_idle()
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
        """The receive notices filtered, once, before vLLM reads the output
        (``notices.py``); then the failed loads counted."""
        observers = self._guard_observers
        received = set(kv_output.finished_recving or ()) if observers else None
        side = self.wedge_guard
        side.notices.filter(kv_output, self._awaits_recv_notice, self._load_block_ids)
        if received is not None:
            passed = set(kv_output.finished_recving or ())
            for observer in observers:
                observer.notices_filtered(received, passed)
        failed = self.guard_holders.failed_loads(kv_output)
        if failed:
            side.ownership.record_failed_loads(failed)

    def _load_block_ids(self, req_id: str) -> Sequence[int]:
        """A live request's block ids (first KV cache group); none if gone."""
        if req_id not in self.requests:
            return ()
        block_ids = self.kv_cache_manager.get_block_ids(req_id)
        return block_ids[0] if block_ids else ()

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
