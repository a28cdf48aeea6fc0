"""Shared fixtures: everything here drives vLLM's real scheduler on the CPU."""

from __future__ import annotations

from vllm_mooncake.offline import prepare_offline_env

prepare_offline_env()

# What vLLM does in every process at start-up: load the general plugin.
from vllm_mooncake.plugin import register  # noqa: E402

register()


def pytest_report_header() -> str:
    """Name the vLLM under test (tests/test_older_vllm.py reads it)."""
    from vllm_mooncake.compat.versions import installed_vllm_version

    return f"vLLM {installed_vllm_version()}"
