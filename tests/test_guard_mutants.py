"""Tests written for mutants of guard/ that survived the suite (bench/mutation.py).

Each test names the mutation it kills; bench/RESULTS.md ("Mutation testing")
lists every survivor, killed here or explained as equivalent.
"""

from __future__ import annotations

import pytest

from vllm_mooncake.guard.ledger import (
    BlockLedger,
    Disagreement,
    HolderView,
    LedgerError,
    RecvState,
    WaitStatus,
)
from vllm_mooncake.testing.cases import RandomDraw, draw_case, run_case
from vllm_mooncake.testing.invariants import LEDGER, InvariantViolation


def _with(*req_ids: str) -> BlockLedger:
    ledger = BlockLedger()
    for req_id in req_ids:
        ledger.on_arrival(req_id)
    return ledger


def test_recv_state_of_an_unknown_request_is_none() -> None:
    """``None if entry is None`` turned into ``... and False`` (raises)."""
    ledger = _with("a")
    assert ledger.recv_state("unknown") is None
    assert ledger.recv_state("a") is RecvState.NONE


@pytest.mark.parametrize(
    ("failed", "state"), [(False, RecvState.DONE), (True, RecvState.FAILED)]
)
def test_overruled_notice_completes_the_receive(failed: bool, state: RecvState) -> None:
    """``entry.recv = FAILED if failed else DONE`` replaced by None / swapped:
    the entry must take the completion so its candidate rule matches vLLM."""
    ledger = _with("a")
    assert ledger.overrule_recv_complete("a", failed) is Disagreement.NO_RECV
    assert ledger.recv_state("a") is state
    assert ledger.overrule_recv_complete("gone", failed) is Disagreement.NO_ENTRY


def test_failed_load_counts_only_for_an_owned_entry() -> None:
    """``entry is None or entry.owner is None`` turned into ``and``."""
    ledger = _with("a", "b")
    assert ledger.on_load_failed("unknown") is None
    assert ledger.on_load_failed("a") is None  # no owner: nothing to budget
    assert ledger.failed_loads("a", "store") == 0
    ledger.on_lookup("b", "store", 32, True)
    assert ledger.on_load_failed("b") == ("store", 1)
    assert ledger.on_load_failed("b") == ("store", 2)
    assert ledger.failed_loads("b", "store") == 2
    assert ledger.failed_loads("b", "pd") == 0
    assert ledger.failed_loads("unknown", "store") == 0


def test_cut_off_is_true_once_per_request_and_child() -> None:
    """``owner in entry.cut_off`` negated, ``or`` turned into ``and``."""
    ledger = _with("a")
    assert ledger.cut_off("unknown", "store") is False
    assert ledger.cut_off("a", "store") is True
    assert ledger.cut_off("a", "store") is False
    assert ledger.cut_off("a", "pd") is True
    assert ledger.cut_off("a", "pd") is False


def test_running_preemption_clears_the_entry() -> None:
    """on_preempted's condition negated, or its resets changed."""
    ledger = _with("a")
    ledger.on_lookup("a", None, 0, False)
    ledger.on_alloc("a", 4, 0)
    ledger.on_scheduled("a", 48, 4)
    ledger.on_preempted("a")
    entry = ledger.get("a")
    assert entry is not None
    assert (entry.num_blocks, entry.computed_tokens) == (0, 0)
    ledger.on_preempted("unknown")  # no entry: nothing to do


def test_ledger_not_told_of_a_running_preemption_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same on generated runs: vLLM's own preemption leaves a request
    PREEMPTED with no block; a ledger that was not told still has some."""
    monkeypatch.setattr(BlockLedger, "on_preempted", lambda self, req_id: None)
    for i in range(400):
        case = draw_case(RandomDraw(f"running-preemption:{i}"))
        try:
            run_case(case)
        except InvariantViolation as error:
            assert error.invariant == LEDGER, str(error)
            assert "was preempted (it holds no block) but the ledger" in str(error)
            return
    raise AssertionError("no generated case caught the silent ledger")


def test_lateral_preemption_resets_the_entry_to_zero() -> None:
    """on_lateral_preempt's resets changed to None (falsy, so a truthiness
    check would pass) or its error message changed."""
    ledger = _with("a")
    ledger.on_lookup("a", "store", 32, True)
    ledger.on_alloc("a", 4, 32)
    assert ledger.accept_recv_complete("a", failed=False)
    ledger.on_lateral_preempt("a")
    entry = ledger.get("a")
    assert entry is not None
    assert entry.recv is RecvState.NONE
    assert entry.num_blocks == 0 and entry.num_blocks is not None
    assert entry.computed_tokens == 0 and entry.computed_tokens is not None
    with pytest.raises(
        LedgerError,
        match="ghost: lateral preemption for a request the ledger never saw arrive",
    ):
        ledger.on_lateral_preempt("ghost")


def test_snapshot_names_each_holder_with_its_ledger_state() -> None:
    """snapshot's entry lookup dropped: every holder read "untracked"."""
    ledger = _with("a")
    ledger.on_lookup("a", "store", 32, True)
    ledger.on_alloc("a", 4, 32)
    view = HolderView("a", WaitStatus.WAITING_FOR_REMOTE_KVS, 0, 4, False)
    assert ledger.snapshot([view]) == (
        "a[waiting_for_remote_kvs recv=in_flight owner=store blocks=4 computed=0]"
    )
    assert ledger.snapshot([]) == "(no waiting holders)"


# ---- the second pass over guard/ledger.py -----------------------------------------
def test_lookup_without_tokens_names_no_owner_and_starts_no_receive() -> None:
    """``num_tokens > 0`` turned into ``>= 0``, ``> 1`` or always true (in
    on_lookup and on_alloc), ``pending_async`` reset to None / True."""
    ledger = _with("a", "b")
    ledger.on_lookup("a", "store", 0, True)
    entry = ledger.get("a")
    assert entry is not None and entry.owner is None and not entry.pending_async
    ledger.on_alloc("a", 2, 0)
    assert ledger.recv_state("a") is RecvState.NONE
    ledger.on_lookup("b", "store", 1, True)  # one token is a hit
    entry = ledger.get("b")
    assert entry is not None and entry.owner == "store" and entry.pending_async
    ledger.on_alloc("b", 2, 1)
    assert ledger.recv_state("b") is RecvState.IN_FLIGHT
    assert entry.pending_async is False
    # A hit taken synchronously (not async) starts no receive.
    ledger.on_arrival("c")
    ledger.on_lookup("c", "store", 16, False)
    ledger.on_alloc("c", 2, 16)
    assert ledger.recv_state("c") is RecvState.NONE
    # An allocation with no lookup in between starts no second receive.
    assert ledger.accept_recv_complete("b", failed=False)
    ledger.on_alloc("b", 3, 16)
    assert ledger.recv_state("b") is RecvState.DONE


def test_ledger_errors_name_the_request_and_the_hook() -> None:
    """The messages of the LedgerErrors (what the strict ledger raises and
    the lenient one logs) changed or dropped."""
    ledger = _with("a")
    with pytest.raises(LedgerError, match="^x: lookup for a request the ledger"):
        ledger.on_lookup("x", None, 0, False)
    with pytest.raises(LedgerError, match="^x: alloc for a request the ledger"):
        ledger.on_alloc("x", 1, 0)
    ledger.on_lookup("a", "store", 32, True)
    ledger.on_alloc("a", 2, 32)
    with pytest.raises(LedgerError, match="^a: looked up again while its receive"):
        ledger.on_lookup("a", "store", 32, True)
    ledger.get("a").pending_async = True  # type: ignore[union-attr]
    with pytest.raises(LedgerError, match="^a: a second receive started before"):
        ledger.on_alloc("a", 2, 32)
    ledger.on_finished("a")  # drains: its receive is in flight
    with pytest.raises(LedgerError, match="^a: alloc after the request finished$"):
        ledger.on_alloc("a", 2, 0)


def test_scheduling_records_progress_and_blocks() -> None:
    """on_scheduled's assignments replaced by None."""
    ledger = _with("a")
    ledger.on_scheduled("a", 48, 3)
    entry = ledger.get("a")
    assert entry is not None and entry.executed
    assert (entry.computed_tokens, entry.num_blocks) == (48, 3)


def test_dropped_notices_are_counted_one_each() -> None:
    """``+= 1`` of the dropped-notice counters turned into ``= 1``, ``-= 1``
    or ``+= 2`` (they feed vllm:kv_guard_dropped_recv_notices_total)."""
    ledger = _with("a", "b")
    for _ in range(2):
        assert not ledger.accept_recv_complete("ghost", failed=False)
        assert not ledger.accept_recv_complete("a", failed=False)  # no receive
    ledger.on_lookup("b", "store", 32, True)
    ledger.on_alloc("b", 2, 32)
    assert ledger.accept_recv_complete("b", failed=False)
    for _ in range(2):
        assert not ledger.accept_recv_complete("b", failed=False)
    assert (ledger.dropped.unexpected, ledger.dropped.duplicate) == (4, 2)


def test_recv_done_by_the_ledger_alone_is_no_candidate() -> None:
    """``view.recv_finished and entry.recv in (DONE, FAILED)`` turned into
    ``or``: a holder whose receive the ledger saw complete but that vLLM has
    not yet counted as received (or the reverse) may still be written to."""
    ledger = _with("a", "t")
    ledger.on_lookup("a", "store", 32, True)
    ledger.on_alloc("a", 2, 32)
    assert ledger.accept_recv_complete("a", failed=False)
    waiting = WaitStatus.WAITING_FOR_REMOTE_KVS
    assert ledger.candidate_reason(HolderView("a", waiting, 0, 2, False), "t") is None
    ledger.on_arrival("b")
    ledger.on_lookup("b", "store", 32, True)
    ledger.on_alloc("b", 2, 32)  # in flight per the ledger
    assert ledger.candidate_reason(HolderView("b", waiting, 0, 2, True), "t") is None


def test_picked_victim_carries_its_blocks_and_progress() -> None:
    """pick_victim's Victim built with None for blocks / computed tokens
    (the resolution log line and the simulator's records read them)."""
    ledger = _with("a", "t")
    ledger.on_lookup("a", "store", 32, True)
    ledger.on_alloc("a", 5, 32)
    assert ledger.accept_recv_complete("a", failed=False)
    view = HolderView("a", WaitStatus.WAITING_FOR_REMOTE_KVS, 7, 5, True)
    victim = ledger.pick_victim([view], "t")
    assert victim is not None
    assert (victim.num_blocks, victim.num_computed_tokens) == (5, 7)
    assert victim.owner == "store"


def test_snapshot_of_several_holders_and_an_untracked_one() -> None:
    ledger = _with("a")
    views = [
        HolderView("a", WaitStatus.WAITING, 16, 1, False),
        HolderView("zz", WaitStatus.PREEMPTED, 0, 2, False),
    ]
    assert ledger.snapshot(views) == (
        "a[waiting recv=none owner=None blocks=1 computed=16] "
        "zz[preempted recv=untracked owner=None blocks=2 computed=0]"
    )


def test_forgotten_ids_are_bounded_and_nothing_outlives_its_request() -> None:
    """The bound on remembered finished ids (``_gone``): popping the oldest
    changed (a KeyError once 65,536 requests finished); the per-step set of
    entries to check keeping finished ids (unbounded growth)."""
    ledger = BlockLedger()
    for i in range(65_540):
        req_id = f"r{i}"
        ledger.on_arrival(req_id)
        ledger.on_scheduled(req_id, 1, 1)
        ledger.on_finished(req_id)
    assert len(ledger) == 0
    assert len(ledger._gone) == 65_536
    assert "r3" not in ledger._gone and "r4" in ledger._gone
    assert not ledger._unsettled
    # The oldest forgotten: a notice for it is unexpected, for a recent one late.
    assert not ledger.accept_recv_complete("r0", failed=False)
    assert not ledger.accept_recv_complete("r65539", failed=False)
    assert (ledger.dropped.unexpected, ledger.dropped.late) == (1, 1)


def test_a_receive_starts_only_with_external_tokens() -> None:
    """on_alloc's ``num_external_tokens > 0`` turned into ``>= 0``: an
    allocation that takes no external token (vLLM did not use the hit)
    starts no receive, even after an async lookup."""
    ledger = _with("a")
    ledger.on_lookup("a", "store", 32, True)
    ledger.on_alloc("a", 2, 0)
    assert ledger.recv_state("a") is RecvState.NONE


def test_a_request_that_never_ran_leaves_no_trace_when_it_finishes() -> None:
    """_remove's ``_unsettled.discard(req_id)`` dropped: every request that
    finished before it was scheduled stayed in the per-step set forever."""
    ledger = _with("a", "b")
    ledger.on_lookup("a", "store", 32, True)
    ledger.on_alloc("a", 2, 32)
    assert ledger.accept_recv_complete("a", failed=True)
    ledger.on_finished("a")
    ledger.on_finished("b")
    assert len(ledger) == 0 and not ledger._unsettled
