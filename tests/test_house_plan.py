"""The house plan's import contracts pass, and fail when the plan is broken.

``make lint`` runs ``lint-imports`` over the contracts in ``pyproject.toml``.
Here the same contracts run on copies of the package with one rule broken
at a time, to show that each kind of break is caught.
"""

from __future__ import annotations

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
    shutil.copytree(
        ROOT / "vllm_mooncake",
        tmp_path / "vllm_mooncake",
        ignore=shutil.ignore_patterns("__pycache__", "*.yaml"),
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
