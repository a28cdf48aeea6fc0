"""The ledger alone: a plain class, no vLLM (the candidate rule and states)."""

from __future__ import annotations

import pytest

from vllm_mooncake.guard.ledger import (
    BlockLedger,
    HolderView,
    LedgerError,
    RecvState,
    VictimReason,
    WaitStatus,
)


def _ledger_with(*req_ids: str) -> BlockLedger:
    ledger = BlockLedger()
    for r in req_ids:
        ledger.on_arrival(r)
    return ledger


def _loaded(
    ledger: BlockLedger, req_id: str, blocks: int = 10, done: bool = True
) -> None:
    ledger.on_lookup(req_id, "NixlConnector", 160, True)
    ledger.on_alloc(req_id, blocks, 160)
    if done:
        assert ledger.accept_recv_complete(req_id, failed=False)


def _view(
    req_id: str,
    status: WaitStatus,
    computed: int = 160,
    blocks: int = 10,
    recv_finished: bool = True,
) -> HolderView:
    return HolderView(req_id, status, computed, blocks, recv_finished)


@pytest.mark.parametrize(
    ("status", "recv_done", "expected"),
    [
        (WaitStatus.WAITING_FOR_REMOTE_KVS, True, VictimReason.RECV_DONE),
        (WaitStatus.WAITING_FOR_REMOTE_KVS, False, None),
        (WaitStatus.WAITING, True, VictimReason.PROMOTED_IDLE),
        (WaitStatus.PREEMPTED, True, VictimReason.PROMOTED_IDLE),
        (WaitStatus.RUNNING, True, None),
        (WaitStatus.WAITING_FOR_GRAMMAR, True, None),
        (WaitStatus.OTHER, True, None),
    ],
)
def test_candidate_predicate_across_statuses(
    status: WaitStatus, recv_done: bool, expected: VictimReason | None
) -> None:
    ledger = _ledger_with("a")
    _loaded(ledger, "a", done=recv_done)
    view = _view("a", status, recv_finished=recv_done)
    assert ledger.candidate_reason(view, target="head") is expected


def test_in_flight_receive_is_never_a_candidate_even_if_scheduler_says_done() -> None:
    ledger = _ledger_with("a")
    _loaded(ledger, "a", done=False)
    view = _view("a", WaitStatus.WAITING_FOR_REMOTE_KVS, recv_finished=True)
    assert ledger.candidate_reason(view, target="head") is None


def test_target_is_never_its_own_victim() -> None:
    ledger = _ledger_with("a")
    _loaded(ledger, "a")
    view = _view("a", WaitStatus.WAITING_FOR_REMOTE_KVS)
    assert ledger.pick_victim([view], target="a") is None
    assert ledger.pick_victim([view], target="b") is not None


def test_holders_without_blocks_are_not_candidates() -> None:
    ledger = _ledger_with("a")
    _loaded(ledger, "a")
    assert (
        ledger.candidate_reason(_view("a", WaitStatus.WAITING, blocks=0), "h") is None
    )


def test_least_progressed_wins_ties_go_to_latest_arrival() -> None:
    ledger = _ledger_with("early", "mid", "late", "far")
    for r in ("early", "mid", "late", "far"):
        _loaded(ledger, r)
    views = [
        _view("early", WaitStatus.WAITING_FOR_REMOTE_KVS, computed=320),
        _view("mid", WaitStatus.WAITING_FOR_REMOTE_KVS, computed=160),
        _view("late", WaitStatus.WAITING_FOR_REMOTE_KVS, computed=160),
        _view("far", WaitStatus.WAITING, computed=480),
    ]
    victim = ledger.pick_victim(views, target="head")
    assert victim is not None and victim.req_id == "late"
    assert victim.owner == "NixlConnector"
    victim = ledger.pick_victim(views[:2] + views[3:], target="head")
    assert victim is not None and victim.req_id == "mid"


def test_duplicate_and_late_receive_notices_are_dropped() -> None:
    ledger = _ledger_with("a")
    _loaded(ledger, "a", done=False)
    assert ledger.accept_recv_complete("a", failed=False)
    assert not ledger.accept_recv_complete("a", failed=False)  # duplicate
    ledger.on_finished("a")
    assert "a" not in ledger
    assert not ledger.accept_recv_complete("a", failed=False)  # late
    assert not ledger.accept_recv_complete("never", failed=False)  # unexpected
    assert (
        ledger.dropped.duplicate,
        ledger.dropped.late,
        ledger.dropped.unexpected,
    ) == (
        1,
        1,
        1,
    )


def test_finished_mid_receive_drains_when_the_receive_lands() -> None:
    ledger = _ledger_with("a")
    _loaded(ledger, "a", done=False)
    ledger.on_finished("a")
    assert "a" in ledger  # its blocks are still being written
    assert ledger.accept_recv_complete("a", failed=True)
    assert "a" not in ledger


def test_failed_receive_is_recorded_as_failed() -> None:
    ledger = _ledger_with("a")
    _loaded(ledger, "a", done=False)
    ledger.accept_recv_complete("a", failed=True)
    assert ledger.recv_state("a") is RecvState.FAILED


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda led: led.on_arrival("a"), "arrived twice"),
        (lambda led: led.on_lateral_preempt("a"), "receive is in flight"),
        (lambda led: led.on_scheduled("a", 0, 1), "scheduled while its receive"),
        (lambda led: led.on_alloc("ghost", 1, 0), "never saw arrive"),
    ],
)
def test_illegal_transitions_raise_with_a_state_specific_message(
    action: object, message: str
) -> None:
    ledger = _ledger_with("a")
    _loaded(ledger, "a", done=False)
    with pytest.raises(LedgerError, match=message):
        action(ledger)  # type: ignore[operator]


def test_ledger_module_imports_no_vllm() -> None:
    import ast
    import inspect

    import vllm_mooncake.guard.ledger as mod

    tree = ast.parse(inspect.getsource(mod))
    imported = {
        (n.module or "") if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert not any(name.startswith("vllm") for name in imported), imported


def test_scheduled_again_hands_back_only_what_needs_a_check() -> None:
    """The per-step path: a request that ran before with no receive state
    costs nothing; one that never executed or has a receive state goes back
    to the full check (which raises for a receive in flight)."""
    ledger = _ledger_with("ran", "loaded", "inflight")
    ledger.on_lookup("ran", None, 0, False)
    ledger.on_alloc("ran", 2, 0)
    ledger.on_scheduled("ran", 32, 2)
    _loaded(ledger, "loaded")
    _loaded(ledger, "inflight", done=False)
    full = ledger.on_scheduled_again(
        ["ran", "loaded", "inflight", "gone"],
        [33, 160, 160, 5],
        [([7],), ([8],), None, None],
    )
    assert full == [("loaded", 160, 11), ("inflight", 160, 10)]
    with pytest.raises(LedgerError, match="in flight"):
        ledger.on_scheduled(*full[1])
    ledger.on_scheduled(*full[0])
    # Only settled runners scheduled: nothing to hand back.
    assert ledger.on_scheduled_again(["ran", "loaded"], [34, 161], None) == []
    # A runner preempted laterally after a load is checked again when it runs.
    ledger.on_lateral_preempt("loaded")
    assert ledger.on_scheduled_again(["loaded"], [0], None) == []
    ledger.on_lookup("loaded", "store", 16, True)
    ledger.on_alloc("loaded", 4, 16)
    assert ledger.on_scheduled_again(["loaded"], [16], None) == [("loaded", 16, 4)]
