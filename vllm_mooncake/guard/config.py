"""The guard section of ``kv_transfer_config`` and its validation.

::

    {"kv_connector": "WedgeGuardConnector",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {
         "connectors": [<Mooncake child>, <NIXL child>],
         "wedge_guard": {"policy": "reserve+lateral", "max_attempts": 16,
                         "stall_alarm_steps": 2000, "only_when_idle": true,
                         "max_failed_loads": 3, "gauge_interval_s": 0.1,
                         "recv_deadline_s": 120, "sender_probe_s": 5,
                         "strict": false}}}

Every error names the field and says how to fix it, and is raised at start-up
(when vLLM builds the connector), before any request is accepted.
"""

from __future__ import annotations

import difflib
import enum
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_mooncake import names_guard_connector

GUARD_SECTION = "wedge_guard"
FIELD_PREFIX = f"kv_transfer_config.kv_connector_extra_config.{GUARD_SECTION}"


class GuardConfigError(ValueError):
    """A malformed guard configuration; the message names the field and fix."""


class Policy(enum.Enum):
    # Upstream vLLM admission (async-load reservation); the guard only
    # observes, counts and raises the wedge alarm.
    RESERVE = "reserve"
    # Upstream reservation plus the lateral-preemption valve.
    RESERVE_LATERAL = "reserve+lateral"
    # No async-load reservation; admission against the blocks free now, and
    # the valve resolves the wedges that this allows.
    LATERAL = "lateral"
    # No reservation and no valve: pre-0.23 admission. For reproducing the
    # seed wedge only -- it wedges.
    NO_RESERVE = "no-reserve"

    @property
    def reserves(self) -> bool:
        return self in (Policy.RESERVE, Policy.RESERVE_LATERAL)

    @property
    def lateral(self) -> bool:
        return self in (Policy.RESERVE_LATERAL, Policy.LATERAL)


POLICY_NAMES = tuple(p.value for p in Policy)
# Upstream admission plus the valve: dropping the reservation (LATERAL) gains
# no throughput on the simulator and loses some on bursts of async loads
# (bench/throughput.py; figures in bench/RESULTS.md and docs/benchmarks.md).
DEFAULT_POLICY = Policy.RESERVE_LATERAL
MAX_ATTEMPTS_RANGE = (1, 1024)
MAX_FAILED_LOADS_RANGE = (1, 1000)


@dataclass(frozen=True)
class GuardConfig:
    policy: Policy = DEFAULT_POLICY
    # Lateral preemptions allowed per schedule() call.
    max_attempts: int = 16
    # A stall -- steps that schedule no token while nothing runs, waiting
    # requests hold blocks and no receive is in flight -- raises the wedge
    # alarm once it lasted stall_alarm_steps steps or stall_alarm_s seconds,
    # whichever comes first. A stalled CPU server steps every ~1.5 ms, so
    # 2000 steps is ~3 s there; the seconds bound covers slower steppers.
    stall_alarm_steps: int = 2000
    stall_alarm_s: float = 10.0
    # Fire the valve only when nothing is running (a stall with running
    # requests ends by itself when they free blocks).
    only_when_idle: bool = True
    # Failed loads of one request from one child before the guard reports no
    # external hit for it (the request is then prefilled locally): a store
    # that keeps failing a load under kv_load_failure_policy=recompute would
    # otherwise be offered it forever.
    max_failed_loads: int = 3
    # How old the holder gauges (recv-done holders waiting, blocks held by
    # non-running requests) may get while tokens are scheduled: they are
    # recounted at most this often then. A step that schedules nothing --
    # the step a wedge is made of -- always recounts them, and so does a
    # step whose waiting queues are empty. 0: every step.
    gauge_interval_s: float = 0.1
    # An async receive (a P->D transfer or a store load) in flight longer than
    # this is failed through vLLM's kv_load_failure_policy (recompute: the
    # request is prefilled locally; fail: it ends with an error), and its
    # blocks stay out of the free pool until its writer is done
    # (guard/receive_watch.py, guard/quarantine.py). A P->D receive normally
    # lands in well under a second once its prefill ran; vLLM's own bounds
    # are Mooncake's 480 s pull timeout and none for NIXL reads. The rank also
    # reports itself stuck (vllm:kv_guard_stuck) once no token was scheduled
    # for this long while requests wait.
    recv_deadline_s: float = 120.0
    # While a P->D receive is in flight, or its blocks are quarantined, its
    # sender is probed this often (guard/senders.py); two refusals in a row
    # mean the sender is dead and its receives are failed at once. 0: never
    # probe (the deadline alone decides).
    sender_probe_s: float = 5.0
    # Raise on a ledger inconsistency instead of logging it (tests).
    strict: bool = False
    # policy.lateral and policy.reserves, read on every step (set from policy).
    valve: bool = field(init=False, repr=False, compare=False)
    reserves: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "valve", self.policy.lateral)
        object.__setattr__(self, "reserves", self.policy.reserves)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> GuardConfig:
        """Parse ``kv_connector_extra_config``; validate the guard section."""
        raw = (extra or {}).get(GUARD_SECTION, {})
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise GuardConfigError(
                f"{FIELD_PREFIX}: expected a JSON object, got {type(raw).__name__}; "
                f'write e.g. {{"policy": "{DEFAULT_POLICY.value}"}}'
            )
        known = {
            "policy",
            "max_attempts",
            "stall_alarm_steps",
            "stall_alarm_s",
            "only_when_idle",
            "max_failed_loads",
            "gauge_interval_s",
            "recv_deadline_s",
            "sender_probe_s",
            "strict",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise GuardConfigError(
                f"{FIELD_PREFIX}.{unknown[0]}: unknown field; "
                f"the known fields are {sorted(known)}"
            )
        return cls(
            policy=_policy(raw.get("policy", DEFAULT_POLICY.value)),
            max_attempts=_int_in(
                raw, "max_attempts", cls.max_attempts, *MAX_ATTEMPTS_RANGE
            ),
            stall_alarm_steps=_int_in(
                raw, "stall_alarm_steps", cls.stall_alarm_steps, 1, 10**9
            ),
            stall_alarm_s=_seconds(raw, "stall_alarm_s", cls.stall_alarm_s),
            only_when_idle=_bool(raw, "only_when_idle", cls.only_when_idle),
            max_failed_loads=_int_in(
                raw, "max_failed_loads", cls.max_failed_loads, *MAX_FAILED_LOADS_RANGE
            ),
            gauge_interval_s=_seconds(
                raw, "gauge_interval_s", cls.gauge_interval_s, lowest=0.0
            ),
            recv_deadline_s=_seconds(
                raw, "recv_deadline_s", cls.recv_deadline_s, lowest=1.0, highest=3600
            ),
            sender_probe_s=_seconds(
                raw, "sender_probe_s", cls.sender_probe_s, lowest=0.0, highest=600
            ),
            strict=_bool(raw, "strict", cls.strict),
        )

    def with_policy(self, policy: Policy | str) -> GuardConfig:
        from dataclasses import replace

        return replace(self, policy=_policy(policy))


def _policy(value: object) -> Policy:
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        for p in Policy:
            if p.value == value.strip().lower():
                return p
    raise GuardConfigError(
        f"{FIELD_PREFIX}.policy: {value!r} is not a policy; "
        f"use one of {', '.join(repr(n) for n in POLICY_NAMES)}"
    )


def _int_in(raw: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise GuardConfigError(
            f"{FIELD_PREFIX}.{name}: expected an integer, got {value!r} "
            f"({type(value).__name__}); write e.g. {default}"
        )
    if not lo <= value <= hi:
        raise GuardConfigError(
            f"{FIELD_PREFIX}.{name}: {value} is out of range; use {lo}..{hi}"
        )
    return value


def _seconds(
    raw: Mapping[str, Any],
    name: str,
    default: float,
    lowest: float = 0.01,
    highest: float = 86400,
) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GuardConfigError(
            f"{FIELD_PREFIX}.{name}: expected a number of seconds, got {value!r} "
            f"({type(value).__name__}); write e.g. {default}"
        )
    if not lowest <= value <= highest:
        raise GuardConfigError(
            f"{FIELD_PREFIX}.{name}: {value} is out of range; "
            f"use {lowest:g}..{highest:g}"
        )
    return float(value)


def _bool(raw: Mapping[str, Any], name: str, default: bool) -> bool:
    value = raw.get(name, default)
    if not isinstance(value, bool):
        raise GuardConfigError(
            f"{FIELD_PREFIX}.{name}: expected true or false, got {value!r}"
        )
    return value


def validate_children(extra: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """Check ``connectors``: a non-empty list of distinct child configs."""
    field = "kv_transfer_config.kv_connector_extra_config.connectors"
    children = (extra or {}).get("connectors")
    if children is None:
        raise GuardConfigError(
            f"{field}: missing; list the child connectors, e.g. "
            '[{"kv_connector": "MooncakeConnector", ...}, '
            '{"kv_connector": "NixlConnector", ...}]'
        )
    if not isinstance(children, list) or not children:
        raise GuardConfigError(
            f"{field}: expected a non-empty list of child connector configs, "
            f"got {children!r}"
        )
    seen: dict[str, int] = {}
    for i, child in enumerate(children):
        where = f"{field}[{i}]"
        if not isinstance(child, Mapping):
            raise GuardConfigError(f"{where}: expected a JSON object, got {child!r}")
        name = child.get("kv_connector")
        if not isinstance(name, str) or not name:
            raise GuardConfigError(
                f"{where}.kv_connector: missing; name the child, e.g. NixlConnector"
            )
        key = repr(sorted((k, repr(v)) for k, v in child.items()))
        if key in seen:
            raise GuardConfigError(
                f"{where}: duplicates {field}[{seen[key]}]; list each child once"
            )
        seen[key] = i
        _check_child_fields(child, where)
        _check_child_connector(name, child.get("kv_connector_module_path"), where)
    return list(children)


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def _check_child_fields(child: Mapping[str, Any], where: str) -> None:
    """Types of the child fields the guard and vLLM read before building it."""
    role = child.get("kv_role")
    if role is not None and role not in KV_ROLES:
        raise GuardConfigError(
            f"{where}.kv_role: {role!r} is not a role; use one of "
            f"{', '.join(repr(r) for r in KV_ROLES)} (or leave it out)"
        )
    extra = child.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, Mapping):
        raise GuardConfigError(
            f"{where}.kv_connector_extra_config: expected a JSON object, got {extra!r}"
        )
    module = child.get("kv_connector_module_path")
    if module is not None and (not isinstance(module, str) or not module):
        raise GuardConfigError(
            f"{where}.kv_connector_module_path: expected a module path such as "
            f"'my_pkg.my_connector', got {module!r} (or leave it out)"
        )


def _check_child_connector(name: str, module: str | None, where: str) -> None:
    """The child names a connector vLLM can build: registered, or importable."""
    if names_guard_connector(name, module):
        raise GuardConfigError(
            f"{where}.kv_connector: the guard cannot be its own child; list the "
            "transports it wraps, e.g. MooncakeConnector and NixlConnector"
        )
    if module is not None:
        try:
            loaded = importlib.import_module(module)
        except ImportError as exc:
            raise GuardConfigError(
                f"{where}.kv_connector_module_path: cannot import {module!r} "
                f"({exc}); install the package that provides it or fix the path"
            ) from exc
        if not hasattr(loaded, name):
            raise GuardConfigError(
                f"{where}.kv_connector: {module!r} has no class {name!r}; name a "
                "connector class defined there"
            )
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    try:
        KVConnectorFactory.get_connector_class_by_name(name)
    except ValueError as exc:
        if "not registered" not in str(exc):
            raise
        # The registry has no public listing; read it for a hint only.
        known = sorted(getattr(KVConnectorFactory, "_registry", {}))
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise GuardConfigError(
            f"{where}.kv_connector: {name!r} is not a connector vLLM knows; "
            f"{hint}use a registered name ({', '.join(known)}) or set "
            "kv_connector_module_path to the module that defines it"
        ) from exc
    except Exception:
        # Registered, but its module does not load here (e.g. a transport
        # library only the serving image has): vLLM reports that itself.
        return


__all__ = [
    "DEFAULT_POLICY",
    "GuardConfig",
    "GuardConfigError",
    "POLICY_NAMES",
    "Policy",
    "validate_children",
]
