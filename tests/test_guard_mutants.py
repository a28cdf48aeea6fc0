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
