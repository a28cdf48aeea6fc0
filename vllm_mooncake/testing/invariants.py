"""Invariants of a guarded scheduler, checked after every engine step.

Shared by the property tests (``tests/test_properties.py``), the long run
(``bench/property_run.py``) and the simulator. Each ``*_problems`` function
reads the real vLLM state and returns what is wrong (empty: the invariant
holds); :class:`InvariantChecker` runs them all around every
:meth:`SchedulerDriver.step` and raises :class:`InvariantViolation`, naming
the invariant, at the first step that breaks one.

The invariants:

``blocks``     block conservation: every usable block is either free or
               referenced, ``ref_cnt`` equals the references held by live
               requests (plus deferred frees), the free queue holds exactly
               the unreferenced blocks, no request lists a block twice, and a
               block held by two requests is a prefix-cache block (never a
               block some request is writing).
``in_flight``  no block of a request whose receive is in flight is freed:
               checked when the guard picks a lateral victim (the victim's
               receive is not in flight, by the ledger and by the worker),
               and after every step (every block an in-flight receive is
               writing is still held by its request).
``victim``     a lateral victim is a waiting block holder: never RUNNING,
               never the request being admitted.
``ledger``     the ledger agrees with the scheduler: every live request is
               known, no entry outlives its request (an entry may drain a
               receive still in flight), the ledger's in-flight set is the
               worker's, a request the ledger calls executed was sent to
               the worker as new, and a request vLLM preempted (PREEMPTED,
               holding no block) holds no block or token in the ledger.
``resumed``    a request is never sent to the worker as cached/resumed
               unless the worker saw it as new (vLLM's model runner raises
               KeyError otherwise).
``notices``    a receive notice for a request vLLM waits on is never
               dropped by the guard's filter: vLLM waits on a
               WAITING_FOR_REMOTE_KVS request not yet in its finished-receive
               set, and on a request aborted in that state (kept, blocks and
               all, until the notice lands); the ledger's view does not count.
``ends``       every request ends, with a reason it may have (length/stop;
               abort only if aborted; error only after a failed load under
               ``kv_load_failure_policy=fail``), and the scheduler, ledger
               and worker end empty.
``stall``      (lateral policies) no run of zero-token steps with nothing
               running, in which an admission failed while the ledger's rule
               still offered a victim other than the request being admitted,
               longer than the configured bound (the valve may stop early
               only when ``max_attempts`` runs out: the next step goes on).

What the valve does, and when (the policy, not only safety):

``lateral``    a lateral preemption happens only when its policy says so:
               under a lateral policy, for a request being admitted whose
               allocation (vLLM's own ``allocate_slots``) just failed -- and
               failed again after the previous preemption of the same call,
               so one call never preempts more than the head needed to fit
               -- with the ledger's rule offering this very victim, within
               the per-call budget (``max_attempts``: never more, and
               ``attempts_exhausted`` counted only once the budget is spent)
               and, under ``only_when_idle``, with nothing running. After it
               the victim is as if never admitted (no computed token, no
               block, no reservation, WAITING / PREEMPTED), the ledger was
               told (no receive, no block) and the counter moved.
``reservation`` every allocation for a request being admitted is checked
               against a fresh computation of the async-load reservation:
               vLLM's in-flight-prefill blocks under ``reserve`` /
               ``reserve+lateral``, none under ``lateral``; after a lateral
               preemption too.
``prefix``     a lateral victim, re-admitted, reuses the KV it had (its
               blocks the preemption cached and nothing evicted since): its
               local prefix-cache hit covers them.
``alarm``      the wedge alarm fires once per stall of ``stall_alarm_steps``
               zero-token steps with holders waiting and nothing running, and
               re-arms when the stall ends.
``routing``    a lookup goes to the child whose ``kv_transfer_params`` the
               request carries, never to another.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_mooncake.compat.releases import SchedulerAccess, installed_layout
from vllm_mooncake.guard.ledger import RecvState, WaitStatus
from vllm_mooncake.guard.observer import GuardObserver
from vllm_mooncake.testing.leaks import scheduler_leaks

if TYPE_CHECKING:
    from collections.abc import Sequence
    from collections.abc import Set as AbstractSet

    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_mooncake.guard.ledger import HolderView, Victim
    from vllm_mooncake.testing.driver import SchedulerDriver, StepResult
    from vllm_mooncake.testing.scripted_connector import ScriptedTransferWorker

BLOCKS = "blocks"
IN_FLIGHT = "in_flight"
VICTIM = "victim"
LEDGER = "ledger"
RESUMED = "resumed"
ENDS = "ends"
STALL = "stall"
NOTICES = "notices"
LATERAL = "lateral"
RESERVATION = "reservation"
PREFIX = "prefix"
ALARM = "alarm"
ROUTING = "routing"
INVARIANTS = (
    BLOCKS,
    IN_FLIGHT,
    VICTIM,
    LEDGER,
    RESUMED,
    NOTICES,
    ENDS,
    STALL,
    LATERAL,
    RESERVATION,
    PREFIX,
    ALARM,
    ROUTING,
)
ADMITTING = ("WAITING", "PREEMPTED")

# Reasons a request may end with, by what happened to it.
NORMAL_ENDS = frozenset({"length", "stop"})


class InvariantViolation(AssertionError):
    """An invariant broke; ``invariant`` names it, ``problems`` say how."""

    def __init__(self, invariant: str, step: int, problems: list[str]) -> None:
        self.invariant = invariant
        self.step = step
        self.problems = problems
        detail = "\n  ".join(problems)
        super().__init__(f"invariant '{invariant}' broken at step {step}:\n  {detail}")


# ---- the checks: each returns what is wrong, empty when it holds ---------------
def _request_blocks(scheduler: Any) -> dict[str, list[int]]:
    """Non-null block ids each request lists, over all KV cache groups."""
    held: dict[str, list[int]] = {}
    manager = scheduler.kv_cache_manager
    for single in manager.coordinator.single_type_managers:
        for req_id, blocks in single.req_to_blocks.items():
            ids = [b.block_id for b in blocks if not b.is_null]
            if ids:
                held.setdefault(req_id, []).extend(ids)
    return held


def block_problems(scheduler: Any) -> list[str]:
    """Block conservation and single ownership (see the module docstring)."""
    problems: list[str] = []
    pool = scheduler.kv_cache_manager.block_pool
    held = _request_blocks(scheduler)
    refs: Counter[int] = Counter()
    owners: dict[int, list[str]] = {}
    for req_id, ids in held.items():
        twice = sorted(b for b, n in Counter(ids).items() if n > 1)
        if twice:
            problems.append(f"{req_id} lists block(s) {twice} twice")
        if req_id not in scheduler.requests:
            problems.append(f"blocks {sorted(ids)} held for {req_id}, which is gone")
        refs.update(set(ids))
        for b in set(ids):
            owners.setdefault(b, []).append(req_id)
    deferred: Counter[int] = Counter(
        b.block_id
        for _, blocks in getattr(scheduler, "deferred_frees", ())
        for b in blocks
        if not b.is_null
    )
    free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    free = set(free_ids)
    if len(free) != len(free_ids):
        problems.append("a block is in the free queue twice")
    for block in pool.blocks:
        if block.is_null:
            continue
        expected = refs[block.block_id] + deferred[block.block_id]
        if block.ref_cnt != expected:
            problems.append(
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                f"{expected} reference(s) (held by {owners.get(block.block_id, [])}, "
                f"{deferred[block.block_id]} deferred)"
            )
        if (block.ref_cnt == 0) != (block.block_id in free):
            where = "in" if block.block_id in free else "not in"
            problems.append(
                f"block {block.block_id}: ref_cnt {block.ref_cnt} and {where} "
                "the free queue"
            )
        sharers = owners.get(block.block_id, [])
        if len(sharers) > 1 and block.block_hash is None:
            problems.append(
                f"block {block.block_id} is owned by {sorted(sharers)} but is not "
                "a prefix-cache block"
            )
    usable = pool.num_gpu_blocks - 1
    in_use = set(refs) | set(deferred)
    if pool.get_num_free_blocks() != len(free):
        problems.append(
            f"free count {pool.get_num_free_blocks()} != free queue {len(free)}"
        )
    if len(free) + len(in_use) != usable:
        problems.append(
            f"free {len(free)} + held {len(in_use)} != pool {usable} "
            f"({usable - len(free) - len(in_use)} block(s) unaccounted for)"
        )
    return problems


def async_receives(worker: ScriptedTransferWorker) -> dict[str, list[int]]:
    """Async receives the worker is still writing: request -> block ids."""
    return {
        req_id: order.block_ids
        for req_id, order in worker.in_flight_orders().items()
        if order.script.is_async
    }


def in_flight_problems(scheduler: Any, worker: ScriptedTransferWorker) -> list[str]:
    """Every block an in-flight receive writes is still held by its request."""
    problems: list[str] = []
    held = _request_blocks(scheduler)
    for req_id, block_ids in async_receives(worker).items():
        if req_id not in scheduler.requests:
            problems.append(
                f"{req_id}: its receive is in flight but the scheduler dropped it "
                f"(blocks {block_ids} freed under the transfer)"
            )
            continue
        missing = sorted(set(block_ids) - set(held.get(req_id, ())))
        if missing:
            problems.append(
                f"{req_id}: block(s) {missing} freed while its receive is still "
                "writing them"
            )
    return problems


def victim_problems(
    scheduler: Any, worker: ScriptedTransferWorker, victim: Victim, target: Any
) -> tuple[list[str], list[str]]:
    """(in_flight problems, victim problems) of a lateral victim, before it goes."""
    from vllm.v1.request import RequestStatus

    req_id = victim.req_id
    in_flight: list[str] = []
    if req_id in async_receives(worker):
        in_flight.append(f"lateral victim {req_id}: the worker is still receiving it")
    ledger = scheduler.wedge_guard.ledger
    if ledger.recv_state(req_id) is RecvState.IN_FLIGHT:
        in_flight.append(
            f"lateral victim {req_id}: the ledger has its receive in flight"
        )
    bad: list[str] = []
    request = scheduler.requests.get(req_id)
    if request is None or request.is_finished():
        bad.append(f"lateral victim {req_id} is not a live request")
    elif request.status == RequestStatus.RUNNING or request in scheduler.running:
        bad.append(f"lateral victim {req_id} is RUNNING")
    if req_id == target.request_id:
        bad.append(f"lateral victim {req_id} is the request being admitted")
    return in_flight, bad


def ledger_problems(
    scheduler: Any, worker: ScriptedTransferWorker, seen_as_new: set[str]
) -> list[str]:
    """The ledger agrees with the scheduler and the worker."""
    from vllm.v1.request import RequestStatus

    problems: list[str] = []
    ledger = scheduler.wedge_guard.ledger
    receiving = set(async_receives(worker))
    for req_id, request in scheduler.requests.items():
        entry = ledger.get(req_id)
        if request.is_finished():
            if req_id in receiving and (entry is None or not entry.finished):
                problems.append(
                    f"{req_id} finished with its receive in flight but the ledger "
                    "does not drain it"
                )
            continue
        if entry is None:
            problems.append(f"live request {req_id} ({request.status.name}) unknown")
            continue
        waiting_recv = (
            request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and req_id not in scheduler.finished_recving_kv_req_ids
        )
        if (
            request.status == RequestStatus.PREEMPTED
            and entry.recv is RecvState.NONE
            and (entry.num_blocks or entry.computed_tokens)
            and not _blocks_of(scheduler, req_id)
        ):
            problems.append(
                f"{req_id} was preempted (it holds no block) but the ledger has "
                f"blocks={entry.num_blocks} computed={entry.computed_tokens}"
            )
        if waiting_recv and entry.recv is not RecvState.IN_FLIGHT:
            problems.append(
                f"{req_id} waits for its receive but the ledger has recv="
                f"{entry.recv.value}"
            )
        if entry.recv is RecvState.IN_FLIGHT and not waiting_recv:
            problems.append(
                f"ledger has {req_id}'s receive in flight but it is "
                f"{request.status.name}"
            )
        if entry.executed and req_id not in seen_as_new:
            problems.append(
                f"ledger says {req_id} executed but the worker never saw it as new"
            )
    for entry in ledger.entries():
        request = scheduler.requests.get(entry.req_id)
        if request is None:
            problems.append(f"stale ledger entry {entry.req_id}: the request is gone")
        elif request.is_finished() and not (
            entry.finished and entry.recv is RecvState.IN_FLIGHT
        ):
            problems.append(
                f"stale ledger entry {entry.req_id}: finished, recv={entry.recv.value}"
            )
    ledger_receiving = ledger.in_flight()
    if ledger_receiving != receiving:
        problems.append(
            f"in flight per the ledger only: {sorted(ledger_receiving - receiving)}; "
            f"per the worker only: {sorted(receiving - ledger_receiving)}"
        )
    return problems


def awaited_notices(
    scheduler: Any, notices: Iterable[str], aborted_mid_recv: set[str]
) -> set[str]:
    """The notices in ``notices`` vLLM's scheduler waits on, by vLLM's state."""
    from vllm.v1.request import RequestStatus

    awaited = set()
    for req_id in notices:
        request = scheduler.requests.get(req_id)
        if request is None:
            continue
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if req_id not in scheduler.finished_recving_kv_req_ids:
                awaited.add(req_id)
        elif request.is_finished() and req_id in aborted_mid_recv:
            awaited.add(req_id)
    return awaited


def notice_problems(awaited: set[str], passed: Iterable[str]) -> list[str]:
    """Awaited receive notices the filter did not pass on to vLLM."""
    lost = sorted(awaited - set(passed))
    return [
        f"{req_id}: vLLM waited on its receive notice but the guard dropped it"
        for req_id in lost
    ]


def resumed_problems(so: SchedulerOutput, seen_as_new: set[str]) -> list[str]:
    """Cached/resumed requests the worker never saw as new."""
    cached = so.scheduled_cached_reqs
    resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
    return [
        f"{req_id} sent to the worker as "
        f"{'resumed' if req_id in resumed else 'cached'} but never seen as new"
        for req_id in cached.req_ids
        if req_id not in seen_as_new
    ]


def end_problems(
    driver: SchedulerDriver, allowed: Mapping[str, frozenset[str]]
) -> list[str]:
    """Every request ended with an allowed reason; nothing is left behind.

    ``allowed``: request id -> the finish reasons it may end with.
    """
    problems: list[str] = []
    for req_id, reasons in allowed.items():
        got = driver.finished.get(req_id)
        if got is None:
            request = driver.scheduler.requests.get(req_id)
            state = request.status.name if request is not None else "unknown"
            problems.append(f"{req_id} never ended ({state})")
        elif got not in reasons:
            problems.append(
                f"{req_id} ended '{got}', expected one of {sorted(reasons)}"
            )
    problems += scheduler_leaks(driver.scheduler)
    ledger = driver.scheduler.wedge_guard.ledger
    if len(ledger):
        problems.append(f"ledger not empty: {[e.req_id for e in ledger.entries()]}")
    if driver.worker.in_flight:
        problems.append(f"receives still in flight: {sorted(driver.worker.in_flight)}")
    return problems


def lateral_candidates(scheduler: Any) -> list[str]:
    """Waiting holders the ledger's rule would let the valve preempt."""
    ledger = scheduler.wedge_guard.ledger
    return [
        v.req_id
        for v in scheduler.guard_holders.views()
        if ledger.candidate_reason(v, target="") is not None
    ]


def _blocks_of(scheduler: Any, req_id: str) -> list[Any]:
    """The (non-null) blocks ``req_id`` holds in the first KV cache group."""
    single = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return [b for b in single.req_to_blocks.get(req_id, ()) if not b.is_null]


def _cached_prefix(blocks: list[Any]) -> list[tuple[int, Any]]:
    """The leading blocks that are prefix-cached, as (block id, hash)."""
    out = []
    for block in blocks:
        if block.block_hash is None:
            break
        out.append((block.block_id, block.block_hash))
    return out


def _prefix_problems(
    scheduler: Any, request: Any, cached: list[tuple[int, Any]], hit: int
) -> list[str]:
    """PREFIX: the re-admitted victim's local hit covers what is still cached."""
    pool = scheduler.kv_cache_manager.block_pool
    still = 0
    for block_id, block_hash in cached:
        if pool.blocks[block_id].block_hash != block_hash:
            break  # evicted (or reused) since the preemption
        still += 1
    block_size = scheduler.block_size
    # vLLM computes at least the last token: the hit stops a block short.
    still = min(still, (request.num_tokens - 1) // block_size)
    if hit >= still * block_size:
        return []
    return [
        f"re-admitted lateral victim {request.request_id} hit {hit} cached "
        f"tokens; {still} of its blocks ({still * block_size} tokens) were still "
        "cached from before its preemption"
    ]


def _access(scheduler: Any) -> SchedulerAccess:
    """vLLM's waiting state as the installed release lays it out
    (``compat/releases.py``), read the way the guard reads it."""
    return SchedulerAccess(scheduler, installed_layout())


def _in_reservation(scheduler: Any, request: Any) -> bool:
    """``request`` is in vLLM's async-load reservation set (0.23+)."""
    return _access(scheduler).in_reservation(request)


def _full_sequence_gate(scheduler: Any) -> bool:
    """0.19-0.20: the valve acts on ``can_fit_full_sequence``, not on a failed
    ``allocate_slots`` (see ``guard/valve.py``)."""
    return installed_layout().full_sequence_gate


# ---- the checker ------------------------------------------------------------------
@dataclass(frozen=True)
class LateralRecord:
    step: int
    victim: str
    target: str
    reason: str


@dataclass
class CheckerStats:
    steps: int = 0
    laterals: list[LateralRecord] = field(default_factory=list)
    longest_stall: int = 0  # zero-token idle steps in a row, candidate or not
    longest_candidate_stall: int = 0  # ... blocked while a victim was left
    blocked_with_candidate: int = 0  # admissions failed with a victim left


class InvariantChecker(GuardObserver):
    """Checks every invariant around each step of a guarded driver.

    Install it before the first step; it observes the guarded scheduler
    through its public seam (``guard/observer.py``: each lateral victim
    before and after it goes, each admission the valve answered, the
    holders after each call, the receive notices the filter passed), probes
    vLLM's own KVCacheManager and child lookups, and wraps the driver's
    ``on_scheduled`` callback (to see what is sent to the worker before the
    fake worker does). Call :meth:`after_step` with each step's result and
    :meth:`at_end` once the run is over.

    ``stall_bound``: the longest run of zero-token idle steps allowed in
    which an admission failed with a lateral victim left; None skips the
    ``stall`` invariant (policies without the valve). ``skip``: invariants
    not to check. ``watch_laterals=False`` leaves the victim checks to the
    after-step checks (and records no lateral preemptions).
    """

    def __init__(
        self,
        driver: SchedulerDriver,
        stall_bound: int | None = None,
        skip: Iterable[str] = (),
        watch_laterals: bool = True,
    ) -> None:
        self.driver = driver
        self.scheduler = driver.scheduler
        self.stall_bound = stall_bound
        self.skip = frozenset(skip)
        self.stats = CheckerStats()
        self.seen_as_new: set[str] = set()
        self._stall = 0
        self._candidate_stall = 0
        self._blocked_with_candidate = False  # in the step being run
        # Requests aborted while vLLM waited on their receive (NOTICES).
        self.aborted_mid_recv: set[str] = set()
        side = self.scheduler.wedge_guard
        # LATERAL: the last allocation of a request being admitted, as
        # (request id, failed), since the last lateral preemption.
        self._last_admission: tuple[str, bool] | None = None
        self._exhausted_seen = side.stats.attempts_exhausted
        self._laterals_at_start = side.stats.total_lateral_preemptions
        # PREFIX: lateral victims not yet re-admitted -> their blocks the
        # preemption cached, as (block id, block hash), in prompt order.
        self._victim_cache: dict[str, list[tuple[int, Any]]] = {}
        # ALARM: the alarm as the policy describes it.
        self._alarm_streak = 0
        self._alarm_armed = True
        self._alarms_expected = 0
        self._alarms_at_start = side.stats.wedges_detected
        self._watch_laterals = watch_laterals
        self._victim_blocks: list[Any] = []  # the victim's, before it goes
        self._holders: Sequence[HolderView] = ()  # after the last schedule()
        self._probe_allocations()
        self._watch_routing()
        self._watch_worker_input()
        self._watch_aborts()
        self.scheduler.add_guard_observer(self)

    # ---- the guard's observer seam ---------------------------------------------------
    def before_lateral(
        self, victim: Victim, target: Any, holders: Sequence[HolderView]
    ) -> None:
        if not self._watch_laterals:
            return
        in_flight, bad = victim_problems(
            self.scheduler, self.driver.worker, victim, target
        )
        self._raise_if(IN_FLIGHT, in_flight)
        self._raise_if(VICTIM, bad)
        self._raise_if(LATERAL, self._lateral_allowed(victim, target, holders))
        self._last_admission = None
        self._victim_blocks = _blocks_of(self.scheduler, victim.req_id)

    def after_lateral(self, victim: Victim, target: Any) -> None:
        if not self._watch_laterals:
            return
        self._raise_if(LATERAL, self._lateral_undone(victim))
        self._victim_cache[victim.req_id] = _cached_prefix(self._victim_blocks)
        self.stats.laterals.append(
            LateralRecord(
                self.driver.num_steps,
                victim.req_id,
                target.request_id,
                victim.reason.value,
            )
        )

    def admission(self, request: Any, blocks: Any) -> None:
        """STALL: note an admission that failed while the ledger offered a
        victim (the valve's answer, after it is done)."""
        if blocks is not None:
            return
        scheduler = self.scheduler
        views = scheduler.guard_holders.views()
        if scheduler.wedge_guard.ledger.pick_victim(views, request.request_id):
            self._blocked_with_candidate = True
            self.stats.blocked_with_candidate += 1

    def scheduled(self, output: Any, holders: Sequence[HolderView]) -> None:
        self._holders = holders

    def notices_filtered(
        self, received: AbstractSet[str], passed: AbstractSet[str]
    ) -> None:
        """NOTICES: what vLLM waited on went through the filter."""
        awaited = awaited_notices(self.scheduler, received, self.aborted_mid_recv)
        self._raise_if(NOTICES, notice_problems(awaited, passed))

    def _laterals_this_call(self) -> int:
        step = self.driver.num_steps
        return sum(1 for r in reversed(self.stats.laterals) if r.step == step)

    def _lateral_allowed(
        self, victim: Victim, target: Any, holders: Sequence[HolderView]
    ) -> list[str]:
        """LATERAL, before the preemption: may the valve act here at all?"""
        scheduler = self.scheduler
        config = scheduler.wedge_guard.config
        problems: list[str] = []
        who = f"lateral preemption of {victim.req_id} for {target.request_id}"
        if not config.policy.lateral:
            problems.append(f"{who} under policy {config.policy.value}")
        if target.status.name not in ADMITTING:
            problems.append(f"{who}: the target is {target.status.name}, not admitted")
        if not _full_sequence_gate(scheduler) and self._last_admission != (
            target.request_id,
            True,
        ):
            problems.append(
                f"{who} without a failed allocation for {target.request_id} since "
                f"the last preemption (last admission: {self._last_admission}): "
                "more victims than the head needed"
            )
        if config.only_when_idle and scheduler.running:
            running = [r.request_id for r in scheduler.running]
            problems.append(f"{who} with {running} running (only_when_idle)")
        done = self._laterals_this_call()
        if done >= config.max_attempts:
            problems.append(
                f"{who}: {done + 1} lateral preemptions in one schedule() call, "
                f"max_attempts={config.max_attempts}"
            )
        picked = scheduler.wedge_guard.ledger.pick_victim(holders, target.request_id)
        if picked is None or picked.req_id != victim.req_id:
            problems.append(
                f"{who}: the ledger's rule offers "
                f"{picked.req_id if picked else 'no candidate'}"
            )
        return problems

    def _lateral_undone(self, victim: Victim) -> list[str]:
        """LATERAL, after the preemption: the victim as if never admitted."""
        scheduler = self.scheduler
        req_id = victim.req_id
        problems: list[str] = []
        request = scheduler.requests.get(req_id)
        if request is None:
            return [f"lateral victim {req_id} is gone after its preemption"]
        if request.num_computed_tokens:
            problems.append(
                f"lateral victim {req_id} keeps {request.num_computed_tokens} "
                "computed tokens"
            )
        if request.status.name not in ADMITTING:
            problems.append(f"lateral victim {req_id} is {request.status.name}")
        held = _blocks_of(scheduler, req_id)
        if held:
            problems.append(f"lateral victim {req_id} still holds {len(held)} blocks")
        if _in_reservation(scheduler, request):
            problems.append(f"lateral victim {req_id} still reserves blocks")
        entry = scheduler.wedge_guard.ledger.get(req_id)
        if entry is not None and (
            entry.recv is not RecvState.NONE
            or entry.num_blocks
            or entry.computed_tokens
        ):
            problems.append(
                f"the ledger was not told of {req_id}'s lateral preemption "
                f"(recv={entry.recv.value}, blocks={entry.num_blocks}, "
                f"computed={entry.computed_tokens})"
            )
        counted = scheduler.wedge_guard.stats.total_lateral_preemptions
        expected = self._laterals_at_start + len(self.stats.laterals) + 1
        if counted != expected:
            problems.append(f"lateral preemptions counted {counted}, made {expected}")
        return problems

    # ---- vLLM's own allocations, under the valve ----------------------------------
    def _probe_allocations(self) -> None:
        """See every call of vLLM's own ``allocate_slots``, under the valve.

        The manager's class is swapped for a subclass whose
        ``allocate_slots`` reports to the checker before and after vLLM's:
        the valve calls the method of the manager's class when it allocates,
        so its allocations are the probed ones too.
        """
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        checker = self
        base = type(manager)

        class Probed(base):  # type: ignore[misc, valid-type]
            def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
                checker._before_allocation(request, args, kwargs)
                blocks = super().allocate_slots(request, *args, **kwargs)
                checker._after_allocation(request, blocks)
                return blocks

        Probed.__name__ = Probed.__qualname__ = base.__name__
        manager.__class__ = Probed

    def _before_allocation(
        self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if request.status.name not in ADMITTING:
            return
        if "reserved_blocks" in kwargs:
            expected = (
                self._fresh_reservation() if kwargs.get("delay_cache_blocks") else 0
            )
            got = kwargs["reserved_blocks"]
            if got != expected:
                self._raise_if(
                    RESERVATION,
                    [
                        f"{request.request_id} admitted against {got} reserved "
                        f"blocks; a fresh computation gives {expected} (policy "
                        f"{self.scheduler.wedge_guard.config.policy.value})"
                    ],
                )
        cached = self._victim_cache.get(request.request_id)
        if cached is not None:
            hit = kwargs.get("num_new_computed_tokens", args[1] if len(args) > 1 else 0)
            self._raise_if(
                PREFIX, _prefix_problems(self.scheduler, request, cached, hit)
            )

    def _after_allocation(self, request: Any, blocks: Any) -> None:
        if request.status.name not in ADMITTING:
            return
        self._last_admission = (request.request_id, blocks is None)
        if blocks is not None:
            self._victim_cache.pop(request.request_id, None)

    def _fresh_reservation(self) -> int:
        """The async-load reservation, computed now from vLLM's own method."""
        from vllm.v1.core.sched.scheduler import Scheduler

        scheduler = self.scheduler
        base = 0
        if scheduler.wedge_guard.config.policy.reserves:
            base = int(Scheduler._inflight_prefill_reserved_blocks(scheduler))
        return base + int(_access(scheduler).reservation_extras())

    def _watch_routing(self) -> None:
        """ROUTING: each child is asked only for requests it may load."""
        from vllm_mooncake.guard.routing import claim_keys_of

        children = list(getattr(self.scheduler.connector, "_connectors", ()))
        claims = [claim_keys_of(c) for c in children]
        for i, child in enumerate(children):
            lookup = child.get_num_new_matched_tokens

            def asked(
                request: Any, num_computed_tokens: int, *args: Any,
                _i: int = i, _lookup: Any = lookup, **kwargs: Any,
            ) -> Any:  # fmt: skip
                params = request.kv_transfer_params or {}
                present = {k for k, v in params.items() if v is not None}
                owners = [j for j, keys in enumerate(claims) if keys & present]
                if owners and _i not in owners:
                    self._raise_if(
                        ROUTING,
                        [
                            f"{request.request_id} carries the params of child "
                            f"{owners[0]} but child {_i} was asked to load it"
                        ],
                    )
                return _lookup(request, num_computed_tokens, *args, **kwargs)

            child.get_num_new_matched_tokens = asked

    def _watch_worker_input(self) -> None:
        previous = self.driver.on_scheduled

        def on_scheduled(so: SchedulerOutput) -> None:
            self._check_budget()
            self._check_alarm(so)
            for new in so.scheduled_new_reqs:
                self.seen_as_new.add(new.req_id)
            self._raise_if(RESUMED, resumed_problems(so, self.seen_as_new))
            # Before the worker writes this step: receives still landing
            # must still own their blocks (vLLM may assert later in the step).
            self._raise_if(
                IN_FLIGHT, in_flight_problems(self.scheduler, self.driver.worker)
            )
            for req_id in so.finished_req_ids:
                self.seen_as_new.discard(req_id)
            if previous is not None:
                previous(so)

        self.driver.on_scheduled = on_scheduled

    def _watch_aborts(self) -> None:
        """NOTICES: requests aborted while vLLM waited on their receive."""
        from vllm.v1.request import RequestStatus

        scheduler = self.scheduler
        finish = scheduler.finish_requests

        def finish_requests(request_ids: Any, status: Any) -> Any:
            ids = [request_ids] if isinstance(request_ids, str) else request_ids
            ids = list(scheduler.requests if ids is None else ids)
            for req_id in ids:
                request = scheduler.requests.get(req_id)
                if (
                    request is not None
                    and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                    and req_id not in scheduler.finished_recving_kv_req_ids
                ):
                    self.aborted_mid_recv.add(req_id)
            return finish(ids, status)

        scheduler.finish_requests = finish_requests

    def _check_budget(self) -> None:
        """LATERAL: ``attempts_exhausted`` moves only once the budget is spent."""
        stats = self.scheduler.wedge_guard.stats
        if stats.attempts_exhausted == self._exhausted_seen:
            return
        self._exhausted_seen = stats.attempts_exhausted
        done = self._laterals_this_call()
        budget = self.scheduler.wedge_guard.config.max_attempts
        if done != budget:
            self._raise_if(
                LATERAL,
                [
                    f"attempts exhausted after {done} lateral preemption(s) in "
                    f"this schedule() call, max_attempts={budget}"
                ],
            )

    def _check_alarm(self, so: SchedulerOutput) -> None:
        """ALARM: once per stall of ``stall_alarm_steps`` steps, re-armed after."""
        scheduler = self.scheduler
        side = scheduler.wedge_guard
        views = self._holders
        stalled = (
            so.total_num_scheduled_tokens == 0
            and not scheduler.running
            and bool(views)
            and not any(
                v.status is WaitStatus.WAITING_FOR_REMOTE_KVS and not v.recv_finished
                for v in views
            )
        )
        self._alarm_streak = self._alarm_streak + 1 if stalled else 0
        if self._alarm_streak >= side.config.stall_alarm_steps and self._alarm_armed:
            self._alarms_expected += 1
            self._alarm_armed = False
        elif not stalled:
            self._alarm_armed = True
        raised = side.stats.wedges_detected - self._alarms_at_start
        if raised != self._alarms_expected:
            self._raise_if(
                ALARM,
                [
                    f"{raised} wedge alarm(s) raised, {self._alarms_expected} "
                    f"expected (stall of {self._alarm_streak} step(s) now, "
                    f"stall_alarm_steps={side.config.stall_alarm_steps})"
                ],
            )

    # ---- per step ------------------------------------------------------------------
    def after_step(self, result: StepResult) -> None:
        self.stats.steps += 1
        scheduler, worker = self.scheduler, self.driver.worker
        self._raise_if(BLOCKS, block_problems(scheduler))
        self._raise_if(IN_FLIGHT, in_flight_problems(scheduler, worker))
        self._raise_if(LEDGER, ledger_problems(scheduler, worker, self.seen_as_new))
        self._track_stall(result)
        if self._victim_cache:
            for req_id in list(self._victim_cache):
                request = scheduler.requests.get(req_id)
                if request is None or request.is_finished():
                    del self._victim_cache[req_id]

    def _track_stall(self, result: StepResult) -> None:
        idle = result.num_scheduled_tokens == 0 and not self.scheduler.running
        self._stall = self._stall + 1 if idle else 0
        stuck = idle and self._blocked_with_candidate
        self._blocked_with_candidate = False
        self._candidate_stall = self._candidate_stall + 1 if stuck else 0
        self.stats.longest_stall = max(self.stats.longest_stall, self._stall)
        self.stats.longest_candidate_stall = max(
            self.stats.longest_candidate_stall, self._candidate_stall
        )
        if self.stall_bound is not None and self._candidate_stall > self.stall_bound:
            self._raise_if(
                STALL,
                [
                    f"{self._candidate_stall} zero-token steps with nothing running "
                    "in which an admission failed while the ledger offered a "
                    f"victim (candidates now: {lateral_candidates(self.scheduler)}; "
                    f"bound {self.stall_bound})"
                ],
            )

    def at_end(self, allowed: Mapping[str, frozenset[str]]) -> None:
        self._raise_if(ENDS, end_problems(self.driver, allowed))

    def _raise_if(self, invariant: str, problems: list[str]) -> None:
        if problems and invariant not in self.skip:
            raise InvariantViolation(invariant, self.driver.num_steps, problems)
