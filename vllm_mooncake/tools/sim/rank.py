"""One simulated engine: vLLM's real scheduler behind the guard connector.

A :class:`Rank` is a :class:`~vllm_mooncake.testing.driver.SchedulerDriver`
(vLLM 0.32's ``Scheduler`` / ``KVCacheManager``, the fake worker) whose
``kv_transfer_config`` is the guard connector over the two scripted children
(``store_load``: a Mooncake-store-like prefix loader; ``pd_load``: a
NIXL-like P->D transfer), plus a simulated clock.

One :meth:`Rank.step` at the rank's clock:

1. ``schedule()`` -- real admission, promotion, lateral preemption;
2. the step is priced by the cost model, which sets the worker's window
   ``[start, start + cost]`` (so timed receives land in the right step);
3. the fake worker reports tokens, landed receives and the sends the
   cluster released (``finished_sending``: a decode rank pulled, or the
   lease ran out);
4. ``update_from_output()``; the clock moves to the end of the step -- or,
   when the only work left is receives in flight, to when the next one lands.

The rank never decides where requests go; :mod:`.cluster` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_mooncake.guard.observer import GuardObserver
from vllm_mooncake.testing.configs import guarded
from vllm_mooncake.testing.driver import (
    EngineShape,
    SchedulerDriver,
    make_scheduler,
    make_vllm_config,
)
from vllm_mooncake.tools.sim.cost import CostModel
from vllm_mooncake.tools.sim.scenario import EngineSpec, GuardSpec
from vllm_mooncake.tools.sim.stalls import StallTracker

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from vllm_mooncake.guard.ledger import Victim
    from vllm_mooncake.guard.stats import GuardStats

ReqId = str


@dataclass
class RankStep:
    """What one step of one rank did, in simulated time."""

    start_s: float
    end_s: float
    tokens: int  # scheduled tokens (prefill and decode)
    seqs: int  # scheduled requests
    output_tokens: int = 0  # tokens sampled
    first_tokens: list[ReqId] = field(default_factory=list)
    finished: list[tuple[ReqId, str]] = field(default_factory=list)
    recv_done: list[ReqId] = field(default_factory=list)  # receives that landed
    preempted: int = 0
    blocked: bool = False
    free_blocks: int = 0


def engine_shape(spec: EngineSpec) -> EngineShape:
    return EngineShape(
        num_blocks=spec.num_blocks,
        block_size=spec.block_size,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
        policy="priority" if spec.policy == "priority" else "fcfs",
        reserve_full_isl=spec.scheduler_reserve_full_isl,
        enable_prefix_caching=spec.enable_prefix_caching,
        async_scheduling=spec.async_scheduling,
    )


class _Laterals(GuardObserver):
    """The lateral preemptions of the last ``schedule()`` call, from the
    guard's observer seam (taken by :meth:`Rank._price`)."""

    def __init__(self) -> None:
        self.made: list[tuple[Victim, str]] = []

    def after_lateral(self, victim: Victim, target: Request) -> None:
        self.made.append((victim, target.request_id))


def build_driver(spec: EngineSpec, guard: GuardSpec) -> SchedulerDriver:
    """A driver whose scheduler is the guarded one, as vLLM would pick it."""
    kv_config = guarded(
        guard.policy,
        kv_load_failure_policy=spec.kv_load_failure_policy,
        **guard.section(),
    )
    vllm_config = make_vllm_config(engine_shape(spec), kv_config)
    return SchedulerDriver(make_scheduler(vllm_config), keep_steps=False)


class Rank:
    """A vLLM engine with a clock; see the module docstring for one step."""

    def __init__(
        self,
        name: str,
        role: str,
        spec: EngineSpec,
        guard: GuardSpec,
        cost: CostModel,
        wedge_steps: int,
        livelock_loads: int = 20,
    ) -> None:
        self.name = name
        self.role = role  # "prefill" | "decode" | "single"
        self.spec = spec
        self.cost = cost
        self.driver = build_driver(spec, guard)
        self.driver.on_scheduled = self._price
        self._laterals = _Laterals()
        self.scheduler.add_guard_observer(self._laterals)
        self.clock = 0.0  # when the next step starts
        self.last_end = 0.0  # when the last step ended
        self.stalls = StallTracker(wedge_steps)
        # Producer side: finished requests whose blocks wait for a pull.
        self.held: set[ReqId] = set()
        self._sends: list[ReqId] = []  # released, reported next step
        self._emitted: set[ReqId] = set()  # requests that sampled a token here
        self._unfinished_at_schedule = 0
        self._window = (0.0, 0.0)
        self.busy_s = 0.0  # simulated seconds of steps that scheduled tokens
        # Loads started per request since its last token; a request that
        # reaches livelock_loads loops on its load (a livelock).
        self.livelock_loads = livelock_loads
        self._loads_since_token: dict[ReqId, int] = {}
        self._loads_seen = 0
        self.livelocked: dict[ReqId, int] = {}  # request -> loads, in order
        # Every lateral preemption: {rank, step, t_s, victim, target, reason,
        # owner}, in order.
        self.laterals: list[dict[str, Any]] = []
        # Aborted requests vLLM still keeps: until their receive lands, and
        # (producer side, delay_free) until their send is reported done.
        self._aborted: set[ReqId] = set()
        self._abort_released: set[ReqId] = set()

    # ---- observations ----------------------------------------------------------
    @property
    def scheduler(self) -> Any:
        return self.driver.scheduler

    @property
    def guard_stats(self) -> GuardStats:
        stats: GuardStats = self.scheduler.wedge_guard.stats
        return stats

    @property
    def num_steps(self) -> int:
        return self.driver.num_steps

    @property
    def num_unfinished(self) -> int:
        return int(self.scheduler.get_num_unfinished_requests())

    @property
    def active(self) -> bool:
        """Whether stepping the rank can do anything."""
        if self._aborted:
            # An aborted request whose receive is in flight is freed when it
            # lands, which takes steps.
            self._aborted &= self.scheduler.requests.keys()
            self._abort_released &= self._aborted
        return bool(self.num_unfinished or self._sends or self._aborted)

    @property
    def load(self) -> int:
        """Requests queued or running here (for the least-loaded router)."""
        return self.num_unfinished

    # ---- inputs --------------------------------------------------------------------
    def add(
        self,
        req_id: ReqId,
        prompt_tokens: int,
        max_tokens: int,
        priority: int,
        params: dict[str, Any] | None,
        at: float,
    ) -> None:
        """A request arrives at simulated time ``at``."""
        self.wake(at)
        self.driver.add(
            req_id,
            prompt_tokens,
            max_tokens=max_tokens,
            priority=priority,
            kv_transfer_params=params,
            arrival_time=at,  # vLLM orders equal priorities by it
        )

    def abort(self, req_id: ReqId, at: float) -> bool:
        """Abort a live request here (vLLM's ``finish_requests``, ABORTED)."""
        request = self.scheduler.requests.get(req_id)
        if request is None or request.is_finished():
            return False
        self.wake(at)
        self.driver.abort(req_id)
        self._emitted.discard(req_id)
        self._loads_since_token.pop(req_id, None)
        if req_id in self.scheduler.requests:
            self._aborted.add(req_id)
        return True

    def _release_aborted(self) -> None:
        """An aborted producer-side request (``delay_free``) whose receive, if
        any, has landed: its send is reported done next step. The decode side
        will never pull it; NIXL's producer frees it after its abort timeout
        (here: at once)."""
        if not self._aborted:
            return
        in_flight = self.driver.worker.in_flight
        for req_id in sorted(self._aborted - self._abort_released - in_flight):
            if req_id in self.scheduler.requests:
                self._abort_released.add(req_id)
                self._sends.append(req_id)

    def release(self, req_id: ReqId, at: float) -> bool:
        """Free a held request's blocks in the next step (pull done / lease out)."""
        if req_id not in self.held:
            return False
        self.held.discard(req_id)
        if req_id in self.scheduler.requests:  # vLLM really delayed the free
            self._sends.append(req_id)
            self.wake(at)
        return True

    def wake(self, at: float) -> None:
        """Something arrives at ``at``: the rank may step then, not later."""
        if not self.active or self.clock > max(at, self.last_end):
            self.clock = max(at, self.last_end)

    # ---- one step -------------------------------------------------------------------
    def _price(self, so: SchedulerOutput) -> None:
        """Between schedule() and the worker: price the step, set the window."""
        tokens = int(so.total_num_scheduled_tokens)
        cost = self.cost.step_seconds(tokens, len(so.num_scheduled_tokens))
        self._window = (self.clock, self.clock + cost)
        self.driver.worker.set_window(*self._window)
        self._unfinished_at_schedule = self.num_unfinished
        made, self._laterals.made = self._laterals.made, []
        for victim, target in made:
            self.laterals.append(
                {
                    "rank": self.name,
                    "step": self.driver.num_steps,
                    "t_s": round(self.clock, 6),
                    "victim": victim.req_id,
                    "target": target,
                    "reason": victim.reason.value,
                    "owner": victim.owner,
                }
            )

    def step(self) -> RankStep:
        sends, self._sends = self._sends, []
        result = self.driver.step(finished_sending=sends)
        so = result.scheduler_output
        start, end = self._window
        out = RankStep(
            start_s=start,
            end_s=end,
            tokens=result.num_scheduled_tokens,
            seqs=len(so.num_scheduled_tokens),
            preempted=len(so.preempted_req_ids or ()),
            recv_done=sorted(result.kv_connector_output.finished_recving or ()),
        )
        self._read_outputs(result.engine_outputs, out)
        self._observe_loads(result.engine_outputs)
        self._observe_stall(out)
        if out.tokens:
            self.busy_s += end - start
        self._release_aborted()
        self.last_end = end
        self.clock = self._next_start(out)
        out.free_blocks = self.driver.num_free_blocks
        return out

    def _read_outputs(self, engine_outputs: dict[int, Any], out: RankStep) -> None:
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                if o.new_token_ids:
                    out.output_tokens += len(o.new_token_ids)
                    if o.request_id not in self._emitted:
                        self._emitted.add(o.request_id)
                        out.first_tokens.append(o.request_id)
                if o.finish_reason is not None:
                    out.finished.append((o.request_id, str(o.finish_reason)))
                    self._emitted.discard(o.request_id)

    def _observe_loads(self, engine_outputs: dict[int, Any]) -> None:
        """Count loads per request since its last token; flag a livelock.

        Under ``kv_load_failure_policy: recompute`` a load that keeps
        failing is started again and again with no token in between: no
        stall (the rank is busy loading), but the request never progresses.
        """
        started = self.driver.worker.started
        counts = self._loads_since_token
        for req_id in started[self._loads_seen :]:
            counts[req_id] = counts.get(req_id, 0) + 1
            if counts[req_id] >= self.livelock_loads:
                self.livelocked.setdefault(req_id, counts[req_id])
        self._loads_seen = len(started)
        if counts:
            for outputs in engine_outputs.values():
                for o in outputs.outputs:
                    if o.new_token_ids or o.finish_reason is not None:
                        counts.pop(o.request_id, None)

    def _observe_stall(self, out: RankStep) -> None:
        in_flight = self.driver.worker.in_flight
        waiting_on_transfer = len(in_flight) + len(out.recv_done)
        out.blocked = (
            out.tokens == 0 and self._unfinished_at_schedule > waiting_on_transfer
        )
        resolvable = bool(in_flight or self.held or self._sends)
        self.stalls.observe(out.start_s, out.end_s, out.blocked, resolvable)

    def drain(self, max_steps: int) -> list[str]:
        """Abort what is left, release held blocks, step until idle; list leaks.

        The leak check of vLLM's ``assert_scheduler_empty`` plus the guard's
        ledger and the worker's receives, each finding prefixed by the rank.
        """
        from vllm_mooncake.testing.leaks import scheduler_leaks

        at = self.last_end
        for req_id in sorted(self.held):
            self.release(req_id, at)
        live = [
            r for r, req in self.scheduler.requests.items() if not req.is_finished()
        ]
        for req_id in live:
            self.abort(req_id, at)
        for _ in range(max_steps):
            if not (self.active or self.driver.worker.in_flight):
                break
            self.step()
        problems = scheduler_leaks(self.scheduler)
        ledger = self.scheduler.wedge_guard.ledger
        if len(ledger):
            problems.append(
                f"guard ledger not empty: {[e.req_id for e in ledger.entries()]}"
            )
        if self.driver.worker.in_flight:
            problems.append(
                f"receives still in flight: {sorted(self.driver.worker.in_flight)}"
            )
        return [f"{self.name}: {p}" for p in problems]

    def _next_start(self, out: RankStep) -> float:
        """End of the step; or, waiting only for receives, when the next lands."""
        if out.tokens or out.blocked or self._sends:
            return out.end_s
        deadline = self.driver.worker.next_deadline()
        if deadline is None:
            return out.end_s
        return max(out.end_s, deadline)
