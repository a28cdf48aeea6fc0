"""The public surface: what users and other tools may import, and nothing else.

Each public module declares ``__all__``; this test pins it, so a name that
disappears or appears is a decision made in review, not by accident.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "vllm_mooncake": {
        "CONNECTOR_MODULE",
        "CONNECTOR_NAME",
        "LOGGER_ROOT",
        "__version__",
        "logger_for",
        "names_guard_connector",
    },
    "vllm_mooncake.plugin": {
        "ASYNC_SCHEDULER",
        "SYNC_SCHEDULER",
        "check_scheduler_cls",
        "configure_for_guard",
        "register",
        "select_scheduler",
        "uses_guard_connector",
        "validate_guard_config",
    },
    "vllm_mooncake.guard.connector": {"WedgeGuardConnector"},
    "vllm_mooncake.guard.scheduler": {
        "WedgeGuardAsyncScheduler",
        "WedgeGuardMixin",
        "WedgeGuardScheduler",
    },
    "vllm_mooncake.guard.scheduler_side": {
        "GuardSchedulerSide",
        "StepObservation",
        "UNROUTABLE",
    },
    "vllm_mooncake.guard.config": {
        "DEFAULT_POLICY",
        "GuardConfig",
        "GuardConfigError",
        "POLICY_NAMES",
        "Policy",
        "validate_children",
    },
    "vllm_mooncake.compat.versions": {
        "SUPPORTED_VLLM",
        "UnsupportedVllmVersion",
        "check_vllm_version",
        "installed_vllm_dist_version",
        "installed_vllm_version",
        "series",
    },
    "vllm_mooncake.compat.servers": {"PREFIX_HASH_SEED", "ServerFacts", "server_facts"},
    "vllm_mooncake.tools.check_config": {
        "ConfigCheckError",
        "check",
        "check_kv_transfer_config",
        "load",
        "main",
    },
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_public_module_exports_exactly_its_surface(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert set(module.__all__) == PUBLIC[module_name]
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names what it lacks: {missing}"


def test_the_connector_name_users_write_resolves_to_the_guard_connector() -> None:
    import vllm_mooncake
    from vllm_mooncake.guard.connector import WedgeGuardConnector

    module = importlib.import_module(vllm_mooncake.CONNECTOR_MODULE)
    assert getattr(module, vllm_mooncake.CONNECTOR_NAME) is WedgeGuardConnector


def test_the_plugin_names_the_guarded_schedulers_by_their_real_paths() -> None:
    from vllm_mooncake import plugin
    from vllm_mooncake.guard import scheduler

    for path, cls in (
        (plugin.SYNC_SCHEDULER, scheduler.WedgeGuardScheduler),
        (plugin.ASYNC_SCHEDULER, scheduler.WedgeGuardAsyncScheduler),
    ):
        module, _, name = path.rpartition(".")
        assert getattr(importlib.import_module(module), name) is cls
