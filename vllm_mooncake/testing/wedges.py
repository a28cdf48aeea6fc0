"""The wedge catalogue: block-level scenarios that stall vLLM's scheduler.

Each scenario is a rank shape, a load-failure policy and a list of arrivals
(which step a request arrives at, its prompt, and its scripted load). They
are the block-level layouts of ``docs/vllm-scheduler-by-release.md``, with a
pool of 100 usable blocks of 16 tokens and 2048-token chunks:

* ``seed``  -- the two-owner wedge of the original lateral-preemption PR. A
  (store hit of 50 of its 80 blocks) and B (P->D transfer of 50 blocks) both
  finish loading; A is promoted first, needs 30 more blocks, none are free;
  the admission loop breaks; B is never promoted. Stock vLLM >= 0.23 avoids
  it with its async-load reservation; without the reservation (0.19-0.22,
  with default config, or our ``no-reserve`` policy) it forms.
* ``w1``    -- ``policy=priority`` + ``scheduler_reserve_full_isl=False``:
  X (priority 0) is admitted on a 40-block store hit without its remaining
  50 blocks being checked; Y (priority 1, transfer done) sits behind X.
* ``w2``    -- ``kv_load_failure_policy=recompute``: A's store load fails
  entirely; A, re-offered the hit, reserves blocks against itself and can
  never be admitted; B (transfer done) sits behind A. 0.23+ (it needs the
  async-load reservation).
* ``hol``   -- head of line, vLLM 0.19-0.30: C holds no blocks but was skipped
  once (its store lookup said "ask later") into ``skipped_waiting``; B's
  60-block transfer is admitted behind it; C then needs 50 blocks with 40
  free and breaks the loop ahead of B forever. 0.31+ queues C apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_mooncake.testing.configs import pd_transfer, store_hit
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver, StepResult

POOL = 100
BLOCK = 16


@dataclass(frozen=True)
class Arrival:
    step: int
    req_id: str
    prompt_len: int
    max_tokens: int = 4
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True)
class WedgeScenario:
    name: str
    summary: str
    shape: EngineShape
    arrivals: tuple[Arrival, ...]
    kv_load_failure_policy: str = "fail"
    # The recv-done request that the stall strands.
    stranded: str = ""
    # Extra guard/connector settings a scenario needs (e.g. no reservation).
    needs_no_reservation: bool = False
    tags: tuple[str, ...] = field(default_factory=tuple)
    # The release series on which stock vLLM stalls for good on this layout:
    # with the wedge's own config (``shape``, ``kv_load_failure_policy``),
    # and with vLLM's default config. Measured on each release's own code
    # (``bench/release_wedges.py``; tests/test_stock_wedges.py holds stock to
    # them on every release, both ways).
    wedges_on: tuple[str, ...] = ()
    wedges_on_defaults: tuple[str, ...] = ()

    def with_default_config(self) -> WedgeScenario:
        """The same arrivals on vLLM's default scheduler config (FCFS, full-ISL
        check, ``kv_load_failure_policy=fail``); pool and chunk unchanged."""
        shape = EngineShape(
            num_blocks=self.shape.num_blocks, block_size=self.shape.block_size
        )
        return replace(self, shape=shape, kv_load_failure_policy="fail")


def _series(first: int, last: int) -> tuple[str, ...]:
    return tuple(f"0.{minor}" for minor in range(first, last + 1))


def _shape(**kw: Any) -> EngineShape:
    return EngineShape(num_blocks=POOL + 1, block_size=BLOCK, **kw)


SEED = WedgeScenario(
    name="seed",
    summary="two owners each hold half the pool; head needs more (no reservation)",
    shape=_shape(),
    arrivals=(
        Arrival(0, "A", 80 * BLOCK, kv_transfer_params=store_hit(50 * BLOCK, 2)),
        Arrival(1, "B", 50 * BLOCK, kv_transfer_params=pd_transfer(1)),
    ),
    stranded="B",
    needs_no_reservation=True,
    # No reservation before 0.23: the layout alone wedges, default config.
    wedges_on=_series(19, 22),
    wedges_on_defaults=_series(19, 22),
)

W1 = WedgeScenario(
    name="w1",
    summary="priority policy without full-ISL check admits X past its need",
    shape=_shape(policy="priority", reserve_full_isl=False),
    arrivals=(
        Arrival(0, "Y", 50 * BLOCK, priority=1, kv_transfer_params=pd_transfer(3)),
        Arrival(
            1, "X", 90 * BLOCK, priority=0, kv_transfer_params=store_hit(40 * BLOCK, 1)
        ),
    ),
    stranded="Y",
    wedges_on=_series(19, 34),
)

W2 = WedgeScenario(
    name="w2",
    summary="a fully failed store load under recompute reserves against itself",
    shape=_shape(),
    arrivals=(
        Arrival(
            0,
            "A",
            45 * BLOCK,
            kv_transfer_params=store_hit(
                30 * BLOCK, 2, outcome="fail", failing_attempts=1
            ),
        ),
        Arrival(1, "B", 50 * BLOCK, kv_transfer_params=pd_transfer(1)),
    ),
    kv_load_failure_policy="recompute",
    stranded="B",
    # Needs the async-load reservation (0.23+) to reserve against itself.
    wedges_on=_series(23, 34),
)

HOL = WedgeScenario(
    name="hol",
    summary="a block-less request skipped once blocks a recv-done holder (<= 0.30)",
    shape=_shape(),
    arrivals=(
        Arrival(
            0,
            "C",
            50 * BLOCK,
            kv_transfer_params=store_hit(0, 1, defer_lookups=1),
        ),
        Arrival(0, "B", 60 * BLOCK, kv_transfer_params=pd_transfer(1)),
    ),
    stranded="B",
    tags=("vllm<=0.30",),
    # skipped_waiting (0.19-0.30); default config.
    wedges_on=_series(19, 30),
    wedges_on_defaults=_series(19, 30),
)

CATALOGUE: dict[str, WedgeScenario] = {s.name: s for s in (SEED, W1, W2, HOL)}

STORE_VICTIM = WedgeScenario(
    name="store-victim",
    summary="victim re-admitted through a second async store load",
    shape=SEED.shape,
    arrivals=(
        Arrival(0, "A", 80 * BLOCK, kv_transfer_params=store_hit(50 * BLOCK, 2)),
        Arrival(1, "B", 50 * BLOCK, kv_transfer_params=store_hit(50 * BLOCK, 1)),
    ),
)
"""Not a wedge of the catalogue: a store-loaded lateral victim is re-offered
its hit and loads again; promoted with ``num_preemptions=1``, it must still
reach the worker as NEW (it never executed)."""


def play(
    driver: SchedulerDriver,
    scenario: WedgeScenario,
    max_steps: int,
    until: Callable[[SchedulerDriver], bool] | None = None,
    after_step: Callable[[StepResult], None] | None = None,
) -> list[StepResult]:
    """Feed the arrivals at their steps and step the driver.

    Stops after ``max_steps`` steps, or earlier once every request has arrived
    and ``until(driver)`` holds (default: the scheduler is empty). Each step's
    result goes to ``after_step`` (e.g. an invariant checker) if given.
    """
    pending = sorted(scenario.arrivals, key=lambda a: a.step)
    done = until or (lambda d: not d.scheduler.has_requests())
    results: list[StepResult] = []
    for step in range(max_steps):
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            driver.add(
                a.req_id,
                a.prompt_len,
                max_tokens=a.max_tokens,
                priority=a.priority,
                kv_transfer_params=a.kv_transfer_params,
            )
        if not pending and done(driver):
            break
        result = driver.step()
        if after_step is not None:
            after_step(result)
        results.append(result)
    return results
