"""Load ownership: which child loads a request, who hears of its blocks first,
and how many of its loads may fail.

A room of the guard's scheduler side (``docs/architecture.md``). The facade
(``connector.py``) hands it two of vLLM's hooks whole:

1. ``get_num_new_matched_tokens`` -> :meth:`LoadOwnership.look_up`: the
   child whose ``kv_transfer_params`` the request carries is asked alone
   (:meth:`LoadOwnership.route`; MultiConnector asks each child in turn when
   none is named, and a request that names no child it can load is computed
   locally); a hit past the retry budget is refused; the owner is recorded
   (:meth:`LoadOwnership.record_lookup`) in the request's ledger entry --
   the guard's one record of it -- and the same decision is copied to
   MultiConnector's ``_requests_to_connector``, by index, in one place
   (``_tell_multiconnector``), which its own hooks read.
2. ``update_state_after_alloc`` -> :meth:`LoadOwnership.allocate`: the owner
   hears of the blocks first, the other children after it with 0 tokens
   (MultiConnector's config order lets a non-owner consume shared
   ``kv_transfer_params``: NIXL sets ``do_remote_prefill`` to False on a
   request it does not load, and the owner then never fetches); the ledger
   records the blocks (the receive is in flight if the load is async). An
   owner that raised (``containment.py``) never started its load: it is
   handed to the receive notices (``notices.py``) as a failed load, in the
   same call. A receive that did start goes to the receive watch
   (``receive_watch.py``), with its sender (``senders.py``).

A request whose failed receive's blocks are quarantined (``quarantine.py``)
takes no external hit until its old writer is done: a late notice of that
transfer must never pass for a new load's.

Later the guarded scheduler reports the loads that failed
(:meth:`LoadOwnership.record_failed_loads`): after ``max_failed_loads`` of
them from one child, that child's hit is no longer taken and the request is
prefilled locally. A lateral preemption makes MultiConnector forget the
loader (:meth:`LoadOwnership.forget`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm_mooncake import logger_for
from vllm_mooncake.guard.config import GuardConfig
from vllm_mooncake.guard.containment import ChildFault
from vllm_mooncake.guard.ledger import BlockLedger, LedgerError, RecvState
from vllm_mooncake.guard.routing import ChildRouter, UnroutableRequest
from vllm_mooncake.guard.senders import Sender, sender_of
from vllm_mooncake.guard.stats import GuardStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logger_for(__name__)

UNROUTABLE = -1
""":meth:`LoadOwnership.route`'s answer for a request no child can load."""

Lookup = Callable[["Request", int], tuple[int | None, bool]]
"""A ``get_num_new_matched_tokens``: (matched tokens or None, async)."""

LoadNotStarted = Callable[["Request", "KVCacheBlocks", int, int], None]
"""Where a load that never started goes: (request, blocks, start, tokens)."""

ReceiveStarted = Callable[[str, "str | None", "Sender | None"], None]
"""Where a receive that started goes: (request id, owning child, sender)."""


class LoadOwnership:
    """Routing, the owner record, the allocation order and the retry budget."""

    def __init__(
        self,
        config: GuardConfig,
        ledger: BlockLedger,
        stats: GuardStats,
        router: ChildRouter,
        requests_to_connector: dict[str, int],
        on_ledger_error: Callable[[], None],
        load_not_started: LoadNotStarted,
        receive_started: ReceiveStarted,
        quarantined: Container[str],
    ) -> None:
        self.config = config
        self._ledger = ledger
        self._stats = stats
        self._router = router
        # MultiConnector's own map of request -> loading child, shared: its
        # lookup writes it, its hooks read it, its finish pops it; the guard
        # writes it only in _tell_multiconnector.
        self._requests_to_connector = requests_to_connector
        self._on_ledger_error = on_ledger_error  # called inside except LedgerError
        self._load_not_started = load_not_started
        self._receive_started = receive_started
        self._quarantined = quarantined
        # (owner, number of children) -> the order update_state_after_alloc
        # tells the children in (made once per pair).
        self._alloc_orders: dict[tuple[int | None, int], tuple[int, ...]] = {}

    # ---- 1. the lookup ------------------------------------------------------------
    def look_up(
        self,
        request: Request,
        num_computed_tokens: int,
        children: Sequence[Any],
        ask_all: Lookup,
    ) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens`` for ``request``, routed and recorded.

        ``ask_all`` is MultiConnector's own lookup (every child in turn, the
        first hit loads), used when the request names no child.
        """
        req_id = request.request_id
        if req_id in self._quarantined:  # its old writer may still report
            self.record_lookup(req_id, None, 0, False)
            return 0, False
        owner = self.route(request)
        if owner == UNROUTABLE:
            return 0, False
        if owner is None:
            num_tokens, is_async = ask_all(request, num_computed_tokens)
            if num_tokens:  # MultiConnector's choice, as its lookup made it
                owner = self._requests_to_connector.get(req_id)
        else:
            num_tokens, is_async = children[owner].get_num_new_matched_tokens(
                request, num_computed_tokens
            )
        if num_tokens is None:
            return None, False
        if num_tokens and not self._within_retry_budget(req_id, owner):
            num_tokens, is_async, owner = 0, False, None  # computed locally
        self.record_lookup(req_id, owner, num_tokens, is_async, num_computed_tokens)
        return num_tokens, is_async

    def route(self, request: Request) -> int | None:
        """The child whose ``kv_transfer_params`` ``request`` carries.

        ``None``: no child claims them (MultiConnector asks each in turn);
        :data:`UNROUTABLE`: they name no child that can load them -- the
        request is computed locally, counted and logged.
        """
        try:
            return self._router.owner_for(request.kv_transfer_params)
        except UnroutableRequest as exc:
            req_id = request.request_id
            self._stats.unroutable_requests += 1
            logger.error("request %s: %s Computing it locally instead.", req_id, exc)
            self.record_lookup(req_id, None, 0, False)
            return UNROUTABLE

    def record_lookup(
        self,
        req_id: str,
        owner: int | None,
        num_tokens: int,
        is_async: bool,
        num_computed_tokens: int = 0,
    ) -> None:
        """``owner`` loads ``num_tokens`` of ``req_id`` from token
        ``num_computed_tokens`` (no owner without tokens): the ledger records
        it by name, MultiConnector gets the same decision by index."""
        loader = owner if num_tokens else None
        self._tell_multiconnector(req_id, loader)
        name = self._router.names[loader] if loader is not None else None
        try:
            self._ledger.on_lookup(
                req_id, name, num_tokens, is_async, num_computed_tokens
            )
        except LedgerError:
            self._on_ledger_error()

    def forget(self, req_id: str) -> None:
        """``req_id``'s blocks are gone (a lateral preemption): MultiConnector
        forgets its loader; the next lookup decides again."""
        self._tell_multiconnector(req_id, None)

    def _tell_multiconnector(self, req_id: str, owner: int | None) -> None:
        """The one place the guard writes MultiConnector's copy of the owner."""
        if owner is None:
            self._requests_to_connector.pop(req_id, None)
        else:
            self._requests_to_connector[req_id] = owner

    # ---- the load-retry budget ---------------------------------------------------
    def _within_retry_budget(self, req_id: str, owner: int | None) -> bool:
        """Whether ``owner``'s hit for ``req_id`` may be taken.

        False once ``max_failed_loads`` loads of the request from that child
        have failed: the guard then reports no external hit, and vLLM
        prefills the request locally instead of loading it again (under
        ``kv_load_failure_policy=recompute`` a store that keeps failing the
        load would otherwise be offered it forever). Counted and logged once
        per request and child.
        """
        config = self.config
        if owner is None or not config.valve:
            return True  # reserve / no-reserve: upstream's behaviour
        child = self._router.names[owner]
        failures = self._ledger.failed_loads(req_id, child)
        if failures < config.max_failed_loads:
            return True
        if self._ledger.cut_off(req_id, child):
            self._stats.load_retry_cutoffs[child] += 1
            logger.warning(
                "request %s: %d loads from %s failed (max_failed_loads=%d); "
                "computing it locally instead of loading it again",
                req_id,
                failures,
                child,
                config.max_failed_loads,
            )
        return False

    def record_failed_loads(self, req_ids: Iterable[str]) -> None:
        """Loads of ``req_ids`` failed (in full or in part) this step.

        The guarded scheduler reports them from ``update_from_output``:
        ``failed_recving`` for async loads, ``invalid_block_ids`` for blocks
        of waiting (async) or running (sync) requests. Each counts against
        the load's owning child, as the ledger records it.
        """
        for req_id in req_ids:
            self._ledger.on_load_failed(req_id)

    # ---- 2. the allocation ----------------------------------------------------------
    def alloc_order(
        self, req_id: str, num_children: int
    ) -> tuple[int | None, tuple[int, ...]]:
        """The loading child of ``req_id`` (None: no load) and the order the
        children hear of its allocation: the owner first, the others in
        config order. MultiConnector's copy is read, as its own
        ``update_state_after_alloc`` reads it."""
        owner = self._requests_to_connector.get(req_id)
        key = (owner, num_children)
        order = self._alloc_orders.get(key)
        if order is None:
            first = () if owner is None else (owner,)
            rest = tuple(i for i in range(num_children) if i != owner)
            order = self._alloc_orders[key] = first + rest
        return owner, order

    def allocate(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
        children: Sequence[Any],
    ) -> None:
        """``update_state_after_alloc``: the children told in :meth:`alloc_order`,
        the owner with the tokens to load; then the ledger, and a load its
        owner never started handed on as failed."""
        req_id = request.request_id
        owner, order = self.alloc_order(req_id, len(children))
        fault = None
        for i in order:
            if i == owner:
                fault = children[i].update_state_after_alloc(
                    request, blocks, num_external_tokens
                )
            else:
                children[i].update_state_after_alloc(request, blocks, 0)
        num_blocks = len(blocks.blocks[0]) if blocks.blocks else 0
        ledger = self._ledger
        try:
            ledger.on_alloc(req_id, num_blocks, num_external_tokens)
        except LedgerError:
            self._on_ledger_error()
        if num_external_tokens <= 0:
            return
        entry = ledger.get(req_id)
        if isinstance(fault, ChildFault):
            start = request.num_computed_tokens if entry is None else entry.load_start
            self._load_not_started(request, blocks, start, num_external_tokens)
        elif entry is not None and entry.recv is RecvState.IN_FLIGHT:
            sender = sender_of(request.kv_transfer_params)
            self._receive_started(req_id, entry.owner, sender)

    def on_child_fault(self, fault: ChildFault) -> None:
        """A contained child raised (``containment.py``): count it. A load
        it never started comes back from the allocation itself."""
        self._stats.child_errors[f"{fault.child}|{fault.hook}"] += 1


__all__ = ["UNROUTABLE", "LoadNotStarted", "LoadOwnership", "Lookup", "ReceiveStarted"]
