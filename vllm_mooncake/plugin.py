"""The ``vllm.general_plugins`` entry point.

vLLM loads general plugins in every process (API server, engine core,
workers), possibly more than once per process, so :func:`register` is
idempotent. It:

1. registers ``WedgeGuardConnector`` with vLLM's connector factory;
2. makes vLLM pick the guarded scheduler when the guard connector is
   configured and no ``scheduler_cls`` is set (and refuses a conflicting
   ``scheduler_cls`` with a message on how to compose);
3. on a host without accelerator only, applies the CPU compatibility patch
   that lets vLLM's MooncakeConnector worker start
   (:mod:`vllm_mooncake.compat.cpu`).

When a config names the guard connector, the installed vLLM must be one the
guard was proven on, or the config fails at start-up with the supported
releases named. (vLLM only logs a plugin that raises, so the check lives
where the guard is used, not in :func:`register`.)
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_mooncake import CONNECTOR_MODULE, CONNECTOR_NAME, names_guard_connector

SCHEDULER_MODULE = "vllm_mooncake.guard.scheduler"
SYNC_SCHEDULER = f"{SCHEDULER_MODULE}.WedgeGuardScheduler"
ASYNC_SCHEDULER = f"{SCHEDULER_MODULE}.WedgeGuardAsyncScheduler"

_PATCHED_ATTR = "_vllm_mooncake_patched"


def register() -> None:
    """Entry point: safe to call any number of times in any process."""
    _register_connector()
    _install_scheduler_selection()
    _apply_cpu_compat()


def _register_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # The factory raises ValueError on a duplicate name; the registry is
    # private, so a failed lookup is the public way to ask.
    try:
        KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME)
    except ValueError:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, CONNECTOR_MODULE, "WedgeGuardConnector"
        )


def _apply_cpu_compat() -> None:
    from vllm_mooncake.compat import cpu

    cpu.apply()


def uses_guard_connector(vllm_config: Any) -> bool:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None:
        return False
    return names_guard_connector(ktc.kv_connector, ktc.kv_connector_module_path)


def validate_guard_config(vllm_config: Any) -> None:
    """Raise :class:`GuardConfigError` for a malformed guard configuration.

    Runs before vLLM's own config checks, which would otherwise trip over a
    malformed child with a less helpful message.
    """
    if not uses_guard_connector(vllm_config):
        return
    from vllm_mooncake.compat.versions import check_vllm_version
    from vllm_mooncake.guard.config import GuardConfig, validate_children

    check_vllm_version()
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    GuardConfig.from_extra_config(extra)
    validate_children(extra)


def configure_for_guard(vllm_config: Any) -> None:
    """Settle what the guard connector needs from a resolved ``VllmConfig``."""
    if not uses_guard_connector(vllm_config):
        return
    validate_guard_config(vllm_config)
    _disable_hma_unless_children_support_it(vllm_config)
    select_scheduler(vllm_config)


def _disable_hma_unless_children_support_it(vllm_config: Any) -> None:
    """Apply vLLM's MultiConnector HMA rule to the guard connector.

    vLLM's factory special-cases the *name* "MultiConnector": HMA stays on
    only if every child supports it. Under another name it only asks whether
    the class subclasses SupportsHMA (ours does, through MultiConnector).
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
    )

    from vllm_mooncake.compat.releases import installed_layout

    sc = vllm_config.scheduler_config
    if sc.disable_hybrid_kv_cache_manager:
        return
    if not installed_layout().hma_children_check:
        # Before 0.23 vLLM has no rule to ask (all_children_support_hma), and
        # 0.22's MultiConnector asserts at construction that HMA is off unless
        # every child supports it: the guard turns it off (it only matters
        # for sliding-window and Mamba models).
        sc.disable_hybrid_kv_cache_manager = True
        return
    if not MultiConnector.all_children_support_hma(vllm_config.kv_transfer_config):
        sc.disable_hybrid_kv_cache_manager = True


def select_scheduler(vllm_config: Any) -> None:
    """Point ``scheduler_cls`` at the guarded scheduler when the guard is on."""
    if not uses_guard_connector(vllm_config):
        return
    sc = vllm_config.scheduler_config
    current = sc.scheduler_cls
    if current is None or current in (SYNC_SCHEDULER, ASYNC_SCHEDULER):
        sc.scheduler_cls = ASYNC_SCHEDULER if sc.async_scheduling else SYNC_SCHEDULER
        return
    check_scheduler_cls(current)


def check_scheduler_cls(value: object) -> None:
    """Raise unless ``scheduler_config.scheduler_cls`` can run the guard.

    None and the guarded schedulers are fine; anything else must be (or
    name, as a dotted path) a subclass of ``WedgeGuardMixin``.
    """
    if value is None or value in (SYNC_SCHEDULER, ASYNC_SCHEDULER):
        return
    from vllm_mooncake.guard.config import GuardConfigError

    field = f"scheduler_config.scheduler_cls={value!r}"
    compose = (
        "Compose them: `class MyGuarded(vllm_mooncake.guard.scheduler."
        "WedgeGuardMixin, YourScheduler): pass` and pass --scheduler-cls "
        "mymodule.MyGuarded, or unset --scheduler-cls to use "
        f"{ASYNC_SCHEDULER} / {SYNC_SCHEDULER}."
    )
    cls = value
    if isinstance(value, str):
        module, _, name = value.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise GuardConfigError(
                f"{field}: cannot import it ({exc}); the wedge guard needs a "
                f"scheduler that composes WedgeGuardMixin. {compose}"
            ) from exc
    from vllm_mooncake.guard.scheduler import WedgeGuardMixin

    if isinstance(cls, type) and issubclass(cls, WedgeGuardMixin):
        return
    raise GuardConfigError(
        f"{field} conflicts with the wedge guard (WedgeGuardConnector needs "
        f"its scheduler). {compose}"
    )


def _install_scheduler_selection() -> None:
    """Run :func:`configure_for_guard` after every ``VllmConfig.__post_init__``.

    Why: vLLM resolves ``scheduler_cls`` from the config alone; nothing lets
    a connector choose its scheduler.
    How: wrap ``VllmConfig.__post_init__`` once per process (a flag on the
    class makes it idempotent). The resolved config is what the engine core
    receives, so the choice is made in the process that builds the config.
    Upstream: none yet (a connector-declared scheduler requirement would do).
    Removal: when vLLM lets a connector name its scheduler.
    """
    from vllm.config import VllmConfig

    if getattr(VllmConfig, _PATCHED_ATTR, False):
        return
    stock_post_init = VllmConfig.__post_init__

    def __post_init__(self: Any) -> None:
        validate_guard_config(self)
        stock_post_init(self)
        configure_for_guard(self)

    VllmConfig.__post_init__ = __post_init__
    setattr(VllmConfig, _PATCHED_ATTR, True)


__all__ = [
    "ASYNC_SCHEDULER",
    "SYNC_SCHEDULER",
    "check_scheduler_cls",
    "configure_for_guard",
    "register",
    "select_scheduler",
    "uses_guard_connector",
    "validate_guard_config",
]
