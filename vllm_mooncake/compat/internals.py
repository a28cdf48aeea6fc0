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

from vllm_mooncake.compat.cpu import NIXL_WORKER_CLASS, NIXL_WORKER_MODULE


@dataclass(frozen=True)
class Internal:
    owner: str  # dotted path of the class
    name: str
    kind: str  # "method" | "attribute"
    why: str
    params: tuple[str, ...] = ()  # for methods: parameter names we pass
    series: tuple[str, ...] = ("0.30", "0.31", "0.32")  # releases that use it
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
NIXL_WORKER = f"{NIXL_WORKER_MODULE}.{NIXL_WORKER_CLASS}"

LATEST = ("0.32",)  # the newest proven release: baseline of the source check
NEW = ("0.31",) + LATEST  # the kv_holding_waiting layout (0.31+)
OLD = ("0.30",)  # the skipped_waiting layout (0.19-0.30)


def _attr(
    owner: str, name: str, why: str, series: tuple[str, ...] = NEW + OLD
) -> Internal:
    return Internal(owner, name, "attribute", why, (), series)


def _method(
    owner: str,
    name: str,
    why: str,
    params: tuple[str, ...] = (),
    series: tuple[str, ...] = NEW + OLD,
) -> Internal:
    return Internal(owner, name, "method", why, params, series)


def _wrapped_whole(
    owner: str, name: str, why: str, params: tuple[str, ...] = ()
) -> Internal:
    return Internal(owner, name, "method", why, params, NEW + OLD, body_matters=False)


INTERNALS: tuple[Internal, ...] = (
    # -- waiting queues and receive sets (compat/releases.py, guard/scheduler.py)
    _attr(SCHEDULER, "kv_holding_waiting", "holders wait here: victims", NEW),
    _attr(SCHEDULER, "skipped_waiting", "blocked requests wait here: victims", OLD),
    _attr(SCHEDULER, "waiting", "victims are re-queued at its front"),
    _attr(SCHEDULER, "deferred_waiting", "a victim leaves the skipped set", NEW),
    _attr(SCHEDULER, "finished_recving_kv_req_ids", "recv-done ids; a victim leaves"),
    _attr(SCHEDULER, "failed_recving_kv_req_ids", "failed receives; a victim leaves"),
    _attr(SCHEDULER, "_inflight_prefills", "reservation set; a victim leaves (W2)"),
    _attr(SCHEDULER, "reset_preempted_req_ids", "tells connectors of preemptions"),
    _attr(SCHEDULER, "_spec_decode_step_blocks", "part of the reservation", LATEST),
    # -- hooks the guarded scheduler overrides (each calls super)
    _method(
        SCHEDULER,
        "_inflight_prefill_reserved_blocks",
        "overridden: 'lateral'/'no-reserve' reserve nothing",
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
    _method(SCHEDULER, "_free_request_blocks", "frees a victim's blocks", ("request",)),
    _method(
        SCHEDULER,
        "_set_kv_fetch_stage",
        "clears a victim's KV-fetch gauge",
        ("request", "stage"),
        LATEST,
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
    ),
    # -- MultiConnector (guard/connector.py)
    _attr(MULTI, "_connectors", "the child connectors, for routing"),
    _attr(MULTI, "_requests_to_connector", "which child loads a request"),
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
