"""``kv_transfer_config`` dicts for the scripted connector, alone or as children.

The two scripted children stand for the two real ones in a PD rank: a
prefix-cache store loader (Mooncake store; ``store_load`` params, hits
re-offered after a preemption) and a P->D transfer (NIXL; ``pd_load``
params, one-shot).
"""

from __future__ import annotations

from typing import Any

SCRIPTED_MODULE = "vllm_mooncake.testing.scripted_connector"
STORE_KEY = "store_load"
PD_KEY = "pd_load"


def scripted_child(params_key: str) -> dict[str, Any]:
    return {
        "kv_connector": "ScriptedLoadConnector",
        "kv_connector_module_path": SCRIPTED_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"params_key": params_key},
    }


def scripted_single(
    params_key: str = STORE_KEY, kv_load_failure_policy: str = "fail"
) -> dict[str, Any]:
    """One scripted connector, no MultiConnector."""
    cfg = scripted_child(params_key)
    cfg["kv_load_failure_policy"] = kv_load_failure_policy
    return cfg


def scripted_multi(
    kv_connector: str = "MultiConnector",
    guard: dict[str, Any] | None = None,
    kv_load_failure_policy: str = "fail",
    children: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """[store child, P->D child] under MultiConnector or the guard connector."""
    extra: dict[str, Any] = {
        "connectors": children or [scripted_child(STORE_KEY), scripted_child(PD_KEY)]
    }
    if guard is not None:
        extra["wedge_guard"] = guard
    return {
        "kv_connector": kv_connector,
        "kv_role": "kv_both",
        "kv_load_failure_policy": kv_load_failure_policy,
        "kv_connector_extra_config": extra,
    }


def store_hit(tokens: int, done_after: int = 1, **more: Any) -> dict[str, Any]:
    """kv_transfer_params for a Mooncake-store-like async prefix hit."""
    return {
        STORE_KEY: {"tokens": tokens, "done_after": done_after, "reoffer": True, **more}
    }


def pd_transfer(done_after: int = 1, **more: Any) -> dict[str, Any]:
    """kv_transfer_params for a NIXL-like full-prompt P->D transfer."""
    return {PD_KEY: {"tokens": -1, "done_after": done_after, **more}}


def guarded(
    policy: str = "reserve+lateral",
    kv_load_failure_policy: str = "fail",
    children: list[dict[str, Any]] | None = None,
    **guard: Any,
) -> dict[str, Any]:
    """The guard connector over [store child, P->D child], strict ledger."""
    section = {"policy": policy, "strict": True, **guard}
    return scripted_multi(
        kv_connector="WedgeGuardConnector",
        guard=section,
        kv_load_failure_policy=kv_load_failure_policy,
        children=children,
    )
