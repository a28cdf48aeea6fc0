"""Shared fixtures: everything here drives vLLM's real scheduler on the CPU."""

from __future__ import annotations

import pytest

from vllm_mooncake.testing import prepare_offline_env

prepare_offline_env()


@pytest.fixture(autouse=True, scope="session")
def _offline_env() -> None:
    prepare_offline_env()
