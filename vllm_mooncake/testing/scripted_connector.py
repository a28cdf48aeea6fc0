"""A KV connector whose loads are scripted per request, and the fake worker
that completes them.

What is faked, and why: there is no GPU and no RDMA here, so no KV bytes move.
Everything on the scheduler side is real: this is a genuine
``KVConnectorBase_V1`` built by vLLM's factory (alone or as a child of
MultiConnector / the guard connector), it answers vLLM's real scheduler
hooks, and it ships its load orders to the "worker" through the real
``SchedulerOutput.kv_connector_metadata``. :class:`ScriptedTransferWorker`
plays the worker half: it reads those orders and, after the scripted number
of steps, reports ``finished_recving`` / ``failed_recving`` /
``invalid_block_ids`` in a real ``KVConnectorOutput``.

Request life cycle, as scripted by ``kv_transfer_params[<params_key>]``::

    {"tokens": -1,          # external tokens to offer (-1: the whole prompt)
     "async": true,         # load asynchronously (WAITING_FOR_REMOTE_KVS)
     "done_after": 1,       # worker steps until the receive completes
     "done_after_s": null,  # or: simulated seconds (needs the worker's clock,
                            # ScriptedTransferWorker.set_window)
     "outcome": "ok",       # "ok" | "fail" (nothing valid) | "partial"
     "valid_tokens": 0,     # for "partial": tokens that did arrive
     "failing_attempts": -1,# loads that fail before one succeeds (-1: all)
     "defer_lookups": 0,    # lookups answered "ask again later" (None) first
     "reoffer": false,      # offer the hit again after a preemption
                            # (store-like); a P->D transfer is one-shot
     "delay_free": false,   # producer side of a P->D transfer (NIXL on P):
                            # when the request finishes, keep its blocks until
                            # the worker reports it in finished_sending
     "raise_in": ""}        # a buggy child: raise in "lookup" (every one),
                            # "alloc" (the first load) or "finished"

1. lookup   -- ``get_num_new_matched_tokens`` offers the scripted tokens.
2. alloc    -- ``update_state_after_alloc`` records a load order with the
               block ids vLLM allocated.
3. meta     -- ``build_connector_meta`` hands the orders to the worker.
4. transfer -- the worker counts ``done_after`` steps, then reports.
5. finished -- ``request_finished`` forgets the request; with
               ``delay_free`` it asks vLLM to keep the blocks until the
               worker reports the send done (``advance(extra_finished_sending=)``,
               which the simulator calls when the decode side has pulled).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.outputs import KVConnectorOutput

from vllm_mooncake.testing.outputs import kv_connector_output

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

ReqId = str

DEFAULT_PARAMS_KEY = "scripted_load"
OUTCOMES = ("ok", "fail", "partial")
# Hooks a script can make the connector raise in (a buggy child connector):
# every lookup, the first load's update_state_after_alloc, request_finished.
RAISE_HOOKS = ("", "lookup", "alloc", "finished")


class ScriptedChildFault(RuntimeError):
    """Raised by the scripted connector where its script says (``raise_in``)."""


class ScriptError(ValueError):
    """A scripted load in ``kv_transfer_params`` is malformed."""


@dataclass(frozen=True)
class LoadScript:
    """What the connector offers for one request, parsed from its params."""

    tokens: int = -1
    is_async: bool = True
    done_after: int = 1
    outcome: str = "ok"
    valid_tokens: int = 0
    reoffer: bool = False
    failing_attempts: int = -1
    done_after_s: float | None = None
    delay_free: bool = False
    defer_lookups: int = 0
    raise_in: str = ""

    def outcome_of_attempt(self, attempt: int) -> str:
        """Outcome of the ``attempt``-th load (0-based) of this request."""
        if self.failing_attempts < 0 or attempt < self.failing_attempts:
            return self.outcome
        return "ok"

    @classmethod
    def parse(cls, raw: object, where: str) -> LoadScript:
        if not isinstance(raw, dict):
            raise ScriptError(f"{where}: expected a mapping, got {raw!r}")
        known = {
            "tokens",
            "async",
            "done_after",
            "outcome",
            "valid_tokens",
            "reoffer",
            "failing_attempts",
            "defer_lookups",
            "done_after_s",
            "delay_free",
            "raise_in",
        }
        unknown = set(raw) - known
        if unknown:
            raise ScriptError(
                f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        script = cls(
            tokens=int(raw.get("tokens", -1)),
            is_async=bool(raw.get("async", True)),
            done_after=int(raw.get("done_after", 1)),
            outcome=str(raw.get("outcome", "ok")),
            valid_tokens=int(raw.get("valid_tokens", 0)),
            reoffer=bool(raw.get("reoffer", False)),
            failing_attempts=int(raw.get("failing_attempts", -1)),
            defer_lookups=int(raw.get("defer_lookups", 0)),
            done_after_s=_optional_seconds(raw.get("done_after_s"), where),
            delay_free=bool(raw.get("delay_free", False)),
            raise_in=str(raw.get("raise_in", "")),
        )
        if script.raise_in not in RAISE_HOOKS:
            raise ScriptError(
                f"{where}.raise_in: {script.raise_in!r} is not one of {RAISE_HOOKS}"
            )
        if script.outcome not in OUTCOMES:
            raise ScriptError(
                f"{where}.outcome: {script.outcome!r} is not one of {OUTCOMES}"
            )
        if script.done_after < 0:
            raise ScriptError(f"{where}.done_after: must be >= 0")
        if script.done_after_s is not None and script.done_after_s < 0:
            raise ScriptError(f"{where}.done_after_s: must be >= 0")
        return script


def _optional_seconds(raw: object, where: str) -> float | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ScriptError(f"{where}.done_after_s: expected seconds, got {raw!r}")
    return float(raw)


@dataclass
class LoadOrder:
    """One load the scheduler side asks the worker to perform."""

    req_id: ReqId
    block_ids: list[int]
    first_token: int  # tokens already computed locally before the load
    num_tokens: int  # external tokens loaded
    script: LoadScript
    block_size: int
    outcome: str = "ok"

    def invalid_block_ids(self) -> set[int]:
        """Blocks whose tokens did not arrive, for a partial/failed load."""
        if self.outcome == "ok":
            return set()
        valid_end = self.first_token
        if self.outcome == "partial":
            valid_end += max(0, min(self.script.valid_tokens, self.num_tokens))
        end = self.first_token + self.num_tokens
        first_bad = valid_end // self.block_size
        last = math.ceil(end / self.block_size)
        return set(self.block_ids[first_bad:last])


@dataclass
class ScriptedLoadMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker: loads to start this step."""

    connector_key: str
    loads: dict[ReqId, LoadOrder] = field(default_factory=dict)


class ScriptedLoadConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Scheduler-side connector whose loads follow per-request scripts.

    ``kv_connector_extra_config``: ``params_key`` (which key of
    ``kv_transfer_params`` this connector reads; default ``scripted_load``).
    Two instances with different keys stand for a store loader and a P->D
    transfer under MultiConnector or the guard connector.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.params_key: str = str(extra.get("params_key", DEFAULT_PARAMS_KEY))
        self.block_size: int = vllm_config.cache_config.block_size
        # Set by lookup, read by alloc: where the external range starts.
        self._lookup_start: dict[ReqId, int] = {}
        # Set by alloc, drained by build_connector_meta.
        self._orders: dict[ReqId, LoadOrder] = {}
        # Loads started per request (P->D transfers are not offered twice).
        self._attempts: dict[ReqId, int] = {}
        # Lookups answered so far per request (for defer_lookups).
        self._lookups_seen: dict[ReqId, int] = {}
        # Call log, for tests that check which child was asked.
        self.lookups: list[ReqId] = []

    # ---- scheduler side -------------------------------------------------
    def claim_keys(self) -> frozenset[str]:
        """The ``kv_transfer_params`` key this child's loads carry (routing)."""
        return frozenset({self.params_key})

    def script_for(self, request: Request) -> LoadScript | None:
        params = request.kv_transfer_params or {}
        if self.params_key not in params:
            return None
        where = f"kv_transfer_params.{self.params_key}"
        return LoadScript.parse(params[self.params_key], where)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.lookups.append(request.request_id)
        script = self.script_for(request)
        if script is None:
            return 0, False
        if script.raise_in == "lookup":
            raise ScriptedChildFault(f"{request.request_id}: scripted lookup fault")
        seen = self._lookups_seen.get(request.request_id, 0)
        self._lookups_seen[request.request_id] = seen + 1
        if seen < script.defer_lookups:
            return None, False  # "ask again later", like an async store lookup
        if self._attempts.get(request.request_id) and not script.reoffer:
            return 0, False
        prompt = request.num_prompt_tokens
        total = prompt if script.tokens < 0 else min(script.tokens, prompt)
        if not script.is_async:
            # A synchronous hit must leave one token to compute.
            total = min(total, prompt - 1)
        num_new = max(0, total - num_computed_tokens)
        self._lookup_start[request.request_id] = num_computed_tokens
        return num_new, bool(num_new) and script.is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        first = self._lookup_start.pop(req_id, 0)
        if num_external_tokens <= 0:
            return
        script = self.script_for(request)
        assert script is not None, f"{req_id}: allocated a load it never offered"
        attempt = self._attempts.get(req_id, 0)
        self._attempts[req_id] = attempt + 1
        if script.raise_in == "alloc" and attempt == 0:
            raise ScriptedChildFault(f"{req_id}: scripted fault starting its load")
        self._orders[req_id] = LoadOrder(
            req_id=req_id,
            block_ids=list(blocks.get_block_ids()[0]),
            first_token=first,
            num_tokens=num_external_tokens,
            script=script,
            block_size=self.block_size,
            outcome=script.outcome_of_attempt(attempt),
        )

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> ScriptedLoadMetadata:
        meta = ScriptedLoadMetadata(connector_key=self.params_key, loads=self._orders)
        self._orders = {}
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._attempts.pop(request.request_id, None)
        self._lookups_seen.pop(request.request_id, None)
        self._lookup_start.pop(request.request_id, None)
        self._orders.pop(request.request_id, None)
        script = self.script_for(request)
        if script is not None and script.raise_in == "finished":
            raise ScriptedChildFault(f"{request.request_id}: scripted finish fault")
        # A producer keeps its blocks until the consumer has pulled them.
        return bool(script and script.delay_free and block_ids), None

    # ---- worker side: the driver plays the worker, so these do nothing ----
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def iter_metadata(meta: object) -> Iterator[KVConnectorMetadata]:
    """Walk connector metadata, descending into MultiConnector's tuple."""
    if meta is None:
        return
    children = getattr(meta, "metadata", None)
    if isinstance(children, tuple):
        for child in children:
            yield from iter_metadata(child)
    else:
        yield meta  # type: ignore[misc]


@dataclass
class _Transfer:
    order: LoadOrder
    steps_left: int
    # Simulated time the receive lands, for ``done_after_s`` scripts.
    deadline: float | None = None

    def lands(self, window_end: float) -> bool:
        """Whether the receive completes in this step (counts a step down)."""
        if self.deadline is not None:
            return self.deadline <= window_end
        if self.steps_left > 0:
            self.steps_left -= 1
            return False
        return True


class ScriptedTransferWorker:
    """The worker half of :class:`ScriptedLoadConnector` (no GPU, no bytes).

    Each :meth:`advance` takes one step's ``SchedulerOutput``, starts the
    loads ordered in its connector metadata and returns the
    ``KVConnectorOutput`` the worker would report after this step.

    Loads scripted in steps (``done_after``) need nothing else. Loads
    scripted in seconds (``done_after_s``) need a clock: whoever drives the
    worker calls :meth:`set_window` with the simulated start and end of the
    step before each :meth:`advance`; a load started in a step lands in the
    first step whose end is at or past its start plus ``done_after_s``.
    """

    def __init__(self) -> None:
        self._transfers: dict[ReqId, _Transfer] = {}
        self.started: list[ReqId] = []
        # Simulated [start, end] of the step being advanced (seconds).
        self.window: tuple[float, float] = (0.0, 0.0)

    @property
    def in_flight(self) -> set[ReqId]:
        return set(self._transfers)

    def in_flight_orders(self) -> dict[ReqId, LoadOrder]:
        """The load orders still being written, by request (invariant checks)."""
        return {req_id: t.order for req_id, t in self._transfers.items()}

    def set_window(self, start: float, end: float) -> None:
        """The simulated time span of the next :meth:`advance` (seconds)."""
        if end < start:
            raise ValueError(f"step window ends before it starts: {start}..{end}")
        self.window = (start, end)

    def next_deadline(self) -> float | None:
        """When the next in-flight load lands, if every one is timed.

        None when nothing is in flight, or when a step-scripted load is (it
        needs every step to be driven).
        """
        deadlines = [t.deadline for t in self._transfers.values()]
        if not deadlines or any(d is None for d in deadlines):
            return None
        return min(d for d in deadlines if d is not None)

    def advance(
        self,
        scheduler_output: SchedulerOutput,
        extra_finished: Iterable[ReqId] = (),
        extra_failed: Iterable[ReqId] = (),
        extra_invalid_blocks: Iterable[int] = (),
        extra_finished_sending: Iterable[ReqId] = (),
    ) -> KVConnectorOutput:
        start, end = self.window
        for meta in iter_metadata(scheduler_output.kv_connector_metadata):
            if isinstance(meta, ScriptedLoadMetadata):
                for req_id, order in meta.loads.items():
                    seconds = order.script.done_after_s
                    deadline = None if seconds is None else start + seconds
                    self._transfers[req_id] = _Transfer(
                        order, order.script.done_after, deadline
                    )
                    self.started.append(req_id)
        finished = set(extra_finished)
        failed = set(extra_failed)
        invalid = set(extra_invalid_blocks)
        sending = set(extra_finished_sending)
        failed_blocks: set[int] = set()
        for req_id, transfer in list(self._transfers.items()):
            if not transfer.lands(end):
                continue
            del self._transfers[req_id]
            order = transfer.order
            if not order.script.is_async:
                # A synchronous load completes inside the forward pass: no
                # receive notice, only the blocks that did not arrive.
                invalid |= order.invalid_block_ids()
                continue
            finished.add(req_id)
            if order.outcome == "fail":
                failed.add(req_id)
                failed_blocks |= order.invalid_block_ids()
            elif order.outcome == "partial":
                invalid |= order.invalid_block_ids()
        # 0.30+: failed_recving; before, a failure is a finished receive
        # whose blocks are invalid (testing/outputs.py).
        return kv_connector_output(sending, finished, failed, invalid, failed_blocks)

    def cancel(self, req_id: ReqId) -> None:
        """Forget a transfer (e.g. a request aborted before it landed)."""
        self._transfers.pop(req_id, None)
