"""Every private vLLM name the guard touches, in one place.

Each entry says what we use it for. ``tests/test_internals.py`` checks every
one against the installed vLLM and fails by name when a release changes one;
:func:`missing_internals` runs at start-up so a changed release fails loudly,
never silently.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    owner: str  # dotted path of the class
    name: str
    kind: str  # "method" | "attribute"
    why: str
    params: tuple[str, ...] = ()  # for methods: parameter names we pass


SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
MULTI = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector.MultiConnector"
KV_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"

INTERNALS: tuple[Internal, ...] = (
    Internal(
        SCHEDULER,
        "kv_holding_waiting",
        "attribute",
        "waiting requests that hold KV blocks: where lateral victims live",
    ),
    Internal(
        SCHEDULER,
        "waiting",
        "attribute",
        "victims are re-queued at its front, as vLLM's own preemption does",
    ),
    Internal(
        SCHEDULER,
        "deferred_waiting",
        "attribute",
        "a victim leaves the skipped-this-step set",
    ),
    Internal(
        SCHEDULER,
        "finished_recving_kv_req_ids",
        "attribute",
        "recv-done requests; a victim leaves it",
    ),
    Internal(
        SCHEDULER,
        "failed_recving_kv_req_ids",
        "attribute",
        "failed receives; a victim leaves it",
    ),
    Internal(
        SCHEDULER,
        "_inflight_prefills",
        "attribute",
        "the async-load reservation set; a victim must leave it (W2)",
    ),
    Internal(
        SCHEDULER,
        "reset_preempted_req_ids",
        "attribute",
        "tells connectors and workers a request was preempted",
    ),
    Internal(
        SCHEDULER,
        "_spec_decode_step_blocks",
        "attribute",
        "part of the reservation recomputed after a lateral preemption",
    ),
    Internal(
        SCHEDULER,
        "_inflight_prefill_reserved_blocks",
        "method",
        "overridden: the 'lateral'/'no-reserve' policies reserve nothing",
    ),
    Internal(
        SCHEDULER,
        "_handle_blocked_waiting_request",
        "method",
        "overridden: a never-executed victim re-promotes as new, not resumed",
        ("request",),
    ),
    Internal(
        SCHEDULER,
        "_update_waiting_for_remote_kv",
        "method",
        "caches a recv-done victim's loaded blocks before they are freed",
        ("request",),
    ),
    Internal(
        SCHEDULER,
        "_free_request_blocks",
        "method",
        "frees a victim's blocks (fenced when block frees are deferred)",
        ("request",),
    ),
    Internal(
        SCHEDULER,
        "_set_kv_fetch_stage",
        "method",
        "clears a victim's KV-fetch stage gauge",
        ("request", "stage"),
    ),
    Internal(
        SCHEDULER,
        "_holds_kv_blocks",
        "method",
        "vLLM's own 'holds blocks' predicate for waiting requests",
        ("request",),
    ),
    Internal(
        KV_MANAGER,
        "allocate_slots",
        "method",
        "wrapped on the scheduler's instance: the admission valve",
        ("request", "num_new_tokens", "reserved_blocks"),
    ),
    Internal(
        MULTI,
        "_connectors",
        "attribute",
        "the child connectors, for routing by kv_transfer_params",
    ),
    Internal(
        MULTI,
        "_requests_to_connector",
        "attribute",
        "which child loads a request; set by the guard's routing",
    ),
)


def _resolve(dotted: str) -> type:
    module, _, cls = dotted.rpartition(".")
    mod = __import__(module, fromlist=[cls])
    return getattr(mod, cls)  # type: ignore[no-any-return]


def _instance_attributes(cls: type) -> set[str]:
    """Attribute names assigned in ``__init__`` (read from the source)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            source = inspect.getsource(init)
        except (OSError, TypeError):
            continue
        for line in source.splitlines():
            stripped = line.strip()
            if stripped.startswith("self.") and "=" in stripped:
                names.add(stripped[5:].split("=")[0].split(":")[0].strip())
    return names


def check_internal(item: Internal) -> str | None:
    """None if ``item`` is present with the expected shape, else why not."""
    cls = _resolve(item.owner)
    where = f"{item.owner}.{item.name}"
    if item.kind == "method":
        fn = getattr(cls, item.name, None)
        if fn is None or not callable(fn):
            return f"{where}: method is gone ({item.why})"
        params = inspect.signature(fn).parameters
        missing = [p for p in item.params if p not in params]
        if missing:
            return f"{where}: parameter(s) {missing} are gone ({item.why})"
        return None
    if item.name in _instance_attributes(cls) or hasattr(cls, item.name):
        return None
    return f"{where}: attribute is no longer set ({item.why})"


def missing_internals() -> list[str]:
    return [msg for item in INTERNALS if (msg := check_internal(item))]
