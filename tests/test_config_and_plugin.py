"""Start-up: configuration errors, plugin registration, scheduler selection."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_mooncake.guard.config import (
    GuardConfig,
    GuardConfigError,
    Policy,
    validate_children,
)
from vllm_mooncake.guard.scheduler import (
    WedgeGuardAsyncScheduler,
    WedgeGuardMixin,
    WedgeGuardScheduler,
)
from vllm_mooncake.plugin import ASYNC_SCHEDULER, register
from vllm_mooncake.testing.configs import guarded, scripted_child, scripted_multi
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver, make_vllm_config


def test_defaults() -> None:
    config = GuardConfig.from_extra_config({"connectors": []})
    assert config.policy is Policy.RESERVE_LATERAL
    assert config.max_attempts == 16
    assert config.gauge_interval_s == 0.1
    every_step = GuardConfig.from_extra_config({"wedge_guard": {"gauge_interval_s": 0}})
    assert every_step.gauge_interval_s == 0.0


@pytest.mark.parametrize(
    ("section", "field", "hint"),
    [
        ({"policy": "greedy"}, "wedge_guard.policy", "use one of"),
        ({"max_attempts": 0}, "wedge_guard.max_attempts", "use 1..1024"),
        ({"max_attempts": 5000}, "wedge_guard.max_attempts", "use 1..1024"),
        ({"max_attempts": "16"}, "wedge_guard.max_attempts", "expected an integer"),
        ({"max_attempts": True}, "wedge_guard.max_attempts", "expected an integer"),
        ({"only_when_idle": "yes"}, "wedge_guard.only_when_idle", "true or false"),
        ({"stall_alarm_steps": -1}, "wedge_guard.stall_alarm_steps", "out of range"),
        ({"stall_alarm_s": 0}, "wedge_guard.stall_alarm_s", "use 0.01..86400"),
        ({"stall_alarm_s": "10s"}, "wedge_guard.stall_alarm_s", "number of seconds"),
        ({"gauge_interval_s": -1}, "wedge_guard.gauge_interval_s", "use 0..86400"),
        ({"polcy": "lateral"}, "wedge_guard.polcy", "unknown field"),
        ("lateral", "wedge_guard", "expected a JSON object"),
    ],
)
def test_bad_guard_section_fails_at_start_up_naming_the_field(
    section: Any, field: str, hint: str
) -> None:
    cfg = guarded()
    cfg["kv_connector_extra_config"]["wedge_guard"] = section
    # vLLM's config (pydantic) re-raises our GuardConfigError as a
    # ValidationError, a ValueError with the same message.
    with pytest.raises(ValueError, match=hint) as info:
        SchedulerDriver.build(EngineShape(), cfg)
    assert f"kv_connector_extra_config.{field}" in str(info.value)


def test_a_null_guard_section_means_the_defaults() -> None:
    assert GuardConfig.from_extra_config({"wedge_guard": None}) == GuardConfig()


@pytest.mark.parametrize(
    ("field", "highest", "above", "use"),
    [
        ("stall_alarm_steps", 10**9, 10**9 + 1, "1..1000000000"),
        ("recv_deadline_s", 3600, 3600.5, "1..3600"),
        ("sender_probe_s", 600, 600.5, "0..600"),
    ],
)
def test_each_bounded_field_takes_its_highest_value_and_no_more(
    field: str, highest: float, above: float, use: str
) -> None:
    """The upper bounds an operator reads in the error are the ones enforced:
    the highest value passes, anything above it names the range."""
    config = GuardConfig.from_extra_config({"wedge_guard": {field: highest}})
    assert getattr(config, field) == highest
    with pytest.raises(GuardConfigError) as info:
        GuardConfig.from_extra_config({"wedge_guard": {field: above}})
    assert str(info.value) == (
        f"kv_transfer_config.kv_connector_extra_config.wedge_guard.{field}: "
        f"{above} is out of range; use {use}"
    )


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            ["lateral"],
            "kv_transfer_config.kv_connector_extra_config.wedge_guard: expected a "
            'JSON object, got list; write e.g. {"policy": "reserve+lateral"}',
        ),
        (
            {"recv_deadline_s": "60s"},
            "kv_transfer_config.kv_connector_extra_config.wedge_guard.recv_deadline_s: "
            "expected a number of seconds, got '60s' (str); write e.g. 120.0",
        ),
    ],
)
def test_a_mistyped_guard_section_is_told_what_it_gave_and_what_to_write(
    section: Any, message: str
) -> None:
    with pytest.raises(GuardConfigError) as info:
        GuardConfig.from_extra_config({"wedge_guard": section})
    assert str(info.value) == message


CONNECTORS = "kv_transfer_config.kv_connector_extra_config.connectors"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {},
            f"{CONNECTORS}: missing; list the child connectors, e.g. "
            '[{"kv_connector": "MooncakeConnector", ...}, '
            '{"kv_connector": "NixlConnector", ...}]',
        ),
        (
            {"connectors": [{"kv_connector": ""}]},
            f"{CONNECTORS}[0].kv_connector: missing; "
            "name the child, e.g. NixlConnector",
        ),
    ],
)
def test_missing_children_are_told_how_to_list_them(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(GuardConfigError) as info:
        validate_children(extra)
    assert str(info.value) == message


def test_with_policy_changes_the_policy_only() -> None:
    config = GuardConfig.from_extra_config({"wedge_guard": {"max_attempts": 3}})
    lateral = config.with_policy(" Lateral ")
    assert lateral.policy is Policy.LATERAL
    assert lateral.max_attempts == 3
    assert config.with_policy(Policy.RESERVE).policy is Policy.RESERVE
    with pytest.raises(GuardConfigError, match="wedge_guard.policy: 'greedy'"):
        config.with_policy("greedy")


@pytest.mark.parametrize(
    ("connectors", "hint"),
    [
        ([], "non-empty list"),
        ("NixlConnector", "non-empty list"),
        ([{"kv_role": "kv_both"}], r"connectors\[0\]\.kv_connector: missing"),
        ([scripted_child("a"), scripted_child("a")], r"connectors\[1\]: duplicates"),
    ],
)
def test_bad_children_fail_at_start_up(connectors: Any, hint: str) -> None:
    cfg = guarded()
    cfg["kv_connector_extra_config"]["connectors"] = connectors
    with pytest.raises(ValueError, match=hint):
        SchedulerDriver.build(EngineShape(), cfg)


def test_register_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM loads general plugins more than once per process: a second
    ``register()`` must leave exactly what the first did -- one factory
    entry, one ``VllmConfig.__post_init__`` wrapper (a stacked wrapper would
    validate and select twice), and the guard still selected."""
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    from vllm_mooncake import CONNECTOR_NAME
    from vllm_mooncake.guard.connector import WedgeGuardConnector

    register()
    post_init = VllmConfig.__post_init__
    registry = dict(KVConnectorFactory._registry)
    register()
    register()
    assert VllmConfig.__post_init__ is post_init
    assert dict(KVConnectorFactory._registry) == registry
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is (
        WedgeGuardConnector
    )
    # One wrapper: the guard's start-up check runs once per config.
    import vllm_mooncake.plugin as plugin

    calls: list[object] = []
    validate = plugin.validate_guard_config

    def counting(config: Any) -> None:
        calls.append(config)
        validate(config)

    monkeypatch.setattr(plugin, "validate_guard_config", counting)
    config = make_vllm_config(EngineShape(), guarded())
    assert config.scheduler_config.scheduler_cls == plugin.SYNC_SCHEDULER
    # make_vllm_config re-runs configure_for_guard itself (async settled):
    # once from the wrapper's pre-check, once from each configure_for_guard.
    assert len(calls) == 3


@pytest.mark.parametrize(
    ("async_scheduling", "expected"),
    [(True, WedgeGuardAsyncScheduler), (False, WedgeGuardScheduler)],
)
def test_guard_connector_selects_the_guarded_scheduler(
    async_scheduling: bool, expected: type
) -> None:
    d = SchedulerDriver.build(EngineShape(async_scheduling=async_scheduling), guarded())
    assert type(d.scheduler) is expected


def test_module_path_form_also_selects_the_guarded_scheduler() -> None:
    cfg = guarded()
    cfg["kv_connector_module_path"] = "vllm_mooncake.guard.connector"
    vc = make_vllm_config(EngineShape(async_scheduling=True), cfg)
    assert vc.scheduler_config.scheduler_cls == ASYNC_SCHEDULER


def test_stock_multiconnector_keeps_the_stock_scheduler() -> None:
    d = SchedulerDriver.build(EngineShape(), scripted_multi())
    assert type(d.scheduler) is Scheduler


def test_conflicting_scheduler_cls_is_refused_with_how_to_compose() -> None:
    with pytest.raises(ValueError, match="Compose them") as info:
        make_vllm_config(EngineShape(), guarded(), scheduler_cls="my.pkg.MyScheduler")
    assert "WedgeGuardMixin" in str(info.value)


def test_composed_scheduler_cls_is_accepted() -> None:
    class MyGuarded(WedgeGuardMixin, Scheduler):  # type: ignore[misc]
        pass

    vc = make_vllm_config(EngineShape(), guarded(), scheduler_cls=MyGuarded)
    assert vc.scheduler_config.scheduler_cls is MyGuarded


def test_guarded_scheduler_without_guard_connector_is_refused() -> None:
    with pytest.raises(GuardConfigError, match="WedgeGuardConnector"):
        SchedulerDriver.build(EngineShape(), scripted_multi(), WedgeGuardScheduler)


def test_unsupported_vllm_fails_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config naming the guard on an unproven vLLM fails before any request."""
    import vllm_mooncake.compat.versions as versions

    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.35.0")
    with pytest.raises(
        versions.UnsupportedVllmVersion, match=r"0.34.x but vLLM 0.35.0"
    ):
        make_vllm_config(EngineShape(), guarded())
    # Without the guard connector, nothing of ours runs.
    make_vllm_config(EngineShape(), scripted_multi())
