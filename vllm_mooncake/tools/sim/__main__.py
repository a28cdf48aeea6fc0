"""``vllm-mooncake-sim`` (``python -m vllm_mooncake.tools.sim``): run, compare.

::

    vllm-mooncake-sim run SCENARIO [--policy P] [--seed N] [--scale F] [--out FILE]
    vllm-mooncake-sim compare SCENARIO [--policies P,P,...] [--plot FILE] [--check]
    vllm-mooncake-sim validate SCENARIO [SCENARIO ...]

SCENARIO is a file, or the name of one in the scenario library shipped with
the package (``vllm_mooncake/tools/sim/scenarios/``), from any directory.
Exit codes: 0 the runs completed (wedged or not -- a wedge is a result);
1 ``--fail-on-wedge`` saw a wedge, ``--check`` an unexpected outcome, or a
run leaked (every run ends with a drain and a leak check; the findings are
in the result's ``leaks`` and on stderr); 2 a bad scenario or command line
(the message names the field).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_mooncake.guard.config import POLICY_NAMES
from vllm_mooncake.tools.sim.errors import ScenarioError

if TYPE_CHECKING:
    from vllm_mooncake.tools.sim.compare import ProgressFactory
    from vllm_mooncake.tools.sim.results import RunResult
    from vllm_mooncake.tools.sim.scenario import Scenario

# The scenario library: package data, so an installed wheel finds it too.
SCENARIO_LIBRARY = Path(__file__).resolve().parent / "scenarios"
RESULTS_DIR = Path("results/runs")
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def resolve_scenario(name: str) -> Path:
    """A path as given, else ``<name>[.yaml]`` of the scenario library."""
    path = Path(name)
    if path.exists():
        return path
    for candidate in (SCENARIO_LIBRARY / name, SCENARIO_LIBRARY / f"{name}.yaml"):
        if candidate.exists():
            return candidate
    raise ScenarioError(
        "", f"no such scenario file (looked in {SCENARIO_LIBRARY} too)", name
    )


def _policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICY_NAMES]
    if bad or not policies:
        raise argparse.ArgumentTypeError(
            f"{','.join(bad) or text!r}: policies are {', '.join(POLICY_NAMES)}"
        )
    return policies


def _scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-mooncake-sim",
        description="PD simulator over vLLM's real scheduler (see docs/simulator.md).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("scenario", help="scenario file, or a library scenario's name")
        p.add_argument("--seed", type=int, help="override the scenario's seed")
        p.add_argument(
            "--scale", type=_scale, default=1.0, help="load and pool size factor"
        )
        p.add_argument("--no-progress", action="store_true", help="no progress line")
        p.add_argument("-v", "--verbose", action="store_true", help="vLLM's logs too")

    run = sub.add_parser("run", help="one run; writes its JSON result")
    common(run)
    run.add_argument("--policy", choices=POLICY_NAMES, help="override guard.policy")
    run.add_argument("--out", help="result file (default results/runs/...; - = stdout)")
    run.add_argument("--plot", help="also write a PNG plot of this run")
    run.add_argument(
        "--fail-on-wedge", action="store_true", help="exit 1 if the run wedged"
    )

    compare = sub.add_parser("compare", help="the scenario under several policies")
    common(compare)
    compare.add_argument(
        "--policies",
        type=_policies,
        default=None,
        help="comma-separated (default: all four)",
    )
    compare.add_argument(
        "--out-dir", help="where results go (default results/runs/NAME)"
    )
    compare.add_argument("--plot", help="PNG path (default OUT_DIR/compare.png)")
    compare.add_argument("--jobs", type=int, default=1, help="policies run in parallel")
    compare.add_argument(
        "--check", action="store_true", help="exit 1 unless the outcomes match expect"
    )

    validate = sub.add_parser("validate", help="check scenario files, run nothing")
    validate.add_argument("scenarios", nargs="+")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "validate":
            return _validate(args.scenarios)
        if not args.verbose:
            from vllm_mooncake.tools.sim.logs import quiet_vllm

            quiet_vllm()
        if args.command == "run":
            return _run(args)
        return _compare(args)
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _load(args: argparse.Namespace) -> Scenario:
    from vllm_mooncake.tools.sim.scenario import load_scenario

    scenario = load_scenario(resolve_scenario(args.scenario))
    if args.seed is not None:
        scenario = scenario.with_seed(args.seed)
    return scenario


def _validate(names: Sequence[str]) -> int:
    from vllm_mooncake.tools.sim.scenario import load_scenario

    status = EXIT_OK
    for name in names:
        try:
            scenario = load_scenario(resolve_scenario(name))
        except ScenarioError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = EXIT_BAD_INPUT
            continue
        print(f"ok: {name} ({scenario.name}, mode {scenario.mode})")
    return status


def _progress(args: argparse.Namespace) -> ProgressFactory | None:
    from vllm_mooncake.tools.sim.progress import ProgressLine

    if args.no_progress or not sys.stderr.isatty():
        return None
    return ProgressLine


def _run(args: argparse.Namespace) -> int:
    from vllm_mooncake.tools.sim.compare import describe, format_table, run_policies

    scenario = _load(args)
    if args.policy:
        scenario = scenario.with_policy(args.policy)
    [result] = run_policies(scenario, [scenario.policy], args.scale, 1, _progress(args))
    if args.out == "-":
        print(result.to_json())
    else:
        out = Path(args.out or RESULTS_DIR / scenario.name / f"{scenario.policy}.json")
        print(format_table([result]))
        for line in describe([result]):
            print(line)
        print(f"result: {result.write(out)}")
    if args.plot:
        from vllm_mooncake.tools.sim.plot import plot_results

        print(f"plot: {plot_results([result], args.plot)}")
    leaked = _report_leaks([result])
    if leaked or (args.fail_on_wedge and result.wedged):
        return EXIT_FAILED
    return EXIT_OK


def _report_leaks(results: Sequence[RunResult]) -> bool:
    """Each leak finding on stderr; True if a run leaked."""
    for result in results:
        for leak in result.leaks:
            print(f"leak: {result.policy}: {leak}", file=sys.stderr)
    return any(r.leaks for r in results)


def _compare(args: argparse.Namespace) -> int:
    from vllm_mooncake.tools.sim.compare import (
        DEFAULT_POLICIES,
        describe,
        format_table,
        mismatches,
        run_policies,
    )
    from vllm_mooncake.tools.sim.plot import plot_results

    scenario = _load(args)
    policies = args.policies or list(DEFAULT_POLICIES)
    results = run_policies(scenario, policies, args.scale, args.jobs, _progress(args))
    out_dir = Path(args.out_dir or RESULTS_DIR / scenario.name)
    for result in results:
        result.write(out_dir / f"{result.policy}.json")
    title = f"{scenario.name} (seed {scenario.seed}, scale {args.scale:g})"
    plot = plot_results(results, args.plot or out_dir / "compare.png", title)
    print(format_table(results))
    for line in describe(results):
        print(line)
    print(f"results: {out_dir}/")
    print(f"plot: {plot}")
    leaked = _report_leaks(results)
    if args.check:
        problems = mismatches(scenario, results)
        for problem in problems:
            print(f"unexpected: {problem}", file=sys.stderr)
        if problems:
            return EXIT_FAILED
    return EXIT_FAILED if leaked else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
