"""The house plan's contracts pass, and fail when the plan is broken.

``make lint`` runs ``lint-imports`` over the contracts in ``pyproject.toml``:
the import layers, the rooms of ``guard/``, the plain modules, no cycles,
and no private reach into ``guard/`` (a contract of our own,
``vllm_mooncake/testing/private_reach.py``). Here the same contracts run on
copies of the package with one rule broken at a time, to show that each
kind of break is caught. The size rules of ``guard/``'s rooms
(``docs/architecture.md``) are checked here directly.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for tree in ("vllm_mooncake", "bench"):  # bench: the private-reach rule reads it
        shutil.copytree(
            ROOT / tree,
            tmp_path / tree,
            ignore=shutil.ignore_patterns("__pycache__", "*.yaml", "*.png"),
        )
    return tmp_path


def _append(tree: Path, module: str, line: str) -> None:
    path = tree / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")


needs_lint_imports = pytest.mark.skipif(
    not LINT_IMPORTS.exists(), reason="import-linter is in the test extra"
)


@needs_lint_imports
def test_the_repository_keeps_every_contract(tmp_path: Path) -> None:
    result = _lint(_copy(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


BREAKS = {
    "guard imports the simulator": (
        "vllm_mooncake.guard.ledger",
        "import vllm_mooncake.tools.sim.scenario",
        "Layers",
    ),
    "product imports a test double": (
        "vllm_mooncake.plugin",
        "import vllm_mooncake.testing.leaks",
        "The product never imports",
    ),
    "the ledger imports vLLM": (
        "vllm_mooncake.guard.ledger",
        "import vllm.config",
        "Plain modules",
    ),
    "an import circle inside guard": (
        "vllm_mooncake.guard.config",
        "import vllm_mooncake.guard.scheduler",
        "No import cycles",
    ),
    "a room of the scheduler side imports the valve": (
        "vllm_mooncake.guard.ownership",
        "import vllm_mooncake.guard.valve",
        "Rooms of guard/",
    ),
    "two rooms of the scheduler side know each other": (
        "vllm_mooncake.guard.notices",
        "import vllm_mooncake.guard.stall_watch",
        "Rooms of guard/",
    ),
    "the stall watch imports vLLM": (
        "vllm_mooncake.guard.stall_watch",
        "import vllm.config",
        "Plain modules",
    ),
    "a test double reads a private attribute of guard/": (
        "vllm_mooncake.testing.invariants",
        "budget = lambda scheduler: scheduler.guard_valve._budget",
        "No private reach",
    ),
    "the simulator names a private method of guard/": (
        "vllm_mooncake.tools.sim.rank",
        "HOOKS = ('_may_preempt_for',)",
        "No private reach",
    ),
    "a benchmark imports a private name of guard/": (
        "bench.overhead_hooks",
        "from vllm_mooncake.guard.scheduler import _reports_loads",
        "No private reach",
    ),
}


@needs_lint_imports
@pytest.mark.parametrize("case", sorted(BREAKS))
def test_a_broken_plan_is_caught_by_name(tmp_path: Path, case: str) -> None:
    module, line, contract = BREAKS[case]
    tree = _copy(tmp_path)
    _append(tree, module, line)
    result = _lint(tree)
    assert result.returncode != 0
    assert _verdict(result.stdout, contract) == "BROKEN", result.stdout


def _verdict(report: str, contract: str) -> str:
    """KEPT or BROKEN for the contract whose name starts with ``contract``
    (lint-imports wraps long lines, so words are rejoined first)."""
    text = " ".join(report.split())
    after = text[text.index(contract) :]
    kept, broken = after.find(" KEPT"), after.find(" BROKEN")
    return "BROKEN" if broken != -1 and (kept == -1 or broken < kept) else "KEPT"


# ---- the rooms of guard/ stay small ---------------------------------------------
GUARD = ROOT / "vllm_mooncake" / "guard"
MAX_PUBLIC_METHODS = 12
MAX_LINES = 400
# One method per state change, one per vLLM hook: long by design.
WIDE_CLASSES = {"BlockLedger", "ContainedChild"}
LONG_MODULES = {"ledger.py"}


def _public_methods(cls: ast.ClassDef) -> set[str]:
    return {
        n.name
        for n in cls.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and not n.name.startswith("_")
    }


def test_no_class_of_guard_has_more_than_twelve_public_methods() -> None:
    wide = {}
    for path in sorted(GUARD.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in WIDE_CLASSES:
                methods = _public_methods(node)
                if len(methods) > MAX_PUBLIC_METHODS:
                    wide[f"{path.name}:{node.name}"] = sorted(methods)
    assert not wide, wide


def test_no_module_of_guard_but_the_ledger_exceeds_400_lines() -> None:
    long = {
        path.name: n
        for path in sorted(GUARD.glob("*.py"))
        if path.name not in LONG_MODULES
        and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long
