"""The conformance tier: vLLM's own scheduler and KV-connector unit tests,
run stock and with the wedge guard swapped in, compared per test.

Usage: ``python tests/conformance/run.py`` (``make conformance``). Steps:

1. fetch vLLM's tests from the installed release's sdist (cached in
   ``.cache/conformance``) and write the offline model stand-ins;
2. run :data:`SCOPE` stock, then guarded (``conformance_plugin.py``);
3. rerun the tests whose outcome differs in ``control`` mode (MultiConnector
   without the guard), to tell the guard's differences from the wrapping's;
4. check the differences against ``known_differences.toml`` (``check.py``).

Exit status 0 when every difference is listed and every entry still occurs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from check import (  # noqa: E402
    Difference,
    check,
    differences,
    load_entries,
    load_run,
)
from fetch import ensure_vllm_tests  # noqa: E402
from offline_models import ensure_hub_cache  # noqa: E402

# vLLM's tests in scope, relative to the sdist root.
SCOPE = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_priority_scheduler_random.py",
    "tests/v1/core/test_prefix_replay.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_swa_inflight_window_free.py",
    "tests/v1/core/test_worker_slot_overflow.py",
    "tests/v1/kv_connector/unit/test_multi_connector.py",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    "tests/v1/kv_connector/unit/test_error_propagation.py",
    "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py",
    "tests/v1/kv_connector/unit/test_scheduler_kv_connector_override.py",
)
KNOWN = HERE / "known_differences.toml"
# pytest exit codes that mean "the session ran" (1: some tests failed).
_RAN = (0, 1)


# vLLM general plugins allowed to load (``VLLM_PLUGINS``). Only the guarded
# run loads this project's; every run allows the fake plugin that vLLM's
# test_scheduler_kv_connector_override.py loads through the entry-point path.
VLLM_TEST_PLUGINS = ("dummy_kv_connector_plugin",)


def _plugins(mode: str) -> tuple[str, ...]:
    return (("vllm_mooncake",) if mode == "guard" else ()) + VLLM_TEST_PLUGINS


def _env(mode: str, out: Path, cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CONFORMANCE_MODE=mode,
        CONFORMANCE_OUT=str(out),
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(cache / "hf-hub"),
        VLLM_CACHE_ROOT=str(REPO / ".cache" / "vllm"),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_PLUGINS=",".join(_plugins(mode)),
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
    )
    return env


def run_pytest(mode: str, targets: list[str], src: Path, cache: Path) -> Path:
    """Run ``targets`` in ``mode``; returns the outcome file."""
    out = cache / "results" / f"{mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(HERE / "pytest.ini"),
        "--rootdir",
        str(src),
        "--confcutdir",
        str(src),
        "-p",
        "conformance_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "--tb=no",
        "--no-header",
        "-rN",
        *targets,
    ]
    started = time.monotonic()
    result = subprocess.run(command, cwd=src, env=_env(mode, out, cache))
    print(f"[conformance] {mode}: {time.monotonic() - started:.0f} s wall")
    if result.returncode not in _RAN or not out.exists():
        raise SystemExit(
            f"[conformance] {mode} run failed (pytest {result.returncode})"
        )
    return out


def _report(diffs: list[Difference], problems: list[str]) -> None:
    print(f"[conformance] {len(diffs)} difference(s) from stock:")
    for diff in diffs:
        print(f"  {diff.test}: {diff.stock} -> {diff.guard}")
    for problem in problems:
        print(f"[conformance] FAIL {problem}")


def _unused_skips(stock_out: Path) -> list[str]:
    import json

    unused: list[str] = json.loads(stock_out.read_text())["unused_skips"]
    return [f"skip entry matches no test: {test}" for test in unused]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="*", help="node ids or files (default: SCOPE)")
    args = parser.parse_args(argv)
    cache = REPO / ".cache" / "conformance"
    src = ensure_vllm_tests(cache)
    ensure_hub_cache(cache / "hf-hub")
    targets = args.tests or list(SCOPE)
    stock_out = run_pytest("stock", targets, src, cache)
    guard_out = run_pytest("guard", targets, src, cache)
    diffs = differences(load_run(stock_out), load_run(guard_out))
    control = {}
    if diffs:
        control_out = run_pytest("control", [d.test for d in diffs], src, cache)
        control = load_run(control_out)
    whole = not args.tests  # staleness is only known over the whole scope
    problems = check(diffs, load_entries(KNOWN), control, stale=whole)
    if whole:
        problems += _unused_skips(stock_out)
    _report(diffs, problems)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
