"""What a run observed: per-request times, per-step series, and the summary.

The cluster reports every request event (arrival, first token, completion)
and every rank step; :meth:`Recorder.result` turns them into a
:class:`~vllm_mooncake.tools.sim.results.RunResult`, binning the per-step series
into :data:`TIMELINE_BINS` points for the plot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_mooncake.tools.sim.rank import Rank, RankStep
from vllm_mooncake.tools.sim.results import RankResult, RunResult, percentiles

TIMELINE_BINS = 120
SUCCESS = ("length", "stop")
ABORTED = "abort"


@dataclass
class RequestTimes:
    arrival_s: float
    first_token_s: float | None = None
    done_s: float | None = None
    reason: str = ""


@dataclass
class Recorder:
    total: int
    requests: dict[str, RequestTimes] = field(default_factory=dict)
    lease_expired: int = 0
    # (end of step, tokens sampled) on ranks that serve the client.
    _tokens: list[tuple[float, int]] = field(default_factory=list)
    # rank -> [(end of step, free blocks)]
    _free: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    _min_free: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    # Requests with a completion time (the cluster asks after every step).
    _num_completed: int = 0

    # ---- requests ---------------------------------------------------------------
    def arrived(self, req_id: str, at: float) -> None:
        self.requests[req_id] = RequestTimes(arrival_s=at)

    def first_token(self, req_id: str, at: float) -> None:
        times = self.requests[req_id]
        if times.first_token_s is None:
            times.first_token_s = at

    def completed(self, req_id: str, reason: str, at: float) -> None:
        times = self.requests[req_id]
        if times.done_s is None:
            self._num_completed += 1
        times.done_s = at
        times.reason = reason

    @property
    def num_completed(self) -> int:
        return self._num_completed

    # ---- steps --------------------------------------------------------------------
    def step(self, rank: Rank, step: RankStep, serves_client: bool) -> None:
        if serves_client and step.output_tokens:
            self._tokens.append((step.end_s, step.output_tokens))
        series = self._free.setdefault(rank.name, [])
        if not series or series[-1][1] != step.free_blocks:
            series.append((step.end_s, step.free_blocks))
        low = self._min_free.get(rank.name, step.free_blocks)
        self._min_free[rank.name] = min(low, step.free_blocks)
        self.preemptions += step.preempted

    # ---- summary ------------------------------------------------------------------
    def result(
        self,
        header: dict[str, object],
        ranks: list[Rank],
        stop_reason: str,
        sim_seconds: float,
    ) -> RunResult:
        done = [t for t in self.requests.values() if t.done_s is not None]
        ok = [t for t in done if t.reason in SUCCESS]
        aborted = sum(1 for t in done if t.reason == ABORTED)
        output_tokens = sum(n for _, n in self._tokens)
        wedged = [r.name for r in ranks if r.stalls.wedged]
        for r in ranks:
            r.stalls.finish()
        return RunResult(
            stop_reason=stop_reason,
            finished=len(ok),
            failed=len(done) - len(ok) - aborted,
            aborted=aborted,
            total=self.total,
            wedged=bool(wedged),
            wedged_ranks=wedged,
            livelocked=[
                {"rank": r.name, "request": req_id, "loads": loads}
                for r in ranks
                for req_id, loads in r.livelocked.items()
            ],
            max_stall_steps=max(r.stalls.max_streak for r in ranks),
            stalled_seconds=round(sum(r.stalls.stalled_s for r in ranks), 6),
            lateral_preemptions=sum(
                r.guard_stats.total_lateral_preemptions for r in ranks
            ),
            attempts_exhausted=sum(r.guard_stats.attempts_exhausted for r in ranks),
            laterals=sorted(
                (entry for r in ranks for entry in r.laterals),
                key=lambda e: (e["t_s"], e["rank"], e["step"]),
            ),
            preemptions=self.preemptions,
            lease_expired=self.lease_expired,
            output_tokens=output_tokens,
            sim_seconds=round(sim_seconds, 6),
            throughput_tok_s=round(output_tokens / sim_seconds, 3)
            if sim_seconds > 0
            else 0.0,
            ttft_s=percentiles(
                [
                    t.first_token_s - t.arrival_s
                    for t in ok
                    if t.first_token_s is not None
                ]
            ),
            e2e_s=percentiles(
                [t.done_s - t.arrival_s for t in ok if t.done_s is not None]
            ),
            steps=sum(r.num_steps for r in ranks),
            ranks=[self._rank_result(r) for r in ranks],
            timeline=self._timeline(sim_seconds, ranks),
            stalls=_stall_list(ranks),
            **header,  # type: ignore[arg-type]
        )

    def _rank_result(self, rank: Rank) -> RankResult:
        return RankResult(
            name=rank.name,
            role=rank.role,
            steps=rank.num_steps,
            busy_s=round(rank.busy_s, 6),
            blocked_steps=rank.stalls.blocked_steps,
            max_stall_steps=rank.stalls.max_streak,
            stalled_seconds=round(rank.stalls.stalled_s, 6),
            wedged=rank.stalls.wedged,
            min_free_blocks=self._min_free.get(rank.name, rank.spec.usable_blocks),
            usable_blocks=rank.spec.usable_blocks,
            guard=rank.guard_stats.to_dict(),
        )

    def _timeline(self, sim_seconds: float, ranks: list[Rank]) -> dict[str, object]:
        bins = TIMELINE_BINS
        width = sim_seconds / bins if sim_seconds > 0 else 1.0
        tokens = [0] * bins
        for end, n in self._tokens:
            tokens[min(bins - 1, int(end / width))] += n
        return {
            "bin_s": round(width, 6),
            "t": [round((i + 1) * width, 6) for i in range(bins)],
            "throughput_tok_s": [round(n / width, 3) for n in tokens],
            "free_blocks": {
                r.name: _sample(self._free.get(r.name, []), width, bins, r)
                for r in ranks
            },
        }


def _sample(
    series: list[tuple[float, int]], width: float, bins: int, rank: Rank
) -> list[int]:
    """Free blocks at the end of each bin (the last value seen by then)."""
    out, i, value = [], 0, rank.spec.usable_blocks
    for b in range(bins):
        edge = (b + 1) * width
        while i < len(series) and series[i][0] <= edge:
            value = series[i][1]
            i += 1
        out.append(value)
    return out


def _stall_list(ranks: list[Rank]) -> list[dict[str, object]]:
    return [
        {
            "rank": r.name,
            "start_s": round(s.start_s, 6),
            "end_s": round(s.end_s, 6),
            "steps": s.steps,
        }
        for r in ranks
        for s in r.stalls.intervals
    ]
