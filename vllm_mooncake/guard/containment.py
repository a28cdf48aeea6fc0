"""Contain a child connector that raises inside a per-request scheduler hook.

vLLM calls a KV connector's scheduler-side hooks inside ``schedule()`` and
``update_from_output()``. An exception there ends the engine core: every
request on the rank is lost, and the router waits for them until it times
out. MultiConnector adds nothing: one raising child takes the other down
with it. The guard wraps each child (on the scheduler side only) in a
:class:`ContainedChild` that turns a raise in a *per-request* hook into the
outcome vLLM already knows how to handle for that request alone:

=============================  ==============================================
hook that raised               what the request gets
=============================  ==============================================
``get_num_new_matched_tokens``  no external hit: its prompt is computed locally
``update_state_after_alloc``    (the owner, with tokens to load) its load never
                                started: reported as a *failed load* on the
                                next step, so ``kv_load_failure_policy``
                                applies (``recompute`` or ``fail``) -- see
                                ``ReceiveNotices.load_not_started``
``request_finished``            no delayed free, no transfer params: its
                                blocks are freed as for any finished request
=============================  ==============================================

Each fault is logged (ERROR, with the traceback), counted by child and hook
(``vllm:kv_guard_child_errors_total``) and reported to the guard. Step-wide
hooks (``build_connector_meta``, ``update_connector_output``) and the worker
side are not wrapped: a fault there has no single request to give it to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_mooncake import logger_for

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logger_for(__name__)

LOOKUP = "get_num_new_matched_tokens"
ALLOC = "update_state_after_alloc"
FINISHED = "request_finished"


@dataclass(frozen=True)
class ChildFault:
    """One contained raise: which child, in which hook, for which request."""

    child: str
    hook: str
    req_id: str
    num_external_tokens: int = 0  # for ALLOC: the tokens it was to load


class ContainedChild:
    """A child connector whose per-request scheduler hooks cannot raise.

    Everything else is forwarded unchanged, ``__class__`` included, so
    MultiConnector's per-class bookkeeping (stats keys, metrics) and
    ``isinstance`` checks see the child itself.
    """

    def __init__(
        self, child: Any, name: str, on_fault: Callable[[ChildFault], None]
    ) -> None:
        self._child = child
        self._name = name
        self._on_fault = on_fault

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105 - proxies the child's class
        return type(self._child)

    @property
    def wrapped(self) -> Any:
        return self._child

    def __getattr__(self, name: str) -> Any:
        """Forward to the child, afresh on every access: a child's method may
        be replaced after the proxy was made (vLLM's own tests do)."""
        return getattr(self._child, name)

    # Hooks MultiConnector calls on every step or every request: forwarded
    # by name, afresh on every call as above, without the failed attribute
    # lookup that reaches ``__getattr__`` (about a microsecond each).
    def on_new_request(self, *args: Any, **kwargs: Any) -> Any:
        return self._child.on_new_request(*args, **kwargs)

    def build_connector_meta(self, *args: Any, **kwargs: Any) -> Any:
        return self._child.build_connector_meta(*args, **kwargs)

    def update_connector_output(self, *args: Any, **kwargs: Any) -> Any:
        return self._child.update_connector_output(*args, **kwargs)

    def get_kv_connector_stats(self, *args: Any, **kwargs: Any) -> Any:
        return self._child.get_kv_connector_stats(*args, **kwargs)

    def take_events(self, *args: Any, **kwargs: Any) -> Any:
        return self._child.take_events(*args, **kwargs)

    def get_loaded_kv_cache_group_ids(self, *args: Any, **kwargs: Any) -> Any:
        return self._child.get_loaded_kv_cache_group_ids(*args, **kwargs)

    def get_external_cache_hit_sources(self, *args: Any, **kwargs: Any) -> Any:
        return self._child.get_external_cache_hit_sources(*args, **kwargs)

    @property
    def supports_divergent_local_hybrid_hits(self) -> Any:
        # A child without it (before 0.32) raises AttributeError here, and
        # the lookup falls back to __getattr__, which raises it again.
        return self._child.supports_divergent_local_hybrid_hits

    def _contain(self, hook: str, request: Request, tokens: int = 0) -> ChildFault:
        logger.exception(
            "KV connector %s raised in %s for request %s; contained by the wedge guard",
            self._name,
            hook,
            request.request_id,
        )
        fault = ChildFault(self._name, hook, request.request_id, tokens)
        self._on_fault(fault)
        return fault

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        try:
            result: tuple[int | None, bool] = self._child.get_num_new_matched_tokens(
                request, num_computed_tokens
            )
        except Exception:
            self._contain(LOOKUP, request)
            return 0, False
        return result

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> ChildFault | None:
        """The child's hook; returns the fault it contained (None if the
        child did not raise), so the guard's allocation step
        (``LoadOwnership.allocate``) handles a load that never started in the
        same call. vLLM's own callers ignore the value."""
        try:
            self._child.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:
            return self._contain(ALLOC, request, num_external_tokens)
        return None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        try:
            result: tuple[bool, dict[str, Any] | None] = self._child.request_finished(
                request, block_ids
            )
        except Exception:
            self._contain(FINISHED, request)
            return False, None
        return result

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        try:
            result: tuple[bool, dict[str, Any] | None] = (
                self._child.request_finished_all_groups(request, block_ids)
            )
        except Exception:
            self._contain(FINISHED, request)
            return False, None
        return result


__all__ = ["ALLOC", "FINISHED", "LOOKUP", "ChildFault", "ContainedChild"]
