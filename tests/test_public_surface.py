"""The public surface: what users and other tools may import, and nothing else.

Each public module declares ``__all__``; this test pins it, so a name that
disappears or appears is a decision made in review, not by accident. Every
module of ``guard/`` and ``compat/`` is public this way: a new one fails
here until its ``__all__`` is pinned (``docs/architecture.md``).
"""

from __future__ import annotations

import importlib
import pkgutil

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
    "vllm_mooncake.guard": set(),
    "vllm_mooncake.guard.config": {
        "DEFAULT_POLICY",
        "GuardConfig",
        "GuardConfigError",
        "POLICY_NAMES",
        "Policy",
        "validate_children",
    },
    "vllm_mooncake.guard.connector": {"WedgeGuardConnector"},
    "vllm_mooncake.guard.containment": {
        "ALLOC",
        "ChildFault",
        "ContainedChild",
        "FINISHED",
        "LOOKUP",
    },
    "vllm_mooncake.guard.holders": {"WaitingHolders"},
    "vllm_mooncake.guard.kv_stats": {
        "DROPPED_KINDS",
        "GAUGES_CHANGED",
        "GUARD_STATS_KEY",
        "GuardKVConnectorStats",
        "guard_stats_report",
        "rebuild_guard_entry",
        "stats_carrier",
        "with_guard_report",
    },
    "vllm_mooncake.guard.ledger": {
        "BlockLedger",
        "Disagreement",
        "DroppedNotices",
        "HolderView",
        "LedgerEntry",
        "LedgerError",
        "RecvState",
        "ReqId",
        "Victim",
        "VictimReason",
        "WaitStatus",
    },
    "vllm_mooncake.guard.metrics": {
        "CHILD_ERRORS_METRIC",
        "COUNTER_METRICS",
        "DISAGREEMENT_KINDS",
        "DROPPED_RECV_NOTICES_METRIC",
        "GAUGE_METRICS",
        "GuardPromMetrics",
        "LATERAL_PREEMPTIONS_METRIC",
        "LEDGER_DISAGREEMENTS_METRIC",
        "LOAD_RETRY_CUTOFFS_METRIC",
        "QUARANTINE_RELEASES_METRIC",
        "QUARANTINE_RELEASE_REASONS",
        "RECEIVES_FAILED_METRIC",
        "RECEIVE_FAILURE_REASONS",
        "WedgeGuardPromMetrics",
    },
    "vllm_mooncake.guard.notices": {"Awaited", "BlockIdsOf", "ReceiveNotices"},
    "vllm_mooncake.guard.observer": {"GuardObserver"},
    "vllm_mooncake.guard.ownership": {
        "LoadNotStarted",
        "LoadOwnership",
        "Lookup",
        "ReceiveStarted",
        "UNROUTABLE",
    },
    "vllm_mooncake.guard.quarantine": {
        "BlockHolds",
        "Quarantine",
        "SENDER_DEAD",
        "TRANSFER_ENDED",
    },
    "vllm_mooncake.guard.receive_watch": {"FailureReason", "ReceiveWatch", "Stranded"},
    "vllm_mooncake.guard.senders": {
        "DEAD_AFTER_REFUSALS",
        "Liveness",
        "Probe",
        "Sender",
        "SenderProbes",
        "connect",
        "probe",
        "sender_of",
    },
    "vllm_mooncake.guard.stranded": {"StrandedReceives"},
    "vllm_mooncake.guard.routing": {
        "ChildRouter",
        "ClaimsTransferParams",
        "PD_CLAIM_KEYS",
        "UnroutableRequest",
        "claim_keys_of",
    },
    "vllm_mooncake.guard.scheduler": {
        "WedgeGuardAsyncScheduler",
        "WedgeGuardMixin",
        "WedgeGuardScheduler",
    },
    "vllm_mooncake.guard.scheduler_side": {"GuardSchedulerSide"},
    "vllm_mooncake.guard.stall_watch": {
        "HolderCensus",
        "Lateral",
        "StallWatch",
        "StepObservation",
    },
    "vllm_mooncake.guard.stats": {"GuardStats"},
    "vllm_mooncake.guard.valve": {"LateralValve"},
    "vllm_mooncake.compat": set(),
    "vllm_mooncake.compat.cpu": {
        "CPU_DEVICE_INDEX",
        "CompletedEvent",
        "NIXL_THREAD_NICE",
        "NIXL_WORKER_CLASS",
        "NIXL_WORKER_MODULE",
        "STORE_WORKER_MODULE",
        "apply",
        "has_accelerator",
        "is_patched",
        "patch_current_device_index",
        "patch_nixl_worker",
        "patch_store_save_fence",
        "unpatch_current_device_index",
        "unwrap_nixl_worker_init",
        "unwrap_store_worker_torch",
        "wrap_nixl_worker_init",
        "wrap_store_worker_torch",
    },
    "vllm_mooncake.compat.internals": {
        "BASELINE",
        "INTERNALS",
        "Internal",
        "applicable_internals",
        "check_internal",
        "missing_internals",
    },
    "vllm_mooncake.compat.releases": {
        "LAYOUT_BY_SERIES",
        "QueueLayout",
        "ReleaseLayout",
        "SchedulerAccess",
        "SpecDecodeBlocks",
        "installed_layout",
        "kv_output_has_failed_recving",
        "layout_of",
    },
    "vllm_mooncake.compat.servers": {"PREFIX_HASH_SEED", "ServerFacts", "server_facts"},
    "vllm_mooncake.compat.source_check": {
        "BROKEN",
        "CHANGED",
        "ClassIndex",
        "DirSource",
        "Finding",
        "MISSING",
        "OK",
        "Report",
        "Shape",
        "SourceTree",
        "WheelSource",
        "call_sites",
        "check_tree",
        "compare",
        "fetch_wheel",
        "installed_source",
        "new_state",
        "read_shape",
        "wheel_path",
    },
    "vllm_mooncake.compat.versions": {
        "SUPPORTED_VLLM",
        "UnsupportedVllmVersion",
        "check_vllm_version",
        "installed_vllm_dist_version",
        "installed_vllm_version",
        "series",
    },
    "vllm_mooncake.tools.check_config": {
        "ConfigCheckError",
        "check",
        "check_kv_transfer_config",
        "load",
        "main",
    },
}


PINNED_PACKAGES = ("vllm_mooncake.guard", "vllm_mooncake.compat")


@pytest.mark.parametrize("package", PINNED_PACKAGES)
def test_every_module_of_guard_and_compat_is_pinned(package: str) -> None:
    path = importlib.import_module(package).__path__
    modules = {package} | {f"{package}.{m.name}" for m in pkgutil.iter_modules(path)}
    assert modules <= PUBLIC.keys(), f"not pinned: {sorted(modules - PUBLIC.keys())}"


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
