"""Stranded receives: a receive whose sender died or went silent is failed.

Beside the guarded scheduler, like the valve: it reads and writes vLLM's
scheduler. Before each ``schedule()`` call (:meth:`StrandedReceives.check`;
one float comparison when nothing is due):

1. the receive watch (``receive_watch.py``) names the receives past
   ``recv_deadline_s`` or whose sender is dead;
2. for each, the blocks its transfer may still write are quarantined
   (``quarantine.py``: one more reference each, through the block pool) --
   before vLLM can free or reuse them;
3. the failure goes to the receive notices (``notices.py``), which report it
   with the next worker output as the worker reports a failed load (then
   step 4): vLLM's
   ``kv_load_failure_policy`` ends the request with an error (``fail``) or
   prefills it locally from token 0 in other blocks (``recompute``). A
   request aborted while it waited (vLLM kept it, blocks and all, for its
   notice) is freed by that report; on 0.34 its load slot comes back too.
   If the worker reports the transfer in that same output, the worker's
   outcome stands and the quarantine ends at once;
4. one WARNING line and a ``vllm:kv_guard_receives_failed`` count per
   failed receive; the quarantine's own probes release the blocks later.
"""

from __future__ import annotations

import math
from typing import Any

from vllm_mooncake import logger_for
from vllm_mooncake.compat.releases import SchedulerAccess
from vllm_mooncake.guard.receive_watch import Stranded
from vllm_mooncake.guard.scheduler_side import GuardSchedulerSide

logger = logger_for(__name__)


class StrandedReceives:
    """One scheduler's check for receives that will not land."""

    def __init__(
        self, scheduler: Any, side: GuardSchedulerSide, access: SchedulerAccess
    ) -> None:
        self.scheduler = scheduler
        self.side = side
        self._access = access
        side.quarantine.holds = access
        vllm_config = getattr(scheduler, "vllm_config", None)
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        self._policy = str(getattr(ktc, "kv_load_failure_policy", "fail"))

    def check(self) -> None:
        """Steps 1-4 of the module docstring, for what is due now."""
        side = self.side
        receives, quarantine = side.receives, side.quarantine
        if receives.next_due == math.inf and quarantine.next_check == math.inf:
            return
        now = receives.clock()
        if now >= receives.next_due:
            for stranded in receives.due(now):
                self._fail(stranded)
        if now >= quarantine.next_check:
            quarantine.poll(now)

    def _fail(self, stranded: Stranded) -> None:
        request = self.scheduler.requests.get(stranded.req_id)
        if request is None:
            return  # gone: vLLM freed it already
        writable, block_ids = self._access.request_blocks(request)
        side = self.side
        side.quarantine.hold(stranded.req_id, writable, stranded.sender)
        side.notices.fail_receive(
            stranded.req_id, block_ids, lambda: self._reported(stranded, writable)
        )

    def _reported(self, stranded: Stranded, writable: list[Any]) -> None:
        """vLLM got the failure: count it, and one WARNING line."""
        reason = stranded.reason.value
        self.side.stats.receives_failed[f"{reason}|{stranded.owner or 'none'}"] += 1
        logger.warning(
            "wedge guard failed request %s's KV receive from %s: %s after %.1f s "
            "in flight (sender %s); kv_load_failure_policy=%s decides; %d "
            "block(s) quarantined",
            stranded.req_id,
            stranded.owner,
            reason,
            stranded.age_s,
            stranded.sender or "unknown",
            self._policy,
            len(writable),
        )


__all__ = ["StrandedReceives"]
