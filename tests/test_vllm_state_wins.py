"""vLLM's state wins over the ledger's, on vLLM's real 0.32 scheduler.

The guard's notice filter drops duplicate and late receive notices by the
ledger. When the ledger missed a receive start (or forgot the request) while
vLLM still waits on the notice, dropping it leaks the request: vLLM keeps it
in WAITING_FOR_REMOTE_KVS, or keeps an aborted one and its blocks, forever.
Each test runs the same steps under stock vLLM (MultiConnector, vLLM's
Scheduler) and under the guard: both must end the request and free
everything; the guard counts the disagreement and logs it once.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from vllm_mooncake.guard.connector import WedgeGuardConnector
from vllm_mooncake.guard.scheduler import WedgeGuardScheduler
from vllm_mooncake.testing.configs import guarded, pd_transfer, scripted_multi
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver
from vllm_mooncake.testing.invariants import (
    InvariantChecker,
    InvariantViolation,
    awaited_notices,
    notice_problems,
)
from vllm_mooncake.testing.leaks import assert_scheduler_empty, scheduler_leaks

SIDE_LOGGER = "vllm.vllm_mooncake.guard.notices"
KINDS = ("stock", "guard")


def _driver(kind: str) -> SchedulerDriver:
    if kind == "stock":
        return SchedulerDriver.build(EngineShape(), scripted_multi(), Scheduler)
    d = SchedulerDriver.build(EngineShape(), guarded())
    assert type(d.scheduler) is WedgeGuardScheduler
    return d


def _disagreement_lines(caplog: pytest.LogCaptureFixture, req_id: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "ledger disagrees" in r.getMessage() and req_id in r.getMessage()
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_abort_while_waiting_for_remote_kvs_frees_the_request(
    kind: str, guard_log: pytest.LogCaptureFixture
) -> None:
    """vLLM's test_abort_request_waiting_for_remote_kvs, on both stacks.

    vLLM holds ``r`` in WAITING_FOR_REMOTE_KVS (its load started where the
    ledger did not see it); ``r`` is aborted, so vLLM keeps it until the
    receive notice lands; the ledger, which saw no receive, forgets it at
    the abort and calls the notice late. The guard used to drop it: ``r``
    stayed in ``scheduler.requests`` for good (stock frees it)."""
    d = _driver(kind)
    request = d.add("r", 64, max_tokens=2)
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    d.abort("r")
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert "r" in d.scheduler.requests  # kept for its receive
    d.step(finished_recving={"r"})
    assert "r" not in d.scheduler.requests
    d.run(5)
    assert_scheduler_empty(d.scheduler)
    if kind == "guard":
        side = d.scheduler.wedge_guard
        assert side.stats.ledger_disagreements == {"no_entry": 1}
        assert side.stats.dropped_recv_notices == {}
        assert len(side.ledger) == 0
        assert len(_disagreement_lines(guard_log, "r")) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_receive_the_ledger_never_saw_start_still_promotes(
    kind: str, guard_log: pytest.LogCaptureFixture
) -> None:
    """vLLM waits on ``r``'s receive but the ledger has no receive in flight
    (it would call the notice unexpected). The notice reaches vLLM, ``r`` is
    promoted, runs and finishes with its tokens; a second notice for it is a
    plain duplicate again (vLLM no longer waits: dropped, not a disagreement)."""
    d = _driver(kind)
    request = d.add("r", 64, max_tokens=3)
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    d.step()  # parked: waits for its receive
    assert d.status("r") == "WAITING_FOR_REMOTE_KVS"
    d.step(finished_recving={"r"})
    d.run(20)
    assert d.finished == {"r": "length"}
    assert_scheduler_empty(d.scheduler)
    if kind == "guard":
        side = d.scheduler.wedge_guard
        assert side.stats.ledger_disagreements == {"no_recv": 1}
        d.step(finished_recving={"r"})  # late now, by both views
        assert side.stats.ledger_disagreements == {"no_recv": 1}
        assert side.stats.dropped_recv_notices == {"late": 1}
        assert len(_disagreement_lines(guard_log, "r")) == 1
        assert_scheduler_empty(d.scheduler)


def test_notice_the_ledger_expects_but_vllm_does_not_await_is_dropped() -> None:
    """The reverse disagreement, at the filter: the ledger has ``p``'s
    receive in flight, but vLLM (the scheduler's predicate) no longer waits
    on it -- passing it on would trip vLLM's assert. It is dropped, counted,
    and the ledger takes the completion."""
    d = _driver("guard")
    d.add("p", 64, max_tokens=2, kv_transfer_params=pd_transfer(done_after=5))
    d.step()  # the receive starts
    side = d.scheduler.wedge_guard
    assert side.ledger.expects_recv("p")
    output = KVConnectorOutput(finished_recving={"p"}, failed_recving={"p"})
    side.notices.filter(output, lambda req_id: False, lambda req_id: ())
    assert not output.finished_recving and not output.failed_recving
    assert side.stats.ledger_disagreements == {"not_awaited": 1}
    assert not side.ledger.expects_recv("p")
    # With the predicate agreeing, the ledger decides as before.
    d2 = _driver("guard")
    d2.add("q", 64, max_tokens=2, kv_transfer_params=pd_transfer(done_after=5))
    d2.step()
    side2 = d2.scheduler.wedge_guard
    output = KVConnectorOutput(finished_recving={"q"})
    side2.notices.filter(output, lambda req_id: True, lambda req_id: ())
    assert output.finished_recving == {"q"}
    assert side2.stats.ledger_disagreements == {}


def test_notices_invariant_catches_a_dropped_awaited_notice() -> None:
    """The ``notices`` invariant fails a filter that drops what vLLM waits on
    (here: the guard's filter told that vLLM waits on nothing)."""
    d = _driver("guard")
    checker = InvariantChecker(d)
    request = d.add("r", 64, max_tokens=2)
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    d.abort("r")
    assert checker.aborted_mid_recv == {"r"}
    d.scheduler._awaits_recv_notice = lambda req_id: False  # a broken guard
    with pytest.raises(InvariantViolation) as info:
        d.step(finished_recving={"r"})
    assert info.value.invariant == "notices"
    assert "r: vLLM waited on its receive notice" in info.value.problems[0]
    assert scheduler_leaks(d.scheduler)  # and, unchecked, r would leak


def test_notice_helpers_read_vllm_state_only() -> None:
    d = _driver("guard")
    waiting = d.add("w", 64)
    waiting.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    d.add("plain", 64)
    scheduler = d.scheduler
    assert awaited_notices(scheduler, {"w", "plain", "gone"}, set()) == {"w"}
    scheduler.finished_recving_kv_req_ids.add("w")
    assert awaited_notices(scheduler, {"w"}, set()) == set()
    assert notice_problems({"a", "b"}, {"a"}) == [
        "b: vLLM waited on its receive notice but the guard dropped it"
    ]


def test_each_worker_output_is_filtered_once_by_one_object() -> None:
    """The guarded scheduler's ``update_from_output`` is the one caller of
    the notice filter (``ReceiveNotices.filter``): each worker output that
    reports a load goes through it once, and the connector forwards the
    output as MultiConnector does."""
    assert (
        WedgeGuardConnector.update_connector_output
        is MultiConnector.update_connector_output
    )
    d = _driver("guard")
    side = d.scheduler.wedge_guard
    filtered: list[Any] = []
    real = side.notices.filter

    def counting(output: Any, *args: Any) -> None:
        filtered.append(output)
        real(output, *args)

    side.notices.filter = counting  # type: ignore[method-assign]
    d.add("p", 64, max_tokens=2, kv_transfer_params=pd_transfer(done_after=2))
    steps = d.run(20)
    assert d.finished == {"p": "length"}
    steps.append(d.step(finished_recving={"p"}))  # a late duplicate
    outputs = [step.kv_connector_output for step in steps]
    assert len(filtered) == 2  # the receive landing, the late notice
    for output in filtered:
        assert sum(output is o for o in outputs) == 1
    assert side.stats.dropped_recv_notices == {"late": 1}
    assert_scheduler_empty(d.scheduler)
