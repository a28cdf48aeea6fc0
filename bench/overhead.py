"""The guard's scheduler overhead: CPU time of schedule() + update_from_output().

Each variant is one vLLM 0.32 scheduler on one rank fed the same closed
loop of 256 concurrent requests (half with a store-like async prefix load,
half with a NIXL-like full-prompt receive, scripted to land 1-4 steps after
admission):

* ``stock``  -- vLLM's own ``Scheduler`` with vLLM's ``MultiConnector`` over
  the two scripted children (``vllm_mooncake.testing.configs.scripted_multi``);
* one per guard policy -- ``WedgeGuardScheduler`` with ``WedgeGuardConnector``
  over the same children (production settings: ``strict`` off).

Only the two scheduler calls are timed (the fake worker and the feeder are
not), with ``time.thread_time`` (CPU) and ``time.perf_counter`` (wall). The
variants run interleaved -- ``--chunk`` steps each, in turn, the order
reversed every round -- so a noisy neighbour slows all of them alike; the
ratio reported is the median over rounds of (guarded CPU per step) / (stock
CPU per step) with a bootstrap 95% interval, next to the ratio of the totals.
Each concurrency in ``--sizes`` is its own interleaved run. Last, a cProfile
of the guarded variant alone (not timed with the others) lists the guard's
own frames that cost the most. ::

    python bench/overhead.py                       # 256 and 1024, 40 x 50 steps
    python bench/overhead.py --sizes 256 --quick   # 3 rounds x 20 steps
    # a wedge_guard field per variant, after a slash:
    python bench/overhead.py --variants \\
        stock,reserve+lateral,reserve+lateral/gauge_interval_s=0
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from _util import machine, setup, table

STOCK = "stock"
DEFAULT_VARIANTS = (STOCK, "reserve", "reserve+lateral", "lateral")
BLOCK = 16


@dataclass
class Timing:
    """Accumulated time of the timed scheduler calls of one variant."""

    cpu_s: float = 0.0
    wall_s: float = 0.0
    steps: int = 0
    running: int = 0  # summed over timed steps (mean = running / steps)
    chunk_cpu: list[float] = field(default_factory=list)  # CPU s per step, per chunk


def timed(fn: Callable[..., Any], timing: Timing) -> Callable[..., Any]:
    """``fn`` with its CPU and wall time added to ``timing``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timing.cpu_s += time.thread_time() - cpu0
            timing.wall_s += time.perf_counter() - wall0

    return wrapper


def request_params(index: int) -> tuple[int, int, dict[str, Any]]:
    """Prompt length, output length and load of closed-loop request ``index``."""
    from vllm_mooncake.testing.configs import pd_transfer, store_hit

    rng = random.Random(f"overhead/{index}")
    prompt = rng.randint(256, 1024)
    output = rng.randint(32, 256)
    if rng.random() < 0.5:
        hit = int(prompt * rng.uniform(0.3, 0.9)) // BLOCK * BLOCK
        return prompt, output, store_hit(hit, rng.randint(1, 3))
    return prompt, output, pd_transfer(rng.randint(1, 4))


def _field(override: str) -> tuple[str, Any]:
    """``gauge_interval_s=0`` -> ("gauge_interval_s", 0): a wedge_guard field."""
    key, _, value = override.partition("=")
    return key, json.loads(value)


class Variant:
    """One scheduler under test, fed its own copy of the closed loop."""

    def __init__(self, name: str, concurrency: int, num_blocks: int) -> None:
        from vllm_mooncake.testing.configs import guarded, scripted_multi
        from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver

        shape = EngineShape(
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_num_seqs=concurrency,
            max_num_batched_tokens=4096,
        )
        policy, *overrides = name.split("/")
        fields = dict(_field(o) for o in overrides)
        config = (
            scripted_multi()
            if name == STOCK
            else guarded(policy, strict=False, **fields)
        )
        self.name = name
        self.driver = SchedulerDriver.build(shape, config)
        self.driver.keep_steps = False
        self.concurrency = concurrency
        self.next_index = 0
        self.timing = Timing()
        scheduler = self.driver.scheduler
        scheduler.schedule = timed(scheduler.schedule, self.timing)
        scheduler.update_from_output = timed(scheduler.update_from_output, self.timing)

    @property
    def scheduler_class(self) -> str:
        return type(self.driver.scheduler).__name__

    def top_up(self) -> None:
        """Keep ``concurrency`` requests outstanding (a closed loop)."""
        while self.driver.scheduler.get_num_unfinished_requests() < self.concurrency:
            prompt, output, params = request_params(self.next_index)
            self.driver.add(
                f"q{self.next_index}",
                prompt,
                max_tokens=output,
                kv_transfer_params=params,
            )
            self.next_index += 1

    def steps(self, n: int, record: bool) -> None:
        """``n`` steps; counted in the timing only if ``record``."""
        before = (self.timing.cpu_s, self.timing.wall_s)
        for _ in range(n):
            self.top_up()
            self.driver.step()
            if record:
                self.timing.running += len(self.driver.scheduler.running)
        if record:
            self.timing.steps += n
            self.timing.chunk_cpu.append((self.timing.cpu_s - before[0]) / n)
        else:
            self.timing.cpu_s, self.timing.wall_s = before


def run(
    names: Sequence[str], rounds: int, chunk: int, warmup: int, concurrency: int
) -> list[Variant]:
    """Warm every variant up, then interleave ``rounds`` chunks of each."""
    variants = [Variant(n, concurrency, num_blocks=concurrency * 80 + 1) for n in names]
    for v in variants:
        v.steps(warmup, record=False)
    for i in range(rounds):
        order = variants if i % 2 == 0 else variants[::-1]
        for v in order:
            gc.collect()
            v.steps(chunk, record=True)
    return variants


def bootstrap_median(ratios: Sequence[float], draws: int = 2000) -> tuple[float, float]:
    """A 95% interval of the median of ``ratios`` (percentile bootstrap)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws)
    )
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def report(variants: Sequence[Variant]) -> str:
    stock = next((v for v in variants if v.name == STOCK), None)
    rows = []
    for v in variants:
        t = v.timing
        per_round = (
            [g / s for g, s in zip(t.chunk_cpu, stock.timing.chunk_cpu, strict=True)]
            if stock is not None
            else []
        )
        low, high = bootstrap_median(per_round) if per_round else (0.0, 0.0)
        rows.append(
            (
                v.name,
                v.scheduler_class,
                t.steps,
                f"{t.running / t.steps:.0f}",
                f"{t.cpu_s / t.steps * 1e6:.0f}",
                f"{t.wall_s / t.steps * 1e6:.0f}",
                "-" if stock is None else f"{t.cpu_s / stock.timing.cpu_s:.3f}",
                "-" if not per_round else f"{statistics.median(per_round):.3f}",
                "-" if not per_round else f"{low:.3f}..{high:.3f}",
            )
        )
    headers = (
        "variant",
        "scheduler",
        "steps",
        "running",
        "cpu us/step",
        "wall us/step",
        "cpu x stock (total)",
        "x stock (median of rounds)",
        "median 95% CI",
    )
    return table(headers, rows)


def guard_profile(name: str, concurrency: int, warmup: int, steps: int) -> str:
    """cProfile top 10 of the guard's own frames (by own time) in one variant."""
    variant = Variant(name, concurrency, num_blocks=concurrency * 80 + 1)
    variant.steps(warmup, record=False)
    profile = cProfile.Profile()
    profile.enable()
    variant.steps(steps, record=True)
    profile.disable()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).sort_stats("tottime")
    stats.print_stats(r"vllm_mooncake/guard/", 10)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(line for line in lines[start:] if line.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 rounds x 20 steps")
    p.add_argument("--rounds", type=int, default=None, help="default 40 (quick 3)")
    p.add_argument("--chunk", type=int, default=None, help="default 50 (quick 20)")
    p.add_argument("--warmup", type=int, default=None, help="default 200 (quick 60)")
    p.add_argument(
        "--sizes", default="256,1024", help="concurrent requests, one run each"
    )
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    p.add_argument(
        "--profile",
        default="reserve+lateral",
        help="guarded variant to profile after the timing ('' for none)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 40)
    chunk = args.chunk or (20 if args.quick else 50)
    warmup = args.warmup or (60 if args.quick else 200)
    setup()
    names = [n for n in args.variants.split(",") if n]
    for size in (int(n) for n in args.sizes.split(",") if n):
        print(
            f"# overhead: {size} concurrent requests, {rounds} rounds x "
            f"{chunk} steps per variant after {warmup} warm-up steps; {machine()}"
        )
        print(report(run(names, rounds, chunk, warmup, size)))
        if args.profile:
            print(f"\n# the guard's own frames, {args.profile}, {size} concurrent:")
            print(guard_profile(args.profile, size, warmup, chunk * 2))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
