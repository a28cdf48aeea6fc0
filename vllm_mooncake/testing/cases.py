"""Generated runs of the guarded scheduler, for property tests and long runs.

A :class:`Case` is everything one run needs: the rank (pool size down to
barely one request, chunk size, FCFS or priority, full-ISL check on or off,
async scheduling), the guard (policy, ``max_attempts``, idle gate), the
``kv_load_failure_policy``, the requests (arrival step, prompt and output
lengths, priority, a shared prompt prefix, and a scripted load through the
store child or the P->D child: tokens, delay, ok / fail / partial, retries,
deferred lookups, sync or async) and the wedge alarm's threshold, and
the faults (aborts at a step, aborts of
a lateral victim or admission target, aborts in the middle of a stall,
duplicate / late / unknown receive notices).

:func:`draw_case` describes the space once, over a :class:`Draw` (a
``random.Random`` for long runs, Hypothesis in the tests, which then
shrinks a failure to a small case). :func:`run_case` plays a case on vLLM's
real scheduler through :class:`SchedulerDriver` with the guard connector
(strict ledger) and checks every invariant of
:mod:`vllm_mooncake.testing.invariants` after every step. Cases are plain
data: ``Case.to_json`` / ``Case.from_json`` replay one exactly.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from vllm_mooncake.testing.configs import PD_KEY, STORE_KEY, guarded
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver
from vllm_mooncake.testing.invariants import (
    NORMAL_ENDS,
    InvariantChecker,
    lateral_candidates,
)
from vllm_mooncake.testing.scripted_connector import (
    ScriptedLoadMetadata,
    iter_metadata,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

T = TypeVar("T")
BLOCK = 16
LATERAL_POLICIES = ("reserve+lateral", "lateral")
NOTICE_KINDS = ("duplicate", "late", "unknown")
FAULT_KINDS = ("abort", "notice", "abort_victim", "abort_target", "abort_on_stall")


# ---- the case model -------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """A scripted load (see ``scripted_connector.LoadScript``)."""

    child: str  # "store" (prefix-cache store child) | "pd" (P->D child)
    tokens: int  # -1: the whole prompt
    done_after: int
    outcome: str = "ok"  # "ok" | "fail" | "partial"
    valid_tokens: int = 0
    failing_attempts: int = -1
    reoffer: bool = False
    defer_lookups: int = 0
    is_async: bool = True
    raise_in: str = ""  # a buggy child: "lookup" | "alloc" | "finished"

    def params(self) -> dict[str, Any]:
        key = STORE_KEY if self.child == "store" else PD_KEY
        return {
            key: {
                "tokens": self.tokens,
                "async": self.is_async,
                "done_after": self.done_after,
                "outcome": self.outcome,
                "valid_tokens": self.valid_tokens,
                "failing_attempts": self.failing_attempts,
                "reoffer": self.reoffer,
                "defer_lookups": self.defer_lookups,
                "raise_in": self.raise_in,
            }
        }

    @property
    def may_fail(self) -> bool:
        """Its load may fail: scripted so, or its child raises starting it."""
        scripted = self.outcome != "ok" and self.failing_attempts != 0
        return scripted or self.raise_in == "alloc"


@dataclass(frozen=True)
class Req:
    req_id: str
    arrival: int
    prompt_len: int
    max_tokens: int
    priority: int = 0
    prefix_blocks: int = 0  # blocks of a prompt prefix every such request shares
    load: Load | None = None

    @property
    def blocks_needed(self) -> int:
        return math.ceil((self.prompt_len + self.max_tokens) / BLOCK)


@dataclass(frozen=True)
class Fault:
    """A fault injected during the run.

    ``abort``          abort ``req_id`` before step ``at`` (if it is live).
    ``notice``         before step ``at``, report receives that are not in
                       flight as finished (``notice``: ``duplicate`` -- ones
                       that completed already, ``late`` -- of finished
                       requests, ``unknown`` -- of no request), also as
                       failed if ``failed``.
    ``abort_victim``   ``delay`` steps after the ``at``-th lateral preemption
    ``abort_target``   (0-based), abort its victim / the request it admitted.
    ``abort_on_stall`` at the ``at``-th idle step with block holders waiting
                       (a wedge forming), abort the head holder
                       (``who="head"``) or a lateral candidate.
    """

    kind: str
    at: int
    req_id: str = ""
    notice: str = "duplicate"
    failed: bool = False
    delay: int = 0
    who: str = "head"


@dataclass(frozen=True)
class Case:
    policy: str
    requests: tuple[Req, ...]
    num_blocks: int  # usable blocks (the pool has one more: the null block)
    faults: tuple[Fault, ...] = ()
    sched_policy: str = "fcfs"
    reserve_full_isl: bool = True
    failure_policy: str = "fail"
    async_scheduling: bool = False
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    max_attempts: int = 16
    only_when_idle: bool = True
    # Low values make the wedge alarm fire (and re-arm) within a run.
    stall_alarm_steps: int = 2000

    @property
    def lateral(self) -> bool:
        return self.policy in LATERAL_POLICIES

    def shape(self) -> EngineShape:
        return EngineShape(
            num_blocks=self.num_blocks + 1,
            block_size=BLOCK,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            policy="priority" if self.sched_policy == "priority" else "fcfs",
            reserve_full_isl=self.reserve_full_isl,
            async_scheduling=self.async_scheduling,
        )

    def kv_transfer_config(self) -> dict[str, Any]:
        return guarded(
            self.policy,
            kv_load_failure_policy=self.failure_policy,
            max_attempts=self.max_attempts,
            only_when_idle=self.only_when_idle,
            stall_alarm_steps=self.stall_alarm_steps,
        )

    def step_bound(self) -> int:
        """Steps within which every request must have ended (generous)."""
        work = 0
        for r in self.requests:
            chunks = math.ceil(r.prompt_len / self.max_num_batched_tokens)
            work += chunks + r.max_tokens + 4
            if r.load is not None:
                attempts = 1 + max(r.load.failing_attempts, 0)
                work += (r.load.done_after + 2) * attempts + r.load.defer_lookups
        last = max((r.arrival for r in self.requests), default=0)
        return last + 20 + 4 * work

    def stall_bound(self) -> int:
        """Idle steps allowed in which an admission fails with a victim left.

        The valve preempts up to ``max_attempts`` victims per step, so the
        guard may need one step per ``max_attempts`` holders, plus one.
        """
        return math.ceil(len(self.requests) / self.max_attempts) + 1

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Case:
        raw = json.loads(text)
        requests = tuple(
            Req(**{**r, "load": Load(**r["load"]) if r["load"] else None})
            for r in raw.pop("requests")
        )
        faults = tuple(Fault(**f) for f in raw.pop("faults"))
        return cls(requests=requests, faults=faults, **raw)


# ---- drawing cases ---------------------------------------------------------------
class Draw(Protocol):
    """The choices a case is made of; the first option is the simplest."""

    def integer(self, lo: int, hi: int) -> int: ...

    def choice(self, options: Sequence[T], weights: Sequence[int] = ()) -> T: ...

    def chance(self, percent: int) -> bool: ...


class RandomDraw:
    """:class:`Draw` over ``random.Random`` (long runs; a seed replays a case)."""

    def __init__(self, seed: int | str) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T], weights: Sequence[int] = ()) -> T:
        return self.rng.choices(options, weights=weights or None)[0]

    def chance(self, percent: int) -> bool:
        return self.rng.randrange(100) < percent


class WeightedDraw:
    """:class:`Draw` over one integer source (Hypothesis' ``draw`` in tests).

    Every choice is an index drawn from ``integer``, so a shrinker that
    lowers integers moves towards the first (simplest) option and towards
    ``False``.
    """

    def __init__(self, integer: Callable[[int, int], int]) -> None:
        self._integer = integer

    def integer(self, lo: int, hi: int) -> int:
        return self._integer(lo, hi)

    def choice(self, options: Sequence[T], weights: Sequence[int] = ()) -> T:
        weights = weights or [1] * len(options)
        pick = self.integer(0, sum(weights) - 1)
        for option, weight in zip(options, weights, strict=True):
            if pick < weight:
                return option
            pick -= weight
        raise AssertionError("unreachable")

    def chance(self, percent: int) -> bool:
        return self.integer(0, 99) >= 100 - percent


def draw_load(
    d: Draw, prompt_len: int, async_scheduling: bool, burst: bool = False
) -> Load | None:
    kind = d.choice(("none", "pd", "store"), (0 if burst else 20, 40, 40))
    if kind == "none" or (kind == "store" and prompt_len < 2):
        return None
    outcome = d.choice(
        ("ok", "fail", "partial"), (80, 10, 10) if burst else (60, 20, 20)
    )
    done_after = d.integer(0, 4)
    raise_in = draw_raise_in(d)
    if kind == "pd":  # NIXL-like: the whole prompt, once
        tokens = d.integer(1, prompt_len) if d.chance(20) else -1
        span = prompt_len if tokens < 0 else tokens
        return Load(
            child="pd",
            tokens=tokens,
            done_after=done_after,
            outcome=outcome,
            valid_tokens=d.integer(0, span) if outcome == "partial" else 0,
            failing_attempts=d.choice((-1, 0, 1)) if outcome != "ok" else -1,
            raise_in=raise_in,
        )
    # A store never offers the last prompt token (vLLM must compute one):
    # offered, a fully hit request would look new after its load and reload
    # forever.
    tokens = d.integer(1, prompt_len - 1)
    is_async = burst or not d.chance(10)
    if not is_async and async_scheduling:
        # vLLM's stock MultiConnector stalls a request whose *synchronous*
        # load fails under async scheduling (with or without the guard; see
        # bench/RESULTS.md), so a sync load there always succeeds.
        outcome = "ok"
        raise_in = "" if raise_in == "alloc" else raise_in
    reoffer = not d.chance(20)
    # A re-offered hit that always fails would reload forever: bound it.
    failing = d.integer(0, 2) if reoffer else d.choice((-1, 0, 1))
    return Load(
        child="store",
        tokens=tokens,
        done_after=done_after if is_async else 0,
        outcome=outcome,
        valid_tokens=d.integer(0, tokens) if outcome == "partial" else 0,
        failing_attempts=failing if outcome != "ok" else -1,
        reoffer=reoffer,
        defer_lookups=d.integer(1, 2) if d.chance(15) else 0,
        is_async=is_async,
        raise_in=raise_in,
    )


def draw_raise_in(d: Draw) -> str:
    """Now and then a child connector that raises in a per-request hook."""
    if not d.chance(6):
        return ""
    return d.choice(("lookup", "alloc", "finished"))


def draw_request(
    d: Draw, index: int, async_scheduling: bool = False, burst: bool = False
) -> Req:
    """``burst``: arrivals in the first two steps, nearly all with async loads
    (the layouts where holders pile up and wedges form)."""
    prompt_blocks = d.integer(1, 12)
    prompt_len = max(1, prompt_blocks * BLOCK - d.integer(0, BLOCK - 1))
    late = not burst and d.chance(25)
    return Req(
        req_id=f"r{index}",
        arrival=d.integer(0, 8) if late else d.integer(0, 1 if burst else 2),
        prompt_len=prompt_len,
        max_tokens=d.integer(1, 8),
        priority=d.integer(0, 2),
        prefix_blocks=d.integer(1, prompt_blocks) if d.chance(20) else 0,
        load=draw_load(d, prompt_len, async_scheduling, burst),
    )


def draw_fault(d: Draw, num_requests: int, horizon: int) -> Fault:
    kind = d.choice(FAULT_KINDS, (25, 25, 15, 15, 20))
    if kind == "abort":
        return Fault(
            kind, d.integer(0, horizon), req_id=f"r{d.integer(0, num_requests - 1)}"
        )
    if kind == "notice":
        return Fault(
            kind,
            d.integer(0, horizon),
            notice=d.choice(NOTICE_KINDS),
            failed=d.chance(30),
        )
    if kind == "abort_on_stall":
        return Fault(kind, d.integer(0, 3), who=d.choice(("head", "candidate")))
    return Fault(kind, d.integer(0, 2), delay=d.integer(0, 2))


POLICY_WEIGHTS = {"reserve+lateral": 45, "lateral": 45, "reserve": 10}


def draw_case(
    d: Draw,
    max_requests: int = 6,
    policies: Sequence[str] = tuple(POLICY_WEIGHTS),
    burst: bool | None = None,
) -> Case:
    """A case; ``policies`` limits the guard policies, ``burst`` forces (or
    forbids) the wedge-prone layout (default: either, half the time)."""
    policy = d.choice(policies, [POLICY_WEIGHTS[p] for p in policies])
    async_scheduling = d.chance(30)
    burst = d.chance(50) if burst is None else burst
    requests = tuple(
        draw_request(d, i, async_scheduling, burst)
        for i in range(d.integer(1, max_requests))
    )
    need = max(r.blocks_needed for r in requests)
    total = sum(r.blocks_needed for r in requests)
    room = d.choice(
        ("barely", "tight", "ample"), (50, 50, 0) if burst else (35, 45, 20)
    )
    extra = {
        "barely": 0,
        "tight": d.integer(1, max(1, need // (4 if burst else 1))),
        "ample": d.integer(need, max(need, total)),
    }[room]
    horizon = max(r.arrival for r in requests) + 15
    faults = tuple(
        draw_fault(d, len(requests), horizon) for _ in range(d.integer(0, 4))
    )
    return Case(
        policy=policy,
        requests=requests,
        num_blocks=need + extra,
        faults=faults,
        sched_policy=d.choice(("fcfs", "priority")),
        reserve_full_isl=not d.chance(40),
        failure_policy=d.choice(("fail", "recompute")),
        async_scheduling=async_scheduling,
        max_num_batched_tokens=d.choice((2048, 256, 64)),
        max_num_seqs=d.choice((16, 4, 2), (100, 0, 0) if burst else (70, 20, 10)),
        max_attempts=d.choice((16, 1, 2), (60, 25, 15)),
        only_when_idle=not d.chance(15),
        stall_alarm_steps=d.choice((2000, 1, 3), (40, 40, 20)),
    )


# ---- running a case ------------------------------------------------------------
@dataclass
class CaseResult:
    """What a run did (for coverage counts); invariants raise, not report."""

    steps: int = 0
    laterals: int = 0
    aborted: set[str] = field(default_factory=set)
    notices_injected: int = 0
    wedged: bool = False  # a valve-less policy stalled until aborted
    errored: int = 0
    longest_stall: int = 0
    longest_candidate_stall: int = 0
    mid_wedge_aborts: int = 0
    # tokens scheduled per request over the run (a reload or recompute shows)
    scheduled_tokens: Counter[str] = field(default_factory=Counter)


_SHARED_PREFIX = random.Random("shared-prefix")
PREFIX_TOKENS = [_SHARED_PREFIX.randrange(3, 1000) for _ in range(12 * BLOCK)]


class CaseRunner:
    """Plays one :class:`Case` and checks the invariants after every step."""

    def __init__(self, case: Case, driver: SchedulerDriver | None = None) -> None:
        self.case = case
        self.driver = driver or SchedulerDriver.build(
            case.shape(), case.kv_transfer_config()
        )
        self.driver.keep_steps = False
        self.checker = InvariantChecker(
            self.driver, stall_bound=case.stall_bound() if case.lateral else None
        )
        self.result = CaseResult()
        self._completed: set[str] = set()  # receives reported (and accepted)
        self._idle_with_holders = 0  # idle steps with holders so far
        self._reactive: list[tuple[int, str]] = []  # (step, req_id) to abort
        # Notices to inject this step; see _drop_notices_for_new_loads.
        self._injecting: tuple[set[str], set[str]] = (set(), set())
        self._watch_new_loads()

    # ---- faults --------------------------------------------------------------------
    def _live(self, req_id: str) -> bool:
        request = self.driver.scheduler.requests.get(req_id)
        return request is not None and not request.is_finished()

    def _abort(self, req_id: str, mid_wedge: bool = False) -> None:
        if self._live(req_id):
            self.driver.abort(req_id)
            self.result.aborted.add(req_id)
            self.result.mid_wedge_aborts += int(mid_wedge)

    def _notices(self, step: int) -> tuple[set[str], set[str]]:
        finished: set[str] = set()
        failed: set[str] = set()
        receiving = self.driver.worker.in_flight
        for fault in self.case.faults:
            if fault.kind != "notice" or fault.at != step:
                continue
            if fault.notice == "duplicate":
                ids = self._completed - receiving
            elif fault.notice == "late":
                ids = set(self.driver.finished) - receiving
            else:
                ids = {f"ghost-{step}"}
            finished |= ids
            if fault.failed:
                failed |= ids
        self.result.notices_injected += len(finished)
        return finished, failed

    def _watch_new_loads(self) -> None:
        """Never inject a notice for a request whose new receive starts now.

        The guard cannot tell a stale notice from the completion of a receive
        that started in the same step (a notice carries no load generation),
        so such a notice is not a fault it can be asked to survive.
        """
        previous = self.driver.on_scheduled

        def on_scheduled(so: SchedulerOutput) -> None:
            if previous is not None:
                previous(so)
            starting = {
                req_id
                for meta in iter_metadata(so.kv_connector_metadata)
                if isinstance(meta, ScriptedLoadMetadata)
                for req_id in meta.loads
            }
            for ids in self._injecting:
                ids -= starting

        self.driver.on_scheduled = on_scheduled

    def _before_step(self, step: int) -> tuple[set[str], set[str]]:
        for fault in self.case.faults:
            if fault.kind == "abort" and fault.at == step:
                self._abort(fault.req_id)
        for _, req_id in [r for r in self._reactive if r[0] == step]:
            self._abort(req_id, mid_wedge=True)
        return self._notices(step)

    def _after_step(self, step: int) -> None:
        laterals = self.checker.stats.laterals
        for fault in self.case.faults:
            if fault.kind in ("abort_victim", "abort_target") and fault.at < len(
                laterals
            ):
                record = laterals[fault.at]
                if record.step == self.driver.num_steps - 1:
                    who = (
                        record.victim if fault.kind == "abort_victim" else record.target
                    )
                    self._reactive.append((step + 1 + fault.delay, who))
        scheduler = self.driver.scheduler
        idle = not scheduler.running and bool(scheduler.guard_holders.views())
        if not idle:
            return
        for fault in self.case.faults:
            if fault.kind == "abort_on_stall" and fault.at == self._idle_with_holders:
                self._abort_in_stall(fault.who)
        self._idle_with_holders += 1

    def _abort_in_stall(self, who: str) -> None:
        scheduler = self.driver.scheduler
        if who == "candidate":
            candidates = lateral_candidates(scheduler)
            if candidates:
                self._abort(candidates[0], mid_wedge=True)
            return
        views = scheduler.guard_holders.views()
        if views:
            self._abort(views[0].req_id, mid_wedge=True)

    # ---- the run ---------------------------------------------------------------------
    def _add(self, req: Req) -> None:
        prefix = PREFIX_TOKENS[: req.prefix_blocks * BLOCK][: req.prompt_len]
        self.driver.add(
            req.req_id,
            req.prompt_len,
            max_tokens=req.max_tokens,
            priority=req.priority,
            kv_transfer_params=req.load.params() if req.load else None,
            prefix=prefix,
        )

    def _done(self, pending: list[Req]) -> bool:
        d = self.driver
        return not pending and not d.scheduler.requests and not d.worker.in_flight

    def _play(self, pending: list[Req], steps: int, start: int) -> int:
        step = start
        for step in range(start, start + steps):
            while pending and pending[0].arrival <= step:
                self._add(pending.pop(0))
            finished, failed = self._before_step(step)
            if self._done(pending):
                return step
            self._injecting = (finished, failed)
            result = self.driver.step(finished_recving=finished, failed_recving=failed)
            self._completed |= set(result.kv_connector_output.finished_recving or ())
            self.result.scheduled_tokens.update(
                result.scheduler_output.num_scheduled_tokens
            )
            self.checker.after_step(result)
            self._after_step(step)
        return step + 1

    def run(self) -> CaseResult:
        case = self.case
        pending = sorted(case.requests, key=lambda r: r.arrival)
        step = self._play(pending, case.step_bound(), 0)
        if not self._done(pending) and not case.lateral:
            # No valve: a wedge is upstream's behaviour. Abort what is left,
            # as a router timeout would, and check that it all drains.
            self.result.wedged = True
            for req_id in list(self.driver.scheduler.requests):
                self._abort(req_id)
            step = self._play(pending, case.step_bound(), step)
        self.checker.at_end(self._allowed_ends())
        stats = self.checker.stats
        self.result.steps = stats.steps
        self.result.laterals = len(stats.laterals)
        self.result.longest_stall = stats.longest_stall
        self.result.longest_candidate_stall = stats.longest_candidate_stall
        self.result.errored = sum(
            1 for r in self.driver.finished.values() if r == "error"
        )
        return self.result

    def _allowed_ends(self) -> dict[str, frozenset[str]]:
        """Reasons each request may end with.

        ``error`` only under ``kv_load_failure_policy=fail``, for a request
        whose own load may fail -- or that shares a prompt prefix with one
        (vLLM fails every request whose computed blocks include a block a
        failed load reported invalid: their KV came from it).
        """
        fail = self.case.failure_policy == "fail"
        shared_failing = any(
            r.prefix_blocks and r.load and r.load.may_fail for r in self.case.requests
        )
        allowed = {}
        for req in self.case.requests:
            reasons = set(NORMAL_ENDS)
            if req.req_id in self.result.aborted:
                reasons.add("abort")
            own = bool(req.load and req.load.may_fail)
            if fail and (own or (req.prefix_blocks and shared_failing)):
                reasons.add("error")
            allowed[req.req_id] = frozenset(reasons)
        return allowed


def run_case(case: Case) -> CaseResult:
    """Play ``case``; raise :class:`InvariantViolation` at the first break."""
    return CaseRunner(case).run()
