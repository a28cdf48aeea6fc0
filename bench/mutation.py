"""Mutation testing of the guard (``vllm_mooncake/guard/``) with mutmut.

A benchmark, not a CI step: it takes tens of minutes on 2 cores. mutmut
(``pip install mutmut``; 3.x) changes the guard one small edit at a time
(an operator, a constant, a condition, a dropped call) and runs the tests
that cover the changed function; a mutant no test fails *survives*.
``bench/RESULTS.md`` (section "Mutation testing") lists every survivor,
each killed by a test added since or explained as equivalent.

The run happens in a scratch copy (``.cache/mutation/``): mutmut writes its
``mutants/`` tree next to the sources and reads its settings from
``setup.cfg``, and the working tree stays untouched. The tests it runs are
the fast unit and property tests of the guard (``TESTS`` below; property
tests at ``VLLM_MOONCAKE_PROPERTY_EXAMPLES=25``). ::

    python bench/mutation.py                      # every file of guard/
    python bench/mutation.py --only ledger.py scheduler.py
    python bench/mutation.py --report             # survivors of the last run, diffs
    python bench/mutation.py --only ledger.py --mutants NAME ...  # re-check some
    python bench/mutation.py --keep --mutants 'vllm_mooncake.guard.valve.*'
    python bench/mutation.py --summary            # per module, from the last run

``--keep`` reuses the scratch copy and its results (the tests are copied
again, new tests are traced by mutmut); with ``--mutants`` it re-checks
those (``*`` globs), without it it runs the mutants not run yet. Survivors
are re-checked this way after a test is added for them. ``--summary``
prints killed / survived / no tests / timeouts per file of guard/ and the
test time mutmut spent on each (its own per-mutant durations).

Exit code 0 when the run completed (survivors are reported, not failed on).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "mutation"
MUTMUT = Path(sys.executable).parent / "mutmut"
# Fast tests that exercise the guard on vLLM's real scheduler.
TESTS = (
    "tests/test_ledger.py",
    "tests/test_scheduler_side.py",
    "tests/test_guard_scheduler_rules.py",
    "tests/test_guard_wedges.py",
    "tests/test_invariants_catch_broken_guards.py",
    "tests/test_properties.py",
    "tests/test_child_faults.py",
    "tests/test_load_retry_budget.py",
    "tests/test_vllm_state_wins.py",
    "tests/test_routing_real_children.py",
    "tests/test_hma_finish_real_children.py",
    "tests/test_guard_mutants.py",
    "tests/test_metrics.py",
    "tests/test_guard_pins.py",
    "tests/test_config_and_plugin.py",
    "tests/test_check_config.py",
    "tests/test_guard_mutants_rooms.py",
    "tests/test_dead_senders.py",
    "tests/test_guard_mutants_connector.py",
)
SUPPORT = ("tests/conftest.py",)


def copy_tests() -> None:
    (WORK / "tests").mkdir(exist_ok=True)
    for name in TESTS + SUPPORT:
        shutil.copy2(ROOT / name, WORK / name)


def prepare(only: Sequence[str]) -> None:
    """A scratch copy of the package and the tests, with mutmut's settings."""
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    shutil.copytree(
        ROOT / "vllm_mooncake",
        WORK / "vllm_mooncake",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    copy_tests()
    # The whole package goes to mutmut's tree (the tests import all of it);
    # only guard/ is mutated.
    only_mutate = "".join(f"\n    vllm_mooncake/guard/{f}" for f in only or ["*"])
    (WORK / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths = vllm_mooncake/\n"
        f"only_mutate ={only_mutate}\n"
        + "pytest_add_cli_args_test_selection =\n"
        + "".join(f"    {t}\n" for t in TESTS)
        + "pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -q\n"
        # A mutant that loops (the valve retrying without spending its
        # budget) would hold a core for (tests' time + 1) * 15 * 2 s.
        + "timeout_multiplier = 1.5\n"
        "\n[tool:pytest]\n"
        "filterwarnings =\n    ignore::DeprecationWarning\n    ignore::FutureWarning\n"
    )


def run(max_children: int, mutants: Sequence[str] = ()) -> int:
    env = {**os.environ, "VLLM_MOONCAKE_PROPERTY_EXAMPLES": "25"}
    cmd = [str(MUTMUT), "run", "--max-children", str(max_children), *mutants]
    return subprocess.call(cmd, cwd=WORK, env=env)


def report() -> str:
    """mutmut's list of surviving mutants (and each one's diff)."""
    out = subprocess.run(
        [str(MUTMUT), "results"], cwd=WORK, capture_output=True, text=True
    ).stdout
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    text = [out]
    for line in lines:
        name = line.split(":")[0]
        if "survived" in line:
            diff = subprocess.run(
                [str(MUTMUT), "show", name], cwd=WORK, capture_output=True, text=True
            ).stdout
            text.append(diff)
    return "\n".join(text)


STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests"}
STATUS.update(dict.fromkeys((36, 24, -24, 152, 255), "timeout"))


def summary() -> str:
    """Per file of guard/: the mutants by outcome (mutmut's ``.meta`` files)
    and the test time spent on them."""
    rows = ["| file | mutants | killed | survived | no tests | timeout | other | s |"]
    rows.append("|---|---|---|---|---|---|---|---|")
    for meta in sorted((WORK / "mutants/vllm_mooncake/guard").glob("*.py.meta")):
        data = json.loads(meta.read_text())
        counts = dict.fromkeys(("killed", "survived", "no tests", "timeout"), 0)
        other = 0
        for code in data["exit_code_by_key"].values():
            status = STATUS.get(code)
            if status is None:
                other += 1
            else:
                counts[status] += 1
        seconds = sum(data["durations_by_key"].values())
        name = meta.name.removesuffix(".meta")
        total = len(data["exit_code_by_key"])
        cells = " | ".join(str(v) for v in counts.values())
        rows.append(f"| {name} | {total} | {cells} | {other} | {seconds:.0f} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=[], help="files of guard/ to mutate")
    p.add_argument("--max-children", type=int, default=2)
    p.add_argument(
        "--mutants",
        nargs="*",
        default=[],
        help="run only these mutants (names as mutmut results prints them)",
    )
    p.add_argument("--report", action="store_true", help="only print the survivors")
    p.add_argument(
        "--keep", action="store_true", help="reuse the scratch copy and its results"
    )
    p.add_argument(
        "--summary", action="store_true", help="only print the per-file table"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not MUTMUT.exists():
        print(
            f"mutmut is not installed ({MUTMUT}): pip install mutmut", file=sys.stderr
        )
        return 2
    if args.summary:
        print(summary())
        return 0
    if not args.report:
        if args.keep and WORK.exists():
            copy_tests()
        else:
            prepare(args.only)
        start = time.monotonic()
        code = run(args.max_children, args.mutants)
        print(f"mutmut run: exit {code}, {time.monotonic() - start:.0f} s")
    if args.report:
        survivors = report()
        (WORK / "survivors.txt").write_text(survivors)
        print(survivors)
        print(f"survivors and their diffs: {WORK / 'survivors.txt'}")
    print(summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
