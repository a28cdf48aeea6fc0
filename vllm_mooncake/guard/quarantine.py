"""Quarantine: blocks a failed receive's writer may still write stay unused.

A room of the guard's scheduler side (``docs/architecture.md``). When the
guard fails a receive that never landed (``receive_watch.py``), its sender
may still be alive -- slow, stopped, or cut off -- and write into the blocks
later. vLLM then frees them (``kv_load_failure_policy=fail``) or hands them
back to the request to recompute into (``recompute``); either way another
writer could land in blocks in use. So before vLLM sees the failure:

1. :meth:`Quarantine.hold` takes one more reference on each block the
   transfer may write (those not in the prefix cache: a receive's blocks are
   cached only once it lands), through the scheduler's block pool. vLLM's
   free then leaves them out of the free queue, and the request -- failed,
   or recomputing from token 0 -- gets other blocks;
2. the request takes no external load while it is held
   (``ownership.py``): a late notice of the old transfer must never pass
   for a new load's;
3. the hold ends -- the reference given back, the blocks free once vLLM
   freed them too -- when the writer is known to be done:
   :meth:`Quarantine.writer_done` (the worker reported the transfer's end,
   success or failure: ``notices.py``), or :meth:`Quarantine.poll` finds
   the sender dead (``senders.py``; probed every ``sender_probe_s``, per
   event, not per step). A receive with no sender to probe (a store load)
   waits for its transfer's end.

The blocks held are counted (``vllm:kv_guard_quarantined_blocks``), and each
release is logged and counted by reason. No vLLM import: the block pool is
reached through :class:`BlockHolds`, which the guarded scheduler provides.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_mooncake import logger_for
from vllm_mooncake.guard.config import GuardConfig
from vllm_mooncake.guard.senders import Sender, SenderProbes
from vllm_mooncake.guard.stats import GuardStats

logger = logger_for(__name__)

TRANSFER_ENDED = "transfer_ended"
SENDER_DEAD = "sender_dead"


class BlockHolds(Protocol):
    """One more reference on blocks, and giving it back (the block pool)."""

    def hold_blocks(self, blocks: Sequence[Any]) -> None: ...

    def release_blocks(self, blocks: Sequence[Any]) -> None: ...


@dataclass(slots=True)
class _Held:
    blocks: Sequence[Any]
    sender: Sender | None


class Quarantine:
    """The blocks held for failed receives' writers (see the module docstring)."""

    def __init__(
        self, config: GuardConfig, stats: GuardStats, probes: SenderProbes
    ) -> None:
        self.config = config
        self._stats = stats
        self._probes = probes
        self.clock: Callable[[], float] = time.monotonic
        self.holds: BlockHolds | None = None  # set by the guarded scheduler
        self._held: dict[str, _Held] = {}
        # The ids held, as a view (a lookup asks it per request: no call).
        self.held_ids = self._held.keys()
        # When poll() next asks the senders (inf: no held entry has one).
        self.next_check = math.inf

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, req_id: str, blocks: Sequence[Any], sender: Sender | None) -> None:
        """Keep ``blocks`` from reuse until ``req_id``'s writer is done."""
        if not blocks or req_id in self._held:
            return
        assert self.holds is not None, "the guarded scheduler binds the block pool"
        self.holds.hold_blocks(blocks)
        self._held[req_id] = _Held(blocks, sender)
        self._stats.quarantined_blocks += len(blocks)
        if sender is not None and self.config.sender_probe_s > 0:
            self._probes.ask(sender)
            self.next_check = min(
                self.next_check, self.clock() + self.config.sender_probe_s
            )

    def writer_done(self, req_id: str) -> None:
        """The transfer of ``req_id`` reported its end: nothing writes now."""
        if req_id in self._held:
            self._release(req_id, TRANSFER_ENDED)

    def poll(self, now: float) -> None:
        """Release what dead senders held; probe the others again."""
        probe_s = self.config.sender_probe_s
        self.next_check = math.inf
        for req_id, held in list(self._held.items()):
            sender = held.sender
            if sender is None or probe_s <= 0:
                continue
            if self._probes.is_dead(sender):
                self._release(req_id, SENDER_DEAD)
                continue
            self._probes.ask(sender)
            self.next_check = now + probe_s

    def _release(self, req_id: str, reason: str) -> None:
        held = self._held.pop(req_id)
        assert self.holds is not None
        self.holds.release_blocks(held.blocks)
        self._stats.quarantined_blocks -= len(held.blocks)
        self._stats.quarantine_releases[reason] += 1
        logger.info(
            "wedge guard released %d quarantined KV block(s) of request %s: %s",
            len(held.blocks),
            req_id,
            reason,
        )


__all__ = ["SENDER_DEAD", "TRANSFER_ENDED", "BlockHolds", "Quarantine"]
