"""The guarded scheduler's observer seam: what it tells whoever watches it.

The invariant checker (``testing/invariants.py``), the simulator
(``tools/sim/rank.py``) and the tests watch the guard here, never through
its private names (``tests/test_private_reach.py`` and the house plan's
"No private reach" contract fail on one). Subclass :class:`GuardObserver`,
override what you need (every hook is a no-op), and attach it with
``scheduler.add_guard_observer(observer)``.

Once per ``schedule()`` call, in this order:

1. :meth:`~GuardObserver.admission` -- every allocation the valve answered
   for a request being admitted (WAITING / PREEMPTED), after the valve is
   done with it: ``None`` means admission failed;
2. :meth:`~GuardObserver.before_lateral` and
   :meth:`~GuardObserver.after_lateral` -- around each lateral preemption
   (inside 1., while the valve retries);
3. :meth:`~GuardObserver.scheduled` -- after the call, with the waiting
   holders as the guard sees them.

Once per ``update_from_output()`` that reports loads:
:meth:`~GuardObserver.notices_filtered`, the receive notices before and
after the guard's filter.

With an observer that overrides :meth:`~GuardObserver.admission` attached,
the valve is armed on every call (otherwise only when it may act); what it
does is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from vllm_mooncake.guard.ledger import HolderView, Victim


class GuardObserver:
    """The hooks a guarded scheduler calls; each does nothing here."""

    def admission(self, request: Request, blocks: KVCacheBlocks | None) -> None:
        """The valve's answer for ``request``'s allocation (None: it failed)."""

    def before_lateral(
        self, victim: Victim, target: Request, holders: Sequence[HolderView]
    ) -> None:
        """``victim`` is about to be preempted laterally to admit ``target``;
        ``holders`` are the waiting holders the ledger picked it from."""

    def after_lateral(self, victim: Victim, target: Request) -> None:
        """``victim``'s admission was undone (vLLM's state and the ledger's)."""

    def scheduled(self, output: SchedulerOutput, holders: Sequence[HolderView]) -> None:
        """A ``schedule()`` call returned ``output``; ``holders`` wait now."""

    def notices_filtered(
        self, received: AbstractSet[str], passed: AbstractSet[str]
    ) -> None:
        """The finished receives a worker output named, and those the
        guard's filter passed on to vLLM."""


__all__ = ["GuardObserver"]
