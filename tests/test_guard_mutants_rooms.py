"""Tests written for surviving mutants of the guard's scheduler-side rooms
(bench/mutation.py): the receive notices, the scheduler side's error policy
and counters, the stall watch's census and resolution line, and contained
children.

Each test names the behaviour it pins; bench/RESULTS.md ("Mutation
testing") lists the mutants each one kills. The rooms are plain classes
(``docs/architecture.md``): they run here on plain objects, as in
tests/test_scheduler_side.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from vllm_mooncake.guard import notices as notices_module
from vllm_mooncake.guard.config import GuardConfig
from vllm_mooncake.guard.containment import (
    ALLOC,
    FINISHED,
    LOOKUP,
    ChildFault,
    ContainedChild,
)
from vllm_mooncake.guard.ledger import (
    BlockLedger,
    HolderView,
    Victim,
    VictimReason,
    WaitStatus,
)
from vllm_mooncake.guard.notices import ReceiveNotices
from vllm_mooncake.guard.observer import GuardObserver
from vllm_mooncake.guard.quarantine import Quarantine
from vllm_mooncake.guard.receive_watch import ReceiveWatch
from vllm_mooncake.guard.routing import ChildRouter
from vllm_mooncake.guard.scheduler_side import GuardSchedulerSide
from vllm_mooncake.guard.senders import SenderProbes
from vllm_mooncake.guard.stall_watch import StepObservation
from vllm_mooncake.guard.stats import GuardStats
from vllm_mooncake.testing.configs import guarded
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver
from vllm_mooncake.testing.wedges import W1, play

BLOCK = 16


def _notices(ledger: BlockLedger, stats: GuardStats) -> ReceiveNotices:
    """The notice filter with its receive watch and quarantine (no receive
    in flight, nothing quarantined: as these tests need)."""
    probes = SenderProbes()
    config = GuardConfig()
    return ReceiveNotices(
        ledger,
        stats,
        BLOCK,
        ReceiveWatch(config, ledger, stats, probes),
        Quarantine(config, stats, probes),
    )


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every guard logger's records, each once."""
    names = [
        f"vllm.vllm_mooncake.guard.{m}"
        for m in ("notices", "scheduler_side", "stall_watch", "containment")
    ]
    loggers = [logging.getLogger(n) for n in names]
    saved = [(log.level, log.propagate) for log in loggers]
    for log in loggers:
        log.addHandler(caplog.handler)
        log.setLevel(logging.DEBUG)
        log.propagate = False
    try:
        yield caplog
    finally:
        for log, (level, propagate) in zip(loggers, saved, strict=True):
            log.removeHandler(caplog.handler)
            log.level, log.propagate = level, propagate


def _lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == f"vllm.vllm_mooncake.guard.{logger}"
    ]


def _in_flight(ledger: BlockLedger, *req_ids: str) -> None:
    for req_id in req_ids:
        ledger.on_arrival(req_id)
        ledger.on_lookup(req_id, "pd", 64, True)
        ledger.on_alloc(req_id, 4, 64)


def _no_blocks(_: str) -> list[int]:
    return []


# ---- the receive notices ----------------------------------------------------------
def test_disagreements_are_logged_once_per_request_saying_what_became_of_the_notice(
    logs: pytest.LogCaptureFixture,
) -> None:
    """vLLM waits on a notice the ledger has no receive for: passed on; the
    ledger expects one vLLM no longer waits on: dropped. The line names the
    request, the kind and the outcome, once per request."""
    ledger, stats = BlockLedger(), GuardStats()
    notices = _notices(ledger, stats)
    ledger.on_arrival("p")  # no receive in the ledger; vLLM waits
    _in_flight(ledger, "d")  # the ledger expects it; vLLM does not wait
    for _ in range(2):
        out = KVConnectorOutput(finished_recving={"p", "d"})
        notices.filter(out, lambda r: r == "p", _no_blocks)
        assert out.finished_recving == {"p"}
    lines = [line for line in _lines(logs, "notices") if "disagrees" in line]
    assert sorted(lines) == [
        "wedge guard ledger disagrees with the scheduler on request d's receive "
        "notice (not_awaited); the scheduler's state wins: notice dropped",
        "wedge guard ledger disagrees with the scheduler on request p's receive "
        "notice (no_recv); the scheduler's state wins: notice passed on",
    ]


def test_the_once_per_request_memory_is_bounded_oldest_first(
    monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    """Past the bound the oldest request is forgotten (and would be logged
    again); the newer ones are not."""
    monkeypatch.setattr(notices_module, "_LOGGED_ONCE_MAX", 2)
    ledger = BlockLedger()
    notices = _notices(ledger, GuardStats())
    for req_id in ("a", "b", "c", "b", "a"):
        notices.filter(
            KVConnectorOutput(finished_recving={req_id}), lambda r: True, _no_blocks
        )
    logged = [line.split("request ")[1][0] for line in _lines(logs, "notices")]
    assert logged == ["a", "b", "c", "a"]


def test_each_batch_of_dropped_notices_is_logged_with_its_own_count(
    logs: pytest.LogCaptureFixture,
) -> None:
    """A duplicate notice in each of two outputs: two lines of 1, not a
    running total; the counter holds 2."""
    ledger, stats = BlockLedger(), GuardStats()
    notices = _notices(ledger, stats)
    _in_flight(ledger, "r")
    notices.filter(
        KVConnectorOutput(finished_recving={"r"}), lambda r: True, _no_blocks
    )
    for _ in range(2):  # vLLM no longer waits; the ledger saw it done
        notices.filter(
            KVConnectorOutput(finished_recving={"r"}), lambda r: False, _no_blocks
        )
    assert stats.dropped_recv_notices["duplicate"] == 2
    assert (
        _lines(logs, "notices")
        == ["wedge guard dropped 1 duplicate receive notice(s)"] * 2
    )


def _blocks(ids: list[int]) -> Any:
    return SimpleNamespace(blocks=([object()] * len(ids),) if ids else (), ids=ids)


def _load_not_started(
    notices: ReceiveNotices, req_id: str, ids: list[int], start: int, tokens: int
) -> None:
    blocks = _blocks(ids)
    blocks.get_block_ids = lambda: (ids,)
    notices.load_not_started(SimpleNamespace(request_id=req_id), blocks, start, tokens)


def test_a_sync_load_that_never_started_fails_exactly_its_blocks() -> None:
    """Tokens 16-48 of a sync load (block size 16) are blocks 1 and 2 of the
    request: those are reported invalid, added to what the worker reported;
    a request with no blocks adds none."""
    notices = _notices(BlockLedger(), GuardStats())
    _load_not_started(notices, "s", [100, 101, 102, 103, 104], 16, 32)
    _load_not_started(notices, "t", [200, 201, 202, 203, 204], 0, 40)
    _load_not_started(notices, "empty", [], 0, 16)
    out = KVConnectorOutput(invalid_block_ids={7})
    notices.filter(out, lambda r: False, _no_blocks)
    assert out.invalid_block_ids == {7, 101, 102, 200, 201, 202}
    assert not notices.pending


def test_an_async_load_that_never_started_joins_the_reported_failures() -> None:
    """The unstarted receive is added to ``finished_recving`` and
    ``failed_recving`` next to what the worker already reported there."""
    ledger = BlockLedger()
    notices = _notices(ledger, GuardStats())
    _in_flight(ledger, "a", "z")
    _load_not_started(notices, "a", [1, 2, 3, 4], 0, 64)
    out = KVConnectorOutput(finished_recving={"z"}, failed_recving={"z"})
    notices.filter(out, lambda r: True, _no_blocks)
    assert out.finished_recving == {"a", "z"}
    assert out.failed_recving == {"a", "z"}


# ---- the scheduler side: one error policy, its counters ----------------------------
def _side(**config: Any) -> GuardSchedulerSide:
    router = ChildRouter(names=("store",), claims=(frozenset(),))
    return GuardSchedulerSide(GuardConfig(**config), router, {}, block_size=BLOCK)


def test_each_ledger_refusal_is_counted_and_logged_with_its_traceback(
    logs: pytest.LogCaptureFixture,
) -> None:
    side = _side(strict=False)
    ghost = Victim("ghost", VictimReason.RECV_DONE, None, 3, 48)
    for _ in range(2):
        side.on_lateral_preemption(ghost)
    assert side.stats.ledger_errors == 2
    records = [
        r for r in logs.records if r.name == "vllm.vllm_mooncake.guard.scheduler_side"
    ]
    assert [r.getMessage() for r in records] == [
        "wedge guard ledger inconsistency (continuing)"
    ] * 2
    assert all(r.exc_info and "ghost" in str(r.exc_info[1]) for r in records)


def test_lateral_preemptions_and_spent_budgets_count_one_each() -> None:
    """A victim with no owner is counted under owner "none"; every spent
    budget counts one."""
    side = _side()
    for req_id in ("a", "b"):
        side.on_arrival(req_id)
        side.on_lateral_preemption(
            Victim(req_id, VictimReason.PROMOTED_IDLE, None, 1, 16)
        )
        side.note_attempts_exhausted()
    assert dict(side.stats.lateral_preemptions) == {("promoted_idle", "none"): 2}
    assert side.stats.attempts_exhausted == 2


# ---- the stall watch: the census and the resolution line ---------------------------
def test_the_census_counts_receives_only_of_requests_waiting_for_them() -> None:
    """recv-done and in-flight holders are WAITING_FOR_REMOTE_KVS ones; a
    promoted holder still in vLLM's finished set is neither."""
    views = [
        HolderView("done", WaitStatus.WAITING_FOR_REMOTE_KVS, 32, 2, True),
        HolderView("flying", WaitStatus.WAITING_FOR_REMOTE_KVS, 0, 3, False),
        HolderView("promoted", WaitStatus.WAITING, 64, 4, True),
    ]
    lateral = [(Victim("v", VictimReason.RECV_DONE, "pd", 1, 16), "t")]
    step = StepObservation.of(0, 0, lateral, views)
    assert step == StepObservation(0, 0, lateral, 3, 1, 9, 1)


def test_every_resolved_wedge_is_counted_and_logged_with_the_holders_left(
    logs: pytest.LogCaptureFixture,
) -> None:
    side = _side()
    side.ledger.on_arrival("h")
    holders = [HolderView("h", WaitStatus.WAITING, 16, 1, False)]
    moves = [
        (Victim("v", VictimReason.RECV_DONE, "pd", 5, 80), "t"),
        (Victim("w", VictimReason.PROMOTED_IDLE, None, 2, 32), "t"),
    ]
    for _ in range(2):
        side.watch.observe_step(
            StepObservation.of(0, 0, moves, holders), lambda: holders
        )
    assert side.stats.wedges_resolved == 2
    assert (
        _lines(logs, "stall_watch")
        == [
            "wedge guard: admission failed with nothing running; lateral preemption "
            "of v (recv_done, owner=pd, 5 blocks) for t, w (promoted_idle, "
            "owner=None, 2 blocks) for t; waiting holders now: "
            "h[waiting recv=none owner=None blocks=1 computed=16]"
        ]
        * 2
    )


# ---- contained children -----------------------------------------------------------
class _Raising:
    def get_num_new_matched_tokens(self, *args: Any) -> Any:
        raise RuntimeError("lookup broke")

    def update_state_after_alloc(self, *args: Any) -> Any:
        raise RuntimeError("alloc broke")

    def request_finished(self, *args: Any) -> Any:
        raise RuntimeError("finish broke")

    def request_finished_all_groups(self, *args: Any) -> Any:
        raise RuntimeError("finish broke")


def test_a_raising_child_costs_its_request_the_hook_and_is_reported(
    logs: pytest.LogCaptureFixture,
) -> None:
    """Each per-request hook that raises: vLLM gets the safe answer (no hit;
    blocks freed now, nothing to send), the fault names child, hook,
    request and the tokens of a load that never started, and the log line
    says so with the traceback."""
    faults: list[ChildFault] = []
    child = ContainedChild(_Raising(), "store", faults.append)
    request = SimpleNamespace(request_id="r")
    assert child.get_num_new_matched_tokens(request, 0) == (0, False)
    fault = child.update_state_after_alloc(request, object(), 48)
    assert child.request_finished(request, [1]) == (False, None)
    assert child.request_finished_all_groups(request, ([1],)) == (False, None)
    assert faults == [
        ChildFault("store", LOOKUP, "r", 0),
        ChildFault("store", ALLOC, "r", 48),
        ChildFault("store", FINISHED, "r", 0),
        ChildFault("store", FINISHED, "r", 0),
    ]
    assert fault == faults[1]
    records = [r for r in logs.records if r.name.endswith("containment")]
    assert [r.getMessage() for r in records] == [
        f"KV connector store raised in {hook} for request r; contained by the "
        "wedge guard"
        for hook in (LOOKUP, ALLOC, FINISHED, FINISHED)
    ]
    assert all(r.exc_info for r in records)


# ---- the valve: when it is installed, what admission observers hear ----------------
def _shadowed(d: SchedulerDriver) -> bool:
    """Whether the KVCacheManager's ``allocate_slots`` is an instance shadow."""
    return "allocate_slots" in vars(d.scheduler.kv_cache_manager)


def test_the_valve_is_installed_only_for_calls_that_may_admit_laterally() -> None:
    """Under ``only_when_idle`` a call that starts with a request running
    uses vLLM's own ``allocate_slots`` (the valve is taken off again after
    an idle call put it on); with the valve off by policy it is never on."""
    d = SchedulerDriver.build(EngineShape(num_blocks=40), guarded("reserve+lateral"))
    d.add("a", 16 * 4, max_tokens=4)
    d.step()  # idle at the start of the call: the valve is on
    assert _shadowed(d)
    assert d.status("a") == "RUNNING"
    d.step()  # "a" runs: off again
    assert not _shadowed(d)
    d.run(20)
    assert set(d.finished) == {"a"}

    off = SchedulerDriver.build(EngineShape(num_blocks=40), guarded("reserve"))
    off.add("a", 16 * 4, max_tokens=2)
    off.step()
    assert not _shadowed(off)


class _Admissions(GuardObserver):
    def __init__(self) -> None:
        self.seen: list[tuple[str, RequestStatus, bool]] = []

    def admission(self, request: Request, blocks: KVCacheBlocks | None) -> None:
        self.seen.append((request.request_id, request.status, blocks is not None))


def test_admission_observers_hear_every_admission_and_only_admissions() -> None:
    """W1: X's admission fails while Y's receive is in flight (no victim:
    the observer still hears the failure), later succeeds; the running
    requests' own allocations are no admissions."""
    d = SchedulerDriver.build(W1.shape, guarded("reserve+lateral"))
    observer = _Admissions()
    d.scheduler.add_guard_observer(observer)
    play(d, W1, max_steps=300)
    assert set(d.finished) == {"X", "Y"}
    assert observer.seen
    assert all(
        status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        for _, status, _ in observer.seen
    )
    assert ("X", RequestStatus.WAITING, False) in observer.seen
    assert ("X", RequestStatus.WAITING, True) in observer.seen
