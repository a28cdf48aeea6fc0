"""Run many generated cases of the guarded scheduler and check every invariant.

The same case space as ``tests/test_properties.py`` (``draw_case`` over a
seeded ``random.Random``: case ``i`` of seed ``S`` is always the same case),
the same runner and checks (``vllm_mooncake.testing.cases.run_case``), on
vLLM's real scheduler, in ``--workers`` processes::

    python bench/property_run.py --cases 100000 --workers 2
    python bench/property_run.py --cases 100000 --minutes 15   # stop early
    python bench/property_run.py --replay case.json             # one case

A failing case is written as JSON to ``--failures`` (replay it with
``--replay``); the summary gives the count run, failures by invariant and
how often the interesting things happened (lateral preemptions, aborts mid-
wedge, stray notices, failed loads, valve-less wedges). Exit code 1 if any
case failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _setup() -> None:
    # The guard logs a WARNING per resolved wedge and vLLM an ERROR per failed
    # load: thousands of lines; the checks report what matters.
    logging.disable(logging.ERROR)
    from vllm_mooncake.plugin import register

    register()


def _run_chunk(job: tuple[int, int, int, float, int]) -> dict[str, Any]:
    """Run cases [start, stop) of ``seed``; stop at ``deadline`` (epoch s)."""
    seed, start, stop, deadline, max_requests = job
    from vllm_mooncake.testing.cases import RandomDraw, draw_case, run_case
    from vllm_mooncake.testing.invariants import InvariantViolation

    seen: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    ran = 0
    for i in range(start, stop):
        if time.time() > deadline:
            break
        case = draw_case(RandomDraw(f"{seed}:{i}"), max_requests=max_requests)
        ran += 1
        seen[f"policy {case.policy}"] += 1
        try:
            result = run_case(case)
        except InvariantViolation as exc:
            failures.append(_failure(i, exc.invariant, str(exc), case.to_json()))
            continue
        except Exception as exc:  # vLLM's own asserts, driver errors
            failures.append(_failure(i, type(exc).__name__, repr(exc), case.to_json()))
            continue
        seen["steps"] += result.steps
        seen["lateral preemptions"] += result.laterals
        seen["cases with a lateral preemption"] += bool(result.laterals)
        seen["cases with an abort mid-wedge"] += bool(result.mid_wedge_aborts)
        seen["cases with stray receive notices"] += bool(result.notices_injected)
        seen["cases where a failed load ended a request"] += bool(result.errored)
        seen["cases wedged without the valve (aborted)"] += result.wedged
        seen["cases with a child connector raising in a hook"] += any(
            r.load is not None and bool(r.load.raise_in) for r in case.requests
        )
    return {"ran": ran, "seen": seen, "failures": failures}


def _failure(index: int, invariant: str, message: str, case: str) -> dict[str, Any]:
    return {"index": index, "invariant": invariant, "message": message, "case": case}


def run(args: argparse.Namespace) -> int:
    deadline = time.time() + args.minutes * 60 if args.minutes else float("inf")
    chunk = 200
    jobs = [
        (args.seed, start, min(start + chunk, args.cases), deadline, args.max_requests)
        for start in range(0, args.cases, chunk)
    ]
    began = time.time()
    ran = 0
    seen: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    with multiprocessing.get_context("spawn").Pool(
        args.workers, initializer=_setup
    ) as pool:
        for out in pool.imap_unordered(_run_chunk, jobs):
            ran += out["ran"]
            seen.update(out["seen"])
            failures += out["failures"]
            if args.progress and ran and ran % (chunk * 10) == 0:
                print(f"  {ran} cases, {len(failures)} failed", flush=True)
    elapsed = time.time() - began
    _report(args, ran, elapsed, seen, failures)
    return 1 if failures else 0


def _report(
    args: argparse.Namespace,
    ran: int,
    elapsed: float,
    seen: Counter[str],
    failures: list[dict[str, Any]],
) -> None:
    by_invariant = Counter(f["invariant"] for f in failures)
    print(
        f"property run: seed {args.seed}, {ran} of {args.cases} cases in "
        f"{elapsed:.0f} s on {args.workers} worker(s) "
        f"({1000 * elapsed * args.workers / max(ran, 1):.1f} ms/case/worker)"
    )
    outcome = (
        "all invariants held"
        if not failures
        else "FAILED: " + ", ".join(f"{k} x{n}" for k, n in by_invariant.items())
    )
    print(f"outcome: {outcome}")
    for key in sorted(seen):
        print(f"  {key}: {seen[key]}")
    if failures:
        out = Path(args.failures)
        out.mkdir(parents=True, exist_ok=True)
        for f in failures:
            path = out / f"seed{args.seed}-case{f['index']}-{f['invariant']}.json"
            path.write_text(f["case"])
            first = f["message"].splitlines()[:3]
            print(f"  case {f['index']} ({f['invariant']}): {' / '.join(first)}")
            print(f"    replay: python bench/property_run.py --replay {path}")


def replay(path: str) -> int:
    _setup()
    logging.disable(logging.NOTSET)
    from vllm_mooncake.testing.cases import Case, run_case

    case = Case.from_json(Path(path).read_text())
    print(json.dumps(json.loads(case.to_json()), indent=1))
    print(run_case(case))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=0, help="stop after")
    parser.add_argument("--max-requests", type=int, default=6)
    parser.add_argument("--failures", default=str(ROOT / ".cache/property-failures"))
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--replay", help="run one case from a JSON file")
    args = parser.parse_args(argv)
    if args.replay:
        return replay(args.replay)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
