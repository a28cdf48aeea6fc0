"""The catalogue, the guard, the rules, the internals and a sample of the
property tests, on every vLLM release series 0.19 to 0.34.

Each release's Python package is an overlay in the project cache
(``scripts/fetch_vllm_releases.sh``, run by ``make setup``); first on
PYTHONPATH over this environment, it runs its own real scheduler, KV-cache
manager, request and MultiConnector code (``vllm_mooncake/testing/overlays.py``
says how, and what each release needs). No two consecutive series have the
same scheduler and KV-cache files (docs/release-survey.md, section 2), so
each series runs on its own; the installed 0.32 runs in the main test run.

What must have passed on each release, beyond "nothing failed", follows from
the catalogue (``WedgeScenario.wedges_on``): stock stalls and the guard
recovers on every wedge that release has, and every internal its layout
relies on is present -- by name, so a release that moves one fails naming it.

``VLLM_MOONCAKE_RELEASES`` (comma-separated versions) runs a subset.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from vllm_mooncake.compat.internals import INTERNALS
from vllm_mooncake.compat.versions import check_vllm_version
from vllm_mooncake.testing.overlays import RELEASES, overlay_missing, run_on, series_of
from vllm_mooncake.testing.wedges import CATALOGUE

pytestmark = pytest.mark.releases

STATS_PATH = [
    f"tests/test_metrics.py::{name}"
    for name in (
        "test_w1_lateral_preemption_reaches_prometheus",
        "test_w1_through_vllm_prometheus_stat_logger",
        "test_each_step_carries_what_the_guard_did_in_it",
    )
]
FILES = [
    "tests/test_internals.py",
    "tests/test_driver.py",
    "tests/test_stock_wedges.py",
    "tests/test_guard_wedges.py",
    "tests/test_guard_scheduler_rules.py",
    "tests/test_parked_reservations.py",
    "tests/test_properties.py",
    # The real guard against every invariant; the checker's own "this broken
    # guard is caught" tests are calibrated on the installed 0.32 (several
    # break a mechanism an older release does not have, e.g. the async-load
    # reservation before 0.23).
    REAL_GUARD := (
        "tests/test_invariants_catch_broken_guards.py"
        "::test_the_real_guard_passes_every_check"
    ),
    "tests/test_invariants_catch_broken_guards.py"
    "::test_generated_runs_pass_the_policy_checks_on_the_real_guard",
    "tests/test_invariants_catch_broken_guards.py"
    "::test_a_re_admitted_victim_hits_what_it_had_cached",
    # The guard's stats through the release's own codec and front-end
    # loggers: the payload shape (to_dict from 0.30) and the cadence (vLLM
    # asks every step from 0.24) differ by release.
    *STATS_PATH,
]
# Generated runs per property on the other releases (the full count runs on
# the installed 0.32): a sample, to keep the tier within CI's budget.
PROPERTY_EXAMPLES = os.environ.get("VLLM_MOONCAKE_RELEASE_PROPERTY_EXAMPLES", "30")

_chosen = os.environ.get("VLLM_MOONCAKE_RELEASES")
OTHER_RELEASES = [
    v
    for v in RELEASES
    if series_of(v) != check_vllm_version() and (not _chosen or v in _chosen.split(","))
]

GUARD_CASES = {  # scenario -> the guarded policies tests/test_guard_wedges.py runs
    "seed": ["lateral"],
    "w1": ["reserve+lateral", "lateral"],
    "w2": ["reserve+lateral"],
    "hol": ["reserve+lateral", "lateral"],
}


def expected(version: str) -> list[str]:
    """Test ids that must have PASSED on ``version``."""
    series = series_of(version)
    out = []
    for name, scenario in CATALOGUE.items():
        out.append(rf"test_stock_scheduler_wedges_where_the_release_does\[{name}-")
        if series in scenario.wedges_on or name == "seed":
            for policy in GUARD_CASES[name]:
                case = re.escape(f"[{name}-{policy}-sync]")
                out.append(
                    rf"test_unguarded_policy_stalls_guarded_policy_recovers{case}"
                )
    for item in INTERNALS:
        if item.applies_to(series):
            owner = item.owner.rsplit(".", 1)[1]
            out.append(rf"test_internal_is_present\[{re.escape(owner)}\.{item.name}\]")
    out.append(r"test_generated_runs_keep_every_invariant")
    out += [re.escape(path.split("::")[1]) for path in STATS_PATH]
    if series == "0.34":
        out.append(
            r"test_leak_check_catches_a_guard_that_forgets_the_parked_reservation"
        )
    return [p + r".* PASSED" for p in out]


# Releases run this many at a time: each run is one single-threaded pytest
# process, so on 2 cores two side by side take about half the time.
WORKERS = int(os.environ.get("VLLM_MOONCAKE_RELEASE_WORKERS", "2"))


def _run_files(version: str) -> subprocess.CompletedProcess[str]:
    """:data:`FILES` on ``version``'s overlay, in a pytest of its own."""
    deselect = []
    if series_of(version) not in CATALOGUE["w2"].wedges_on:
        # It asserts the valve acts on W2, which needs the async-load
        # reservation (0.23+): before, W2's layout is no wedge to act on.
        deselect = ["--deselect", f"{REAL_GUARD}[w2-reserve+lateral]"]
    return run_on(
        version,
        ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:logging"]
        + FILES
        + deselect,
        VLLM_MOONCAKE_PROPERTY_EXAMPLES=PROPERTY_EXAMPLES,
    )


@functools.cache
def _runs() -> dict[str, Future[subprocess.CompletedProcess[str]]]:
    """Every chosen release's run, started on first use, :data:`WORKERS` at
    a time, in the order the tests ask for them."""
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="release")
    runs = {
        v: pool.submit(_run_files, v) for v in OTHER_RELEASES if not overlay_missing(v)
    }
    pool.shutdown(wait=False)
    return runs


@pytest.mark.parametrize("version", OTHER_RELEASES)
def test_catalogue_guard_rules_and_internals_on_release(version: str) -> None:
    missing = overlay_missing(version)
    assert missing is None, missing
    proc = _runs()[version].result()
    tail = "\n".join(proc.stdout.splitlines()[-30:])
    assert proc.returncode == 0, f"tests failed on vLLM {version}:\n{tail}"
    assert f"vLLM {version}" in proc.stdout, "the subprocess ran another vLLM"
    for pattern in expected(version):
        assert re.search(pattern, proc.stdout), f"{pattern!r} did not pass"
