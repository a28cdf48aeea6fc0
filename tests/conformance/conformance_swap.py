"""The swap: what the guarded (and control) runs change in vLLM's tests.

Every scheduler a patched construction site builds gets a *wrapped* copy of
its ``VllmConfig``: the test's ``kv_transfer_config`` becomes the only child
of a wrapping connector, and the same engine-level fields (role, engine id,
``kv_load_failure_policy``, ...) stay at the top, as a user would write it::

    {"kv_connector": "WedgeGuardConnector", "kv_role": <same>,
     "kv_connector_extra_config": {
         "connectors": [<the test's config>],
         "wedge_guard": {"policy": "reserve+lateral"}}}

A test without a connector gets :class:`NullConnector` as the child: the
guarded scheduler refuses to run without the guard connector.

Two wrappings, one per run:

* ``guard``: WedgeGuardConnector + WedgeGuardScheduler/WedgeGuardAsyncScheduler;
* ``control``: vLLM's MultiConnector + vLLM's Scheduler/AsyncScheduler. A
  difference the control run shows too comes from wrapping the connector at
  all, not from the guard.

The copy is shallow (as MultiConnector makes its children's): the test's own
config object is untouched, so connectors the test builds itself from it
(worker side, for instance) see the original. A config the swap already
wrapped (a test building a second scheduler from ``scheduler.vllm_config``)
is passed on as it is.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

NULL_CONNECTOR = "ConformanceNullConnector"
GUARD_POLICY = {"policy": "reserve+lateral"}
# Fields that name the connector; every other field is engine-level and is
# kept at the top of the wrapped config too.
_CONNECTOR_FIELDS = (
    "kv_connector",
    "kv_connector_module_path",
    "kv_connector_extra_config",
)


class NullConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A KV connector that never loads, saves or holds anything."""

    @property
    def requires_kv_delivery(self) -> bool:
        """Nothing is handed off (vLLM's default follows the role: kv_both)."""
        return False

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # Worker side: nothing to move.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def register_null_connector() -> None:
    try:
        KVConnectorFactory.get_connector_class_by_name(NULL_CONNECTOR)
    except ValueError:
        KVConnectorFactory.register_connector(
            NULL_CONNECTOR, __name__, NullConnector.__name__
        )


def _non_default_fields(ktc: KVTransferConfig) -> dict[str, Any]:
    """The fields of ``ktc`` that differ from KVTransferConfig's defaults."""
    defaults = KVTransferConfig()
    return {
        f.name: getattr(ktc, f.name)
        for f in dataclasses.fields(KVTransferConfig)
        if f.name != "engine_id" and getattr(ktc, f.name) != getattr(defaults, f.name)
    }


def child_config(ktc: KVTransferConfig | None) -> dict[str, Any]:
    """The test's connector as a child entry (NullConnector if it has none)."""
    if ktc is None:
        return {"kv_connector": NULL_CONNECTOR, "kv_role": "kv_both"}
    return _non_default_fields(ktc)


def wrapped_transfer_config(
    ktc: KVTransferConfig | None, wrapper: str, extra: dict[str, Any]
) -> KVTransferConfig:
    """``ktc`` as the only child of connector ``wrapper``."""
    top = {k: v for k, v in child_config(ktc).items() if k not in _CONNECTOR_FIELDS}
    if ktc is not None and ktc.engine_id is not None:
        top["engine_id"] = ktc.engine_id
    return KVTransferConfig(
        **top,
        kv_connector=wrapper,
        kv_connector_extra_config={"connectors": [child_config(ktc)], **extra},
    )


def guard_wrap(ktc: KVTransferConfig | None) -> KVTransferConfig:
    return wrapped_transfer_config(
        ktc, "WedgeGuardConnector", {"wedge_guard": dict(GUARD_POLICY)}
    )


def control_wrap(ktc: KVTransferConfig | None) -> KVTransferConfig:
    return wrapped_transfer_config(ktc, "MultiConnector", {})


# The configs the swap produced (by id; the values keep the ids alive). A test
# that builds a second scheduler from ``scheduler.vllm_config`` reuses one; it
# is not wrapped again.
_WRAPPED: dict[int, KVTransferConfig] = {}

Wrap = Callable[[KVTransferConfig | None], KVTransferConfig]


def with_wrapped_config(
    wrap: Wrap, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The scheduler's arguments with ``vllm_config`` replaced by a wrapped copy."""

    def wrapped(config: VllmConfig) -> VllmConfig:
        if id(config.kv_transfer_config) in _WRAPPED:
            return config  # a swapped scheduler's config, reused by the test
        new = copy.copy(config)
        new.kv_transfer_config = wrap(config.kv_transfer_config)
        _WRAPPED[id(new.kv_transfer_config)] = new.kv_transfer_config
        return new

    if "vllm_config" in kwargs:
        return args, {**kwargs, "vllm_config": wrapped(kwargs["vllm_config"])}
    return (wrapped(args[0]), *args[1:]), kwargs


def _swapped(base: type[Scheduler], wrap: Wrap, name: str) -> type[Scheduler]:
    """A subclass of ``base`` that wraps its config before ``base`` sees it."""

    def __init__(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        args, kwargs = with_wrapped_config(wrap, args, kwargs)
        base.__init__(self, *args, **kwargs)

    return type(name, (base,), {"__init__": __init__, "__module__": __name__})


def swapped_classes(mode: str) -> dict[str, type[Scheduler]]:
    """{"Scheduler": ..., "AsyncScheduler": ...} for run ``mode``."""
    if mode == "guard":
        from vllm_mooncake.guard.scheduler import (
            WedgeGuardAsyncScheduler,
            WedgeGuardScheduler,
        )

        return {
            "Scheduler": _swapped(
                WedgeGuardScheduler, guard_wrap, "GuardSwapScheduler"
            ),
            "AsyncScheduler": _swapped(
                WedgeGuardAsyncScheduler, guard_wrap, "GuardSwapAsyncScheduler"
            ),
        }
    if mode == "control":
        return {
            "Scheduler": _swapped(Scheduler, control_wrap, "ControlSwapScheduler"),
            "AsyncScheduler": _swapped(
                AsyncScheduler, control_wrap, "ControlSwapAsyncScheduler"
            ),
        }
    raise ValueError(f"no swap for mode {mode!r}")
