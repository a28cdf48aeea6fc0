"""Steps to recover from a formed wedge, on vLLM 0.32's real scheduler.

Two measurements, each under the valve-less policy that wedges (``no-reserve``:
stock vLLM without the async-load reservation, as before 0.23; ``reserve``:
upstream vLLM, the guard only observing) and then with the valve:

1. **Catalogue** (``vllm_mooncake.testing.wedges``: seed, W1, W2; one rank,
   100 blocks). *Formed*: play the wedge under the valve-less policy until
   ``--form-steps`` steps have scheduled no token with no receive in flight
   (the wedge is that old: stock would stay there).
   Then either keep the policy (stock: does it ever recover within
   ``--max-steps``?) or open the valve on the live scheduler (switch its
   policy to ``reserve+lateral`` / ``lateral``) and count the steps to the
   first scheduled token and until every request finished. *From the start*:
   the same arrivals with the valve on from step 0: the steps that scheduled
   no token with nothing in flight (the wedge's own steps; 0 means it never
   formed) and the lateral preemptions.
2. **Simulator** (library scenario ``seed_1p2d_256``, 1P2D x 256 clients):
   ``no-reserve`` until a decode rank is wedged (``limits.wedge_steps``
   blocked steps), then the valve opened on every rank; steps of the wedged
   rank from the switch to its first unblocked step, simulated seconds, and
   whether the run then completed. Stock keeps going for ``--stock-wedges``
   more wedge periods to show it does not recover. ::

    python bench/recovery.py              # full-size simulator run
    python bench/recovery.py --quick      # simulator at scale 0.125
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from _util import machine, setup, table

if TYPE_CHECKING:
    from vllm_mooncake.testing.driver import SchedulerDriver
    from vllm_mooncake.tools.sim.cluster import Cluster
    from vllm_mooncake.tools.sim.rank import Rank

VALVES = ("reserve+lateral", "lateral")
# The catalogue wedge -> the valve-less policies that form it.
FORMING = {"seed": ("no-reserve",), "w1": ("no-reserve", "reserve"), "w2": ("reserve",)}
SIM_SCENARIO = "seed_1p2d_256"


def set_policy(scheduler: Any, policy: str) -> None:
    """Switch a live guarded scheduler's policy (the valve opens or shuts)."""
    guard = scheduler.wedge_guard
    guard.config = guard.config.with_policy(policy)


# ---- 1. the catalogue ----------------------------------------------------------------
@dataclass(frozen=True)
class CatalogueRow:
    wedge: str
    formed_under: str
    then: str  # "stock" (no change) or the valve policy switched to
    formed_at: int | None  # the wedge's first step (None: it never formed)
    first_token: int | None  # steps after the switch to the first token
    drained: int | None  # steps after the switch until every request finished
    lateral: int


class WedgeWatch:
    """``play``'s ``until``: counts wedge steps, stops once a wedge is old enough.

    A *wedge step* scheduled no token while requests waited and no receive
    was in flight, neither when it began nor when it ended (so waiting for a
    load to land is not one).
    """

    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after = stop_after
        self.total = 0  # wedge steps seen
        self.streak = 0  # consecutive wedge steps, ending at the last step
        self.streak_start = 0  # index of the streak's first step
        self._quiet_before = False  # the step about to run began with nothing in flight

    def __call__(self, driver: SchedulerDriver) -> bool:
        if driver.steps:
            self._observe(driver)
        unfinished = driver.scheduler.get_num_unfinished_requests() > 0
        self._quiet_before = unfinished and not driver.worker.in_flight
        if self.stop_after is not None and self.streak >= self.stop_after:
            return True
        return not driver.scheduler.has_requests()

    def _observe(self, driver: SchedulerDriver) -> None:
        last = driver.steps[-1]
        wedge = (
            self._quiet_before
            and not last.num_scheduled_tokens
            and not driver.worker.in_flight
        )
        if not wedge:
            self.streak = 0
            return
        if self.streak == 0:
            self.streak_start = last.index
        self.streak += 1
        self.total += 1


def _driver(name: str, policy: str) -> SchedulerDriver:
    from vllm_mooncake.testing.configs import guarded
    from vllm_mooncake.testing.driver import SchedulerDriver
    from vllm_mooncake.testing.wedges import CATALOGUE

    scenario = CATALOGUE[name]
    config = guarded(policy, kv_load_failure_policy=scenario.kv_load_failure_policy)
    return SchedulerDriver.build(scenario.shape, config)


def form_then(name: str, policy: str, then: str, form: int, limit: int) -> CatalogueRow:
    """Form wedge ``name`` under ``policy``; then keep it or open the valve."""
    from vllm_mooncake.testing.wedges import CATALOGUE, play

    driver = _driver(name, policy)
    watch = WedgeWatch(stop_after=form)
    play(driver, CATALOGUE[name], limit, until=watch)
    formed = watch.streak_start if watch.streak >= form else None
    if then != "stock":
        set_policy(driver.scheduler, then)
    after = driver.run(limit)
    first = next((i + 1 for i, s in enumerate(after) if s.num_scheduled_tokens), None)
    return CatalogueRow(
        wedge=name,
        formed_under=policy,
        then=then,
        formed_at=formed,
        first_token=first,
        drained=None if driver.scheduler.has_requests() else len(after),
        lateral=driver.scheduler.wedge_guard.stats.total_lateral_preemptions,
    )


@dataclass(frozen=True)
class FromStartRow:
    wedge: str
    policy: str
    finished: bool
    steps: int
    wedge_steps: int  # no token, requests waiting, nothing in flight
    lateral: int


def from_start(name: str, policy: str, limit: int) -> FromStartRow:
    """The wedge's arrivals with ``policy`` from step 0."""
    from vllm_mooncake.testing.wedges import CATALOGUE, play

    driver = _driver(name, policy)
    watch = WedgeWatch()
    steps = play(driver, CATALOGUE[name], limit, until=watch)
    return FromStartRow(
        wedge=name,
        policy=policy,
        finished=not driver.scheduler.has_requests(),
        steps=len(steps),
        wedge_steps=watch.total,
        lateral=driver.scheduler.wedge_guard.stats.total_lateral_preemptions,
    )


def _n(x: int | None, limit: int) -> str:
    return f"never (>{limit})" if x is None else str(x)


def catalogue(form: int, limit: int) -> str:
    formed = [
        form_then(name, policy, then, form, limit)
        for name, policies in FORMING.items()
        for policy in policies
        for then in ("stock", *VALVES)
    ]
    rows = [
        (
            r.wedge,
            r.formed_under,
            "stays" if r.then == "stock" else f"-> {r.then}",
            _n(r.formed_at, limit),
            _n(r.first_token, limit),
            _n(r.drained, limit),
            r.lateral,
        )
        for r in formed
    ]
    part1 = table(
        (
            "wedge",
            "formed under",
            "then",
            "formed at step",
            "steps to 1st token",
            "steps to drain",
            "lateral",
        ),
        rows,
    )
    started = [from_start(n, p, limit) for n in FORMING for p in VALVES]
    part2 = table(
        ("wedge", "valve on from step 0", "outcome", "steps", "wedge steps", "lateral"),
        [
            (
                r.wedge,
                r.policy,
                "finished" if r.finished else "WEDGED",
                r.steps,
                r.wedge_steps,
                r.lateral,
            )
            for r in started
        ],
    )
    return part1 + "\n\n" + part2


# ---- 2. the simulator ----------------------------------------------------------------
@dataclass
class Switch:
    """What an ``on_wedge`` callback saw and did."""

    then: str  # "stock" or a valve policy
    wedges_allowed: int  # stock: how many more wedge periods to let pass
    rank: str = ""
    at_s: float = 0.0
    at_step: int = 0  # the wedged rank's step count at the switch
    streak: int = 0  # its blocked-step streak at the switch
    streak_start_s: float = 0.0
    calls: int = 0

    def __call__(self, cluster: Cluster, rank: Rank) -> bool:
        self.calls += 1
        if self.calls == 1:
            self.rank, self.at_s, self.at_step = (
                rank.name,
                rank.last_end,
                rank.num_steps,
            )
            self.streak, self.streak_start_s = (
                rank.stalls.streak,
                rank.stalls.streak_start_s,
            )
        if self.then == "stock":
            return self.calls <= self.wedges_allowed
        if self.calls > 1:
            return False  # opened the valve once; wedged again -> stop
        for r in cluster.ranks:
            set_policy(r.scheduler, self.then)
        return True


@dataclass(frozen=True)
class SimRow:
    then: str
    switch: Switch
    outcome: str
    finished: int
    total: int
    recovery_steps: int | None
    sim_s: float
    lateral: int
    wall_s: float


def _recovery(result: Any, switch: Switch) -> int | None:
    """Steps of the wedged rank from the switch to its first unblocked step
    (1: the first step after the switch scheduled work)."""
    if result.wedged or not switch.rank:
        return None
    for stall in result.stalls:
        if stall["rank"] == switch.rank and stall["start_s"] == round(
            switch.streak_start_s, 6
        ):
            return int(stall["steps"]) - switch.streak + 1
    return None


def sim_run(then: str, scale: float, stock_wedges: int) -> SimRow:
    from vllm_mooncake.tools.sim.__main__ import resolve_scenario
    from vllm_mooncake.tools.sim.runner import simulate
    from vllm_mooncake.tools.sim.scenario import load_scenario

    scenario = load_scenario(resolve_scenario(SIM_SCENARIO)).with_policy("no-reserve")
    switch = Switch(then, stock_wedges)
    start = time.perf_counter()
    result, _ = simulate(scenario, scale, on_wedge=switch)
    steps = _recovery(result, switch)
    return SimRow(
        then=then,
        switch=switch,
        outcome=result.outcome,
        finished=result.finished,
        total=result.total,
        recovery_steps=steps,
        sim_s=result.sim_seconds,
        lateral=result.lateral_preemptions,
        wall_s=time.perf_counter() - start,
    )


def simulator(scale: float, stock_wedges: int) -> str:
    rows = []
    for then in ("stock", *VALVES):
        r = sim_run(then, scale, stock_wedges)
        s = r.switch
        rows.append(
            (
                "stays no-reserve" if then == "stock" else f"-> {then}",
                f"{s.rank or '-'} at {s.at_s:.2f}s (step {s.at_step})",
                s.streak,
                "never" if r.recovery_steps is None else r.recovery_steps,
                "-" if r.outcome != "finished" else f"{r.sim_s - s.at_s:.2f}",
                r.outcome,
                f"{r.finished}/{r.total}",
                f"{r.sim_s:.2f}",
                r.lateral,
                f"{r.wall_s:.1f}",
            )
        )
    return table(
        (
            "after the wedge",
            "wedged rank at",
            "blocked steps then",
            "steps to unblock",
            "sim s to drain",
            "outcome",
            "done",
            "sim s",
            "lateral",
            "wall s",
        ),
        rows,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="simulator at scale 0.125")
    p.add_argument("--scale", type=float, default=None, help="default 1 (quick 0.125)")
    p.add_argument("--form-steps", type=int, default=50, help="catalogue: wedge age")
    p.add_argument("--max-steps", type=int, default=1000, help="catalogue: step cap")
    p.add_argument("--stock-wedges", type=int, default=3, help="sim: periods for stock")
    p.add_argument("--no-sim", action="store_true", help="the catalogue only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scale = args.scale or (0.125 if args.quick else 1.0)
    setup()
    print(f"# recovery: the wedge catalogue; {machine()}")
    print(catalogue(args.form_steps, args.max_steps))
    if not args.no_sim:
        print()
        print(
            f"# recovery: {SIM_SCENARIO} at scale {scale:g} under no-reserve until a "
            f"rank wedges, then (a) unchanged for {args.stock_wedges} more wedge "
            "periods, (b) the valve opened on every rank"
        )
        print(simulator(scale, args.stock_wedges))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
