"""Every simulator benchmark and the stress run, one after another.

::

    python bench/run_all.py            # full size (about an hour on 2 idle cores)
    python bench/run_all.py --quick    # small sizes (a few minutes)

Each part prints its own tables (see the scripts' docstrings): throughput
ratios and simulator speed (``throughput.py``), steps to recover from a
formed wedge (``recovery.py``), the guard's scheduler overhead
(``overhead.py``), and the stress run (``stress.py``). Exit code 1 if the
stress run lost a request, wedged or leaked under a guarded policy.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import overhead
import recovery
import stress
import throughput

PARTS: tuple[tuple[str, Callable[[Sequence[str]], int]], ...] = (
    ("throughput", throughput.main),
    ("recovery", recovery.main),
    ("overhead", overhead.main),
    ("stress", stress.main),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated parts: " + ",".join(n for n, _ in PARTS),
    )
    args = parser.parse_args(argv)
    wanted = set(args.only.split(",")) if args.only else {n for n, _ in PARTS}
    status = 0
    for name, part in PARTS:
        if name not in wanted:
            continue
        start = time.perf_counter()
        print(f"\n==== {name} ====", flush=True)
        status |= part(["--quick"] if args.quick else [])
        print(f"({name}: {time.perf_counter() - start:.0f} s wall)", flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
