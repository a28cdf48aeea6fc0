"""The guard's scheduler side: the ledger, and the rooms that keep it.

Built once per engine, by :class:`~vllm_mooncake.guard.connector.WedgeGuardConnector`
in its SCHEDULER role only (workers build none of it).
:class:`GuardSchedulerSide` holds (``docs/architecture.md`` draws them):

- the :class:`~vllm_mooncake.guard.ledger.BlockLedger` -- every request's
  blocks, owning child and receive state -- and the
  :class:`~vllm_mooncake.guard.stats.GuardStats` behind the metrics;
- :attr:`GuardSchedulerSide.ownership` (``ownership.py``): routing, the
  owner, the allocation order, the retry budget, child faults;
- :attr:`GuardSchedulerSide.notices` (``notices.py``): the receive-notice
  filter, loads that never started, the pre-0.30 invalid-block step;
- :attr:`GuardSchedulerSide.watch` (``stall_watch.py``): the holder gauges,
  the wedge alarm, the resolution log line, the stuck flag;
- :attr:`GuardSchedulerSide.receives` (``receive_watch.py``): deadlines and
  sender probes (``senders.py``) of the receives in flight;
- :attr:`GuardSchedulerSide.quarantine` (``quarantine.py``): blocks a
  failed receive's writer may still write, kept from reuse.

It feeds the ledger the request life cycle itself -- arrival, what each step
scheduled or preempted, the finish -- and the valve's lateral preemptions,
under one error policy: a transition the ledger refuses (``LedgerError``) is
counted, then raised (``strict``) or logged with its traceback.

Nothing here imports vLLM's scheduler: requests, blocks and outputs are
read by attribute, so the rooms run in unit tests with plain objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vllm_mooncake import logger_for
from vllm_mooncake.guard.config import GuardConfig
from vllm_mooncake.guard.ledger import BlockLedger, HolderView, LedgerError, Victim
from vllm_mooncake.guard.notices import ReceiveNotices
from vllm_mooncake.guard.ownership import LoadOwnership
from vllm_mooncake.guard.quarantine import Quarantine
from vllm_mooncake.guard.receive_watch import ReceiveWatch
from vllm_mooncake.guard.routing import ChildRouter
from vllm_mooncake.guard.senders import SenderProbes
from vllm_mooncake.guard.stall_watch import StallWatch
from vllm_mooncake.guard.stats import GuardStats

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

logger = logger_for(__name__)


class GuardSchedulerSide:
    """The ledger, the stats and the rooms of one scheduler."""

    def __init__(
        self,
        config: GuardConfig,
        router: ChildRouter,
        requests_to_connector: dict[str, int],
        block_size: int,
    ) -> None:
        self.ledger = BlockLedger()
        self.stats = GuardStats()
        self.router = router
        self.probes = SenderProbes()
        self.receives = ReceiveWatch(config, self.ledger, self.stats, self.probes)
        self.quarantine = Quarantine(config, self.stats, self.probes)
        self.notices = ReceiveNotices(
            self.ledger, self.stats, block_size, self.receives, self.quarantine
        )
        self.ownership = LoadOwnership(
            config,
            self.ledger,
            self.stats,
            router,
            requests_to_connector,
            self._ledger_refused,
            self.notices.load_not_started,
            self.receives.started,
            self.quarantine.held_ids,
        )
        self.watch = StallWatch(config, self.ledger, self.stats)
        # Whether the scheduler has unfinished requests (the guarded
        # scheduler binds its own): an engine with none is not stuck.
        self.has_work: Callable[[], bool] = lambda: True
        self._config = config

    @property
    def config(self) -> GuardConfig:
        """The ``wedge_guard`` section; set it to switch policy live (the
        simulator's and the recovery benchmark's hook): every room reads it."""
        return self._config

    @config.setter
    def config(self, config: GuardConfig) -> None:
        self._config = self.ownership.config = self.watch.config = config
        self.receives.config = self.quarantine.config = config

    @property
    def child_names(self) -> tuple[str, ...]:
        return self.router.names

    def _ledger_refused(self) -> None:
        """Called inside ``except LedgerError``: count it, then raise it again
        (strict) or log it with its traceback."""
        self.stats.ledger_errors += 1
        if self._config.strict:
            raise  # the LedgerError being handled
        logger.exception("wedge guard ledger inconsistency (continuing)")

    # ---- the life cycle, from the facade's hooks -----------------------------------
    def on_arrival(self, req_id: str) -> None:
        try:
            self.ledger.on_arrival(req_id)
        except LedgerError:
            self._ledger_refused()

    def observe_scheduler_output(self, scheduler_output: SchedulerOutput) -> None:
        """What this step scheduled and preempted (from build_connector_meta)."""
        ledger = self.ledger
        for req_id in scheduler_output.preempted_req_ids or ():
            ledger.on_preempted(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = new.block_ids
            self._scheduled(
                new.req_id,
                new.num_computed_tokens,
                len(block_ids[0]) if block_ids else 0,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed, blocks in ledger.on_scheduled_again(
            cached.req_ids,
            cached.num_computed_tokens,
            cached.new_block_ids,
            scheduler_output.num_scheduled_tokens.keys(),
        ):
            self._scheduled(req_id, computed, blocks)

    def _scheduled(self, req_id: str, computed_tokens: int, num_blocks: int) -> None:
        try:
            self.ledger.on_scheduled(req_id, computed_tokens, num_blocks)
        except LedgerError:
            self._ledger_refused()

    def record_finished(self, req_id: str) -> None:
        """vLLM freed ``req_id`` (or keeps it for its receive): see
        :meth:`BlockLedger.on_finished`. A second call for the same request
        (MultiConnector's all-groups finish goes through ``request_finished``)
        finds nothing to do."""
        self.ledger.on_finished(req_id)

    # ---- the valve's questions and reports ------------------------------------------
    def has_executed(self, req_id: str) -> bool:
        """Whether the worker has seen ``req_id`` (it must resume, not restart)."""
        return self.ledger.has_executed(req_id)

    def pick_victim(self, views: Iterable[HolderView], target: str) -> Victim | None:
        return self.ledger.pick_victim(views, target)

    def on_lateral_preemption(self, victim: Victim) -> None:
        """The valve undid ``victim``'s admission: its blocks are gone."""
        try:
            self.ledger.on_lateral_preempt(victim.req_id)
        except LedgerError:
            self._ledger_refused()
        self.ownership.forget(victim.req_id)
        key = (victim.reason.value, victim.owner or "none")
        self.stats.lateral_preemptions[key] += 1

    def before_stats_report(self) -> None:
        """vLLM is about to read the stats: a stuck flag on an engine with
        nothing left to do comes down in this report (it will not step
        again to say so). The spell itself ends after every update
        (:meth:`note_if_idle`), whether vLLM asks for stats or not."""
        if self.stats.stuck:
            self.note_if_idle()

    def note_if_idle(self) -> None:
        """An engine with nothing left to do stops stepping: its spell
        without progress ends here (a stuck flag comes down), or the idle
        time until the next request would count as a step without progress
        and a healthy rank would report itself stuck on that request's first
        zero-token step (a receive starting)."""
        if not self.has_work():
            self.watch.clear_stuck("no request left")

    def note_attempts_exhausted(self) -> None:
        self.stats.attempts_exhausted += 1


__all__ = ["GuardSchedulerSide"]
