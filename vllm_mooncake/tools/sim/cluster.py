"""The discrete-event PD simulation: ranks, a router, transfers and leases.

Life cycle of a disaggregated request (pd mode):

1. **arrive**   -- at the router at its arrival time (scripted, Poisson, or
   ``think_s`` after its closed-loop client's previous request completed);
   the router picks a prefill rank.
2. **prefill**  -- the prefill rank runs it with ``max_tokens=1`` (after an
   async store load, if it drew a hit). Its ``pd_load`` params carry
   ``delay_free``: when it finishes, vLLM keeps its blocks (NIXL's producer
   side).
3. **hand-off** -- ``pd.handoff_s`` later the router sends it to a decode
   rank with a full-prompt ``pd_load`` receive that lands ``done_after_s``
   (the drawn transfer latency) after the decode rank admits it.
4. **pull**     -- when that receive lands, the prefill rank is told
   (``finished_sending``) and frees the blocks; if ``pd.lease_s`` runs out
   first, it frees them then (counted in ``lease_expired``; the decode side
   still gets its KV -- a simplification).
5. **decode**   -- the decode rank promotes it, samples ``max_tokens``
   tokens; the first is the request's first token (TTFT), the last its
   completion (E2E). Its closed-loop client then sends the next request.

A scripted request may be aborted (``abort_at_s``, or in single mode
``abort_at_step``): every rank that holds it calls vLLM's real
``finish_requests`` with FINISHED_ABORTED (a prefill rank holding its blocks
for the pull releases them), and it completes with reason ``abort``.

A direct request (``pd_fraction`` < 1, ``route: direct``) skips 2-4: a
decode rank computes its prompt, after its store hit if any. In single mode
there is one rank and every request is added to it as scripted.

Time: events (arrivals, hand-offs, pulls, lease ends) sit in a heap; each
active rank has a clock (the start of its next step). The loop takes
whichever comes first -- events before steps at equal times -- so every rank
sees exactly what arrived before its step starts. A step's effects happen at
its end (its clock then moves there). The run stops when every request
completed, a rank wedged, or a limit was reached. Then every rank is drained
(what is left is aborted, held blocks released, the rank stepped idle) and
checked for leaks (:meth:`Rank.drain`); the findings go into the result's
``leaks``.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_mooncake.testing.configs import PD_KEY
from vllm_mooncake.tools.sim.cost import CostModel
from vllm_mooncake.tools.sim.errors import SimulationError
from vllm_mooncake.tools.sim.rank import Rank, RankStep
from vllm_mooncake.tools.sim.recorder import SUCCESS, Recorder
from vllm_mooncake.tools.sim.results import RunResult
from vllm_mooncake.tools.sim.scenario import Scenario
from vllm_mooncake.tools.sim.workload import SimRequest, Workload

# progress(now_s, completed, total, steps)
ProgressFn = Callable[[float, int, int, int], None]
# on_wedge(cluster, rank): ``rank`` just wedged. True lets the run go on (the
# callback changed something, e.g. opened the guard's valve; the rank's wedge
# count restarts), False stops it there as usual.
WedgeFn = Callable[["Cluster", Rank], bool]
PROGRESS_EVERY = 200  # steps between progress calls
DRAIN_STEPS = 10_000  # steps per rank to drain after the run


@dataclass(order=True)
class _Event:
    at: float
    seq: int
    # "arrive" | "handoff" | "pulled" | "lease" | "abort"
    kind: str = field(compare=False)
    req_id: str = field(compare=False)


@dataclass
class _Route:
    prefill: Rank | None = None
    decode: Rank | None = None


class Cluster:
    """Ranks of one scenario under one policy; :meth:`run` plays the workload."""

    def __init__(
        self,
        scenario: Scenario,
        workload: Workload,
        progress: ProgressFn | None = None,
        on_wedge: WedgeFn | None = None,
    ) -> None:
        self.scenario = scenario
        self.workload = workload
        self.progress = progress
        self.on_wedge = on_wedge
        self.requests = {r.req_id: r for r in workload.requests}
        self.prefill, self.decode = self._build_ranks()
        self.ranks = self.prefill + self.decode
        self.recorder = Recorder(total=len(workload.requests))
        self.routes: dict[str, _Route] = {}
        self.now = 0.0
        self._events: list[_Event] = []
        self._seq = itertools.count()
        self._next_closed = 0  # next closed-loop request to send
        self._step_arrivals = sorted(
            (r for r in workload.requests if r.arrival_step is not None),
            key=lambda r: (r.arrival_step or 0, r.index),
        )
        self._step_aborts = sorted(
            (r for r in workload.requests if r.abort_at_step is not None),
            key=lambda r: (r.abort_at_step or 0, r.index),
        )
        self.aborted: set[str] = set()

    # ---- set-up -------------------------------------------------------------------
    def _build_ranks(self) -> tuple[list[Rank], list[Rank]]:
        s = self.scenario
        cost = CostModel.from_spec(s.cost)
        wedge = s.limits.wedge_steps
        loop = s.limits.livelock_loads
        if s.mode == "single":
            return [], [Rank("rank0", "single", s.engine, s.guard, cost, wedge, loop)]
        prefill = [
            Rank(f"p{i}", "prefill", s.prefill_engine, s.guard, cost, wedge, loop)
            for i in range(s.ranks.prefill)
        ]
        decode = [
            Rank(f"d{i}", "decode", s.decode_engine, s.guard, cost, wedge, loop)
            for i in range(s.ranks.decode)
        ]
        return prefill, decode

    def _schedule_arrivals(self) -> None:
        if self.workload.closed_loop:
            for _ in range(min(self.workload.concurrency, len(self.requests))):
                self._send_next_closed(0.0)
            return
        for r in self.workload.requests:
            if r.arrival_s is not None:
                self._push(r.arrival_s, "arrive", r.req_id)
        for r in self.workload.requests:  # after the arrivals at equal times
            if r.abort_at_s is not None:
                self._push(r.abort_at_s, "abort", r.req_id)

    def _send_next_closed(self, at: float) -> None:
        if self._next_closed >= len(self.workload.requests):
            return
        request = self.workload.requests[self._next_closed]
        self._next_closed += 1
        self._push(at + request.think_s, "arrive", request.req_id)

    def _push(self, at: float, kind: str, req_id: str) -> None:
        heapq.heappush(self._events, _Event(at, next(self._seq), kind, req_id))

    # ---- the loop --------------------------------------------------------------------
    def run(self, header: dict[str, Any]) -> RunResult:
        start = time.perf_counter()
        self._schedule_arrivals()
        stop = self._loop()
        result = self.recorder.result(header, self.ranks, stop, self.now)
        result.leaks = self.drain()
        result.wall_seconds = round(time.perf_counter() - start, 3)
        return result

    def drain(self) -> list[str]:
        """Drain every rank after the run; the leaks found (empty: none)."""
        leaks: list[str] = []
        for rank in self.ranks:
            leaks += rank.drain(DRAIN_STEPS)
        return leaks

    def _loop(self) -> str:
        limits = self.scenario.limits
        steps = 0
        while True:
            if self.recorder.num_completed >= self.recorder.total:
                return "done"
            rank = self._next_rank()
            event = self._events[0] if self._events else None
            if event is None and rank is None:
                raise SimulationError(self._stuck_report())
            if event is not None and (rank is None or event.at <= rank.clock):
                if event.at > limits.max_sim_s:
                    return "max_sim_s"
                heapq.heappop(self._events)
                self.now = max(self.now, event.at)
                self._handle(event)
                continue
            assert rank is not None
            if rank.clock > limits.max_sim_s:
                return "max_sim_s"
            self.now = max(self.now, rank.clock)
            self._step(rank)
            steps += 1
            if rank.stalls.wedged and not self._resume_after_wedge(rank):
                self.now = max(self.now, rank.last_end)
                return "wedged"
            if rank.livelocked:
                self.now = max(self.now, rank.last_end)
                return "livelock"
            if steps >= limits.max_steps:
                return "max_steps"
            if self.progress and steps % PROGRESS_EVERY == 0:
                self.progress(
                    self.now, self.recorder.num_completed, self.recorder.total, steps
                )

    def _resume_after_wedge(self, rank: Rank) -> bool:
        """Ask ``on_wedge`` whether the run goes on past ``rank``'s wedge."""
        if self.on_wedge is None or not self.on_wedge(self, rank):
            return False
        rank.stalls.restart_wedge_count()
        return True

    def _next_rank(self) -> Rank | None:
        best: Rank | None = None
        for rank in self.ranks:
            ready = self._has_step_arrival(rank) or rank.active
            if ready and (best is None or rank.clock < best.clock):
                best = rank
        return best

    def _has_step_arrival(self, rank: Rank) -> bool:
        return rank.role == "single" and bool(self._step_arrivals)

    def _stuck_report(self) -> str:
        pending = [rid for rid, t in self.recorder.requests.items() if t.done_s is None]
        return (
            f"no event and no active rank at t={self.now:.6f}s but "
            f"{self.recorder.total - self.recorder.num_completed} request(s) are "
            f"not complete (arrived, pending: {pending[:10]})"
        )

    # ---- events --------------------------------------------------------------------
    def _handle(self, event: _Event) -> None:
        request = self.requests[event.req_id]
        if event.kind == "arrive":
            self._arrive(request)
        elif event.kind == "handoff":
            self._handoff(request)
        elif event.kind in ("pulled", "lease"):
            self._release(request, expired=event.kind == "lease")
        elif event.kind == "abort":
            self._abort(request)
        else:
            raise SimulationError(f"unknown event {event.kind!r}")

    def _arrive(self, request: SimRequest) -> None:
        self.recorder.arrived(request.req_id, self.now)
        route = self.routes.setdefault(request.req_id, _Route())
        if self.scenario.mode == "single":
            route.decode = self.decode[0]
            self._add(route.decode, request, _local_params(request), request.max_tokens)
        elif request.disaggregated:
            route.prefill = self._pick(self.prefill, request)
            self._add(route.prefill, request, _prefill_params(request), 1)
        else:
            route.decode = self._pick(self.decode, request)
            self._add(route.decode, request, _local_params(request), request.max_tokens)

    def _abort(self, request: SimRequest) -> None:
        """Abort ``request`` wherever it is (no-op once it completed)."""
        req_id = request.req_id
        times = self.recorder.requests.get(req_id)
        if times is None or times.done_s is not None:
            return
        route = self.routes.get(req_id, _Route())
        for rank in (route.prefill, route.decode):
            if rank is not None:
                rank.abort(req_id, self.now)
                rank.release(req_id, self.now)  # a prefill rank's held blocks
        self.aborted.add(req_id)
        self._complete(req_id, "abort", self.now)

    def _handoff(self, request: SimRequest) -> None:
        if request.req_id in self.aborted:
            return  # aborted between prefill and decode
        route = self.routes[request.req_id]
        route.decode = self._pick(self.decode, request)
        self._add(route.decode, request, _decode_params(request), request.max_tokens)

    def _release(self, request: SimRequest, expired: bool) -> None:
        rank = self.routes[request.req_id].prefill
        if rank is not None and rank.release(request.req_id, self.now) and expired:
            self.recorder.lease_expired += 1

    def _add(
        self,
        rank: Rank,
        request: SimRequest,
        params: dict[str, Any] | None,
        max_tokens: int,
    ) -> None:
        rank.add(
            request.req_id,
            request.prompt_tokens,
            max_tokens,
            request.priority,
            params,
            self.now,
        )

    def _pick(self, ranks: list[Rank], request: SimRequest) -> Rank:
        if self.scenario.ranks.router == "least_loaded":
            return min(ranks, key=lambda r: r.load)  # ties: the lowest index
        return ranks[request.index % len(ranks)]

    # ---- steps ---------------------------------------------------------------------
    def _step(self, rank: Rank) -> None:
        self._deliver_step_arrivals(rank)
        self._deliver_step_aborts(rank)
        step = rank.step()
        self.recorder.step(rank, step, serves_client=rank.role != "prefill")
        if rank.role == "prefill":
            self._after_prefill_step(rank, step)
        else:
            self._after_serving_step(step)
        if rank.role == "decode":
            for req_id in step.recv_done:
                self._push(step.end_s, "pulled", req_id)

    def _deliver_step_aborts(self, rank: Rank) -> None:
        while self._step_aborts and rank.role == "single":
            request = self._step_aborts[0]
            if (request.abort_at_step or 0) > rank.num_steps:
                return
            self._step_aborts.pop(0)
            self.now = max(self.now, rank.clock)
            self._abort(request)

    def _deliver_step_arrivals(self, rank: Rank) -> None:
        while self._step_arrivals and rank.role == "single":
            request = self._step_arrivals[0]
            if (request.arrival_step or 0) > rank.num_steps:
                return
            self._step_arrivals.pop(0)
            self.now = max(self.now, rank.clock)
            self._arrive(request)

    def _after_prefill_step(self, rank: Rank, step: RankStep) -> None:
        lease = self.scenario.pd.lease_s
        for req_id, reason in step.finished:
            if reason not in SUCCESS:
                self._complete(req_id, reason, step.end_s)
                continue
            rank.held.add(req_id)
            self._push(step.end_s + self.scenario.pd.handoff_s, "handoff", req_id)
            self._push(step.end_s + lease, "lease", req_id)

    def _after_serving_step(self, step: RankStep) -> None:
        for req_id in step.first_tokens:
            self.recorder.first_token(req_id, step.end_s)
        for req_id, reason in step.finished:
            self._complete(req_id, reason, step.end_s)

    def _complete(self, req_id: str, reason: str, at: float) -> None:
        if reason != "abort" and req_id in self.aborted:
            return  # completed when it was aborted
        self.recorder.completed(req_id, reason, at)
        if self.workload.closed_loop:
            self._send_next_closed(at)


# ---- kv_transfer_params per rank -------------------------------------------------
def _local_params(request: SimRequest) -> dict[str, Any] | None:
    """The request computes its prompt here, after its own load if any."""
    load = request.local_load
    return {load.key: load.params()} if load else None


def _prefill_params(request: SimRequest) -> dict[str, Any]:
    """Prefill side: an optional store hit; blocks held for the decode pull."""
    params = _local_params(request) or {}
    params[PD_KEY] = {"tokens": 0, "delay_free": True}
    return params


def _decode_params(request: SimRequest) -> dict[str, Any]:
    """Decode side: the full-prompt receive from the prefill rank."""
    assert request.transfer is not None
    return {PD_KEY: request.transfer.params()}
