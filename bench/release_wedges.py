"""Which wedges each vLLM release has: release x {seed, HOL, W1, W2} x
{stock with default config, stock with the wedge's config, guarded}.

Every cell is measured on that release's own code: one subprocess per
release, with the release's overlay first on PYTHONPATH
(``vllm_mooncake/testing/overlays.py``; ``scripts/fetch_vllm_releases.sh``
fetches them). In each, the catalogue's layouts (``testing/wedges.py``) are
played on vLLM's real scheduler under vLLM's own MultiConnector (stock), and
under the guard connector with its default policy (guarded), for 200 steps:

- ``wedge``: nothing scheduled for the last 190 steps, nothing running, a
  recv-done request stranded -- for good;
- ``ok``: every request ended (finished, or failed its load under ``fail``);
- ``ok, N lateral``: the guard had to undo N admissions to get there;
- anything else is printed as it is (e.g. ``stalled``: unfinished, not a wedge).

"Default config" is vLLM's: FCFS, full-ISL admission check,
``kv_load_failure_policy=fail``; the wedge's config is the scenario's
(W1: priority + ``scheduler_reserve_full_isl=False``; W2: ``recompute``;
seed and HOL need none, so both stock columns match there)::

    python bench/release_wedges.py                 # every release, 0.19-0.34
    python bench/release_wedges.py 0.30.0 0.34.0   # some
    python bench/release_wedges.py --record        # also update docs/supported-vllm.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS = 200
ORDER = ("seed", "hol", "w1", "w2")
LABEL = {"seed": "seed", "hol": "HOL", "w1": "W1", "w2": "W2"}
COLUMNS = ("defaults", "own-config", "guarded")
TABLE_PAGE = ROOT / "docs" / "supported-vllm.md"  # its release-wedges block
BEGIN, END = "<!-- release-wedges:begin -->", "<!-- release-wedges:end -->"


# ---- in the release's own interpreter ------------------------------------------
def measure_here() -> dict[str, dict[str, str]]:
    """Every cell for the installed (overlaid) release."""
    from vllm_mooncake.plugin import register

    register()  # what vLLM does at start-up: the guard connector's name
    from vllm_mooncake.testing.configs import guarded, scripted_multi
    from vllm_mooncake.testing.driver import SchedulerDriver
    from vllm_mooncake.testing.wedges import CATALOGUE, WedgeScenario, play

    def outcome(d: SchedulerDriver, scenario: WedgeScenario) -> str:
        if not d.scheduler.has_requests() and set(d.finished) == {
            a.req_id for a in scenario.arrivals
        }:
            stats = getattr(d.scheduler, "wedge_guard", None)
            n = stats.stats.total_lateral_preemptions if stats else 0
            return f"ok, {n} lateral" if n else "ok"
        sched = d.scheduler
        if (
            d.zero_token_streak() >= STEPS - 10
            and not sched.running
            and scenario.stranded in sched.finished_recving_kv_req_ids
        ):
            return "wedge"
        return "stalled"

    def run(scenario: WedgeScenario, guard: bool) -> str:
        policy = scenario.kv_load_failure_policy
        ktc = guarded(kv_load_failure_policy=policy) if guard else None
        ktc = ktc or scripted_multi(kv_load_failure_policy=policy)
        d = SchedulerDriver.build(scenario.shape, ktc)
        play(d, scenario, max_steps=STEPS)
        return outcome(d, scenario)

    table = {}
    for name in ORDER:
        scenario = CATALOGUE[name]
        table[name] = {
            "defaults": run(scenario.with_default_config(), guard=False),
            "own-config": run(scenario, guard=False),
            "guarded": run(scenario, guard=True),
        }
    return table


# ---- the driver: one subprocess per release ---------------------------------------
def measure(version: str) -> tuple[str, dict[str, dict[str, str]] | str, float]:
    from vllm_mooncake.testing.overlays import overlay_missing, run_on

    began = time.time()
    missing = overlay_missing(version)
    if missing:
        return version, missing, 0.0
    proc = run_on(version, [str(Path(__file__)), "--here"], timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return version, f"failed: {proc.stderr.strip()[-400:]}", time.time() - began
    return version, json.loads(lines[-1]), time.time() - began


def markdown(results: list[tuple[str, dict[str, dict[str, str]] | str, float]]) -> str:
    title = {
        "defaults": "stock, defaults",
        "own-config": "stock, its config",
        "guarded": "guarded",
    }
    head = ["vLLM"] + [f"{title[c]}: {LABEL[n]}" for c in COLUMNS for n in ORDER]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]

    def cell(text: str) -> str:
        return "**wedge**" if text == "wedge" else text

    for version, table, _ in results:
        if isinstance(table, str):
            lines.append(f"| {version} | {table} |")
            continue
        row = [version] + [cell(table[name][c]) for c in COLUMNS for name in ORDER]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def record(text: str) -> None:
    current = TABLE_PAGE.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN not in current:
        raise SystemExit(f"{TABLE_PAGE} has no {BEGIN} ... {END} block to update")
    pattern = re.escape(BEGIN) + ".*?" + re.escape(END)
    TABLE_PAGE.write_text(re.sub(pattern, lambda _: block, current, flags=re.S))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--here", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.here:
        print(json.dumps(measure_here()))
        return 0
    from vllm_mooncake.testing.overlays import RELEASES

    versions = args.versions or list(RELEASES)
    if args.record and versions != list(RELEASES):
        parser.error("--record rewrites the whole table: measure every release")
    began = time.time()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(measure, versions))
    text = markdown(results)
    print(text)
    print(
        f"\n{len(versions)} releases in {time.time() - began:.0f} s "
        f"({', '.join(f'{v} {t:.0f} s' for v, _, t in results)})",
        file=sys.stderr,
    )
    if args.record:
        record(text)
    return 0 if all(isinstance(t, dict) for _, t, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
