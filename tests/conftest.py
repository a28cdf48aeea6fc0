"""Shared fixtures: everything here drives vLLM's real scheduler on the CPU."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from vllm_mooncake.offline import prepare_offline_env

prepare_offline_env()

# What vLLM does in every process at start-up: load the general plugin.
from vllm_mooncake.plugin import register  # noqa: E402

register()


def pytest_report_header() -> str:
    """Name the vLLM under test (tests/test_vllm_releases.py reads it)."""
    from vllm_mooncake.compat.versions import installed_vllm_version

    return f"vLLM {installed_vllm_version()}"


# The scheduler side and its rooms: the lines an operator acts on (the
# resolution WARNING, the wedge alarm, dropped notices, disagreements, the
# retry cut-off, ledger inconsistencies).
GUARD_LOGGERS = tuple(
    f"vllm.vllm_mooncake.guard.{module}"
    for module in ("scheduler_side", "ownership", "notices", "stall_watch")
)


@pytest.fixture
def guard_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture the guard's log records (its WARNING/ERROR lines), whatever
    vLLM's logging config does with propagation."""
    logs = [logging.getLogger(name) for name in GUARD_LOGGERS]
    saved = [(log.level, log.propagate) for log in logs]
    for log in logs:
        log.addHandler(caplog.handler)
        log.setLevel(logging.DEBUG)
        log.propagate = False  # records reach caplog once, through its handler
    try:
        yield caplog
    finally:
        for log, (level, propagate) in zip(logs, saved, strict=True):
            log.removeHandler(caplog.handler)
            log.setLevel(level)
            log.propagate = propagate
