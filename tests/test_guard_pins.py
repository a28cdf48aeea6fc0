"""Direct pins of guard behaviours that a deliberate bug slipped past.

A mutation study planted one bug at a time in ``vllm_mooncake/guard/``;
each behaviour below survived its bug with the whole suite green. Each test
here names the behaviour it pins and was seen failing with the bug in
brackets planted. As everywhere else, vLLM's real scheduler and KV-cache
manager run on the CPU; only the GPU and the wire are fake.

1. The candidate rule after a disagreement: a holder whose receive the
   ledger has in flight is never a lateral victim, even while vLLM shows it
   WAITING or PREEMPTED -- a transfer may still write into its blocks.
   [``candidate_reason`` checks the in-flight receive only for a
   WAITING_FOR_REMOTE_KVS view.]
2. A zero-token step with a request running is no stall: vLLM's async
   scheduler schedules nothing for a running request whose previous step
   already reached ``max_tokens``; the stall watch must not count it, nor
   raise the wedge alarm on a busy rank. [``observe_step`` without
   ``not step.num_running``; or the census reporting 0 running.]
3. A load-retry cut-off is counted and logged once per request and child,
   however many steps the cut-off request then waits for its admission.
   [Counted, or logged, on every lookup past the budget.]
4. ``ledger_disagreements`` (``vllm:kv_guard_ledger_disagreements_total``)
   counts disagreements, not requests; the log line stays once per request.
   [Counted only with the first log line of a request.]
5. Routing claims by value: a ``kv_transfer_params`` key that is present
   but null claims nothing. [``key in params`` for ``params.get(key) is
   not None``.]
6. A lateral victim's received KV is prefix-cached before its blocks are
   freed, and the victim is left as vLLM 0.31+ expects: WAITING if it never
   ran (PREEMPTED if it did), ``num_preemptions`` counted, at the head of
   ``waiting`` with no blocks, receive, reservation or KV-fetch stage left.
   [``_update_waiting_for_remote_kv`` not called; ``num_preemptions`` not
   counted; WAITING for an executed victim; the KV-fetch stage kept.]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from vllm.v1.engine import EngineCoreEventType
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from vllm_mooncake.guard.config import GuardConfig
from vllm_mooncake.guard.connector import WedgeGuardConnector
from vllm_mooncake.guard.ledger import (
    BlockLedger,
    HolderView,
    RecvState,
    Victim,
    WaitStatus,
)
from vllm_mooncake.guard.observer import GuardObserver
from vllm_mooncake.guard.routing import (
    PD_CLAIM_KEYS,
    ChildRouter,
    UnroutableRequest,
)
from vllm_mooncake.guard.scheduler import WedgeGuardAsyncScheduler
from vllm_mooncake.guard.scheduler_side import GuardSchedulerSide
from vllm_mooncake.guard.stall_watch import StepObservation
from vllm_mooncake.testing.configs import guarded, store_hit
from vllm_mooncake.testing.driver import (
    SAMPLED_TOKEN_ID,
    EngineShape,
    SchedulerDriver,
)
from vllm_mooncake.testing.leaks import assert_scheduler_empty
from vllm_mooncake.testing.outputs import model_runner_output
from vllm_mooncake.testing.real_children import (
    MOONCAKE_PARAMS,
    PEER,
    PROMPT,
    real_children_config,
)
from vllm_mooncake.testing.wedges import BLOCK, SEED, W1, play

STORE = "ScriptedLoadConnector[0]"


def _messages(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


# ---- 1. the candidate rule after a disagreement ----------------------------------
VLLM_SHOWS = [RequestStatus.WAITING, RequestStatus.PREEMPTED]


@pytest.mark.parametrize("recv_finished", [False, True], ids=["unseen", "in-set"])
@pytest.mark.parametrize(
    "status", [WaitStatus.WAITING, WaitStatus.PREEMPTED], ids=lambda s: s.value
)
def test_ledger_in_flight_holder_shown_waiting_or_preempted_is_no_candidate(
    status: WaitStatus, recv_finished: bool
) -> None:
    """The ledger alone: an entry whose receive is in flight is no candidate
    whatever the status (and finished-receive flag) vLLM shows for it."""
    ledger = BlockLedger()
    ledger.on_arrival("y")
    ledger.on_lookup("y", "NixlConnector", 800, True)
    ledger.on_alloc("y", 50, 800)
    assert ledger.recv_state("y") is RecvState.IN_FLIGHT
    view = HolderView("y", status, 800, 50, recv_finished)
    assert ledger.candidate_reason(view, target="x") is None
    assert ledger.pick_victim([view], target="x") is None


@pytest.mark.parametrize("shown", VLLM_SHOWS, ids=lambda s: s.name)
def test_in_flight_holder_shown_waiting_or_preempted_is_never_the_victim(
    shown: RequestStatus,
) -> None:
    """W1 on vLLM's real scheduler, three steps in: X's store load landed
    (X holds 40 blocks; admitting it needs 50 more, with 10 free), Y's
    50-block P->D receive is still in flight -- ledger and fake worker
    agree. vLLM then shows Y WAITING or PREEMPTED (a disagreement): the
    guard must still not choose Y to make room for X."""
    d = SchedulerDriver.build(W1.shape, guarded("reserve+lateral"))
    play(d, W1, max_steps=3)
    sched = d.scheduler
    side = sched.wedge_guard
    assert side.ledger.recv_state("Y") is RecvState.IN_FLIGHT
    assert "Y" in d.worker.in_flight  # the transfer is still writing
    assert side.stats.total_lateral_preemptions == 0
    sched.requests["Y"].status = shown
    holders = sched.guard_holders.views()
    views = {v.req_id: v for v in holders}
    assert views["Y"].status.value == shown.name.lower()
    assert views["Y"].num_blocks == 50
    assert side.pick_victim(holders, "X") is None


# ---- 2. a zero-token step with a request running is no stall ---------------------
def _side(**config: Any) -> GuardSchedulerSide:
    router = ChildRouter(names=("store",), claims=(frozenset(),))
    return GuardSchedulerSide(GuardConfig(**config), router, {}, block_size=BLOCK)


def test_a_step_that_schedules_nothing_while_a_request_runs_is_no_stall() -> None:
    """The stall watch alone: no token, a holder waiting with no receive in
    flight -- but a request runs. No stall, however many such steps; the
    same picture with nothing running is one."""
    side = _side(stall_alarm_steps=1)
    holders = [HolderView("H", WaitStatus.WAITING, 320, 20, False)]
    for _ in range(5):
        side.watch.observe_step(StepObservation.of(0, 1, (), holders), lambda: holders)
        assert side.stats.stalled_steps == 0
    assert side.stats.wedges_detected == 0
    side.watch.observe_step(StepObservation.of(0, 0, (), holders), lambda: holders)
    assert side.stats.stalled_steps == 1
    assert side.stats.wedges_detected == 1


def _update(d: SchedulerDriver, scheduler_output: Any) -> list[str]:
    """The fake worker's output for ``scheduler_output``, given to vLLM; the
    requests it finished."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    kv_output = d.worker.advance(scheduler_output)
    sampled = [[SAMPLED_TOKEN_ID] for _ in req_ids]
    engine_outputs = d.scheduler.update_from_output(
        scheduler_output, model_runner_output(req_ids, sampled, kv_output)
    )
    return [
        o.request_id
        for outputs in engine_outputs.values()
        for o in outputs.outputs
        if o.finish_reason is not None
    ]


def test_async_step_with_nothing_left_for_a_running_request_raises_no_alarm(
    guard_log: pytest.LogCaptureFixture,
) -> None:
    """vLLM's AsyncScheduler, scheduled twice before the first output (as its
    engine core does): R's last token is already scheduled, so the second
    call schedules R nothing -- 0 tokens, R running. H (recv done, 20
    blocks) waits for 10 more blocks that R holds: a holder waits with no
    receive in flight. The guard's holder census runs on this busy step
    (``gauge_interval_s=0``: the 0.1 s clock would skip it), and with
    ``stall_alarm_steps=1`` a stall counted here would be an alarm."""
    d = SchedulerDriver.build(
        EngineShape(num_blocks=41, async_scheduling=True),
        guarded("lateral", stall_alarm_steps=1, gauge_interval_s=0.0),
    )
    sched = d.scheduler
    assert type(sched) is WedgeGuardAsyncScheduler
    d.add("H", 30 * BLOCK, max_tokens=2, kv_transfer_params=store_hit(20 * BLOCK, 0))
    d.add("R", 15 * BLOCK, max_tokens=2)
    d.step()  # R prefills (its first token); H's 20-block load lands
    assert "H" in sched.finished_recving_kv_req_ids
    first = sched.schedule()  # R's last token; H promoted, does not fit
    second = sched.schedule()  # before first's output: nothing for R
    assert first.num_scheduled_tokens == {"R": 1}
    assert second.total_num_scheduled_tokens == 0
    assert [r.request_id for r in sched.running] == ["R"]
    (holder,) = sched.guard_holders.views()
    assert (holder.req_id, holder.status, holder.num_blocks) == (
        "H",
        WaitStatus.WAITING,
        20,
    )
    stats = sched.wedge_guard.stats
    assert stats.stalled_steps == 0
    assert stats.wedges_detected == 0
    assert stats.blocks_held_by_non_running == 20  # the census did run
    assert not _messages(guard_log, "wedge alarm")
    assert _update(d, first) == ["R"]
    assert _update(d, second) == []
    d.run(30)
    assert d.finished == {"H": "length"}
    assert stats.wedges_detected == 0
    assert_scheduler_empty(sched)


# ---- 3. a load-retry cut-off, counted and logged once ----------------------------
def test_cut_off_request_that_waits_for_blocks_is_counted_and_logged_once(
    guard_log: pytest.LogCaptureFixture,
) -> None:
    """A's store load (10 of its 30 blocks) fails once; with
    ``max_failed_loads=1`` its next lookup is cut off. R holds 19 of the 40
    blocks and decodes for 5 steps, so A, needing all 30, waits: its lookup
    runs again every step, and each is past the budget. The cut-off is one
    event: counted once, logged once."""
    d = SchedulerDriver.build(
        EngineShape(num_blocks=41),
        guarded("lateral", kv_load_failure_policy="recompute", max_failed_loads=1),
    )
    d.add(
        "A",
        30 * BLOCK,
        max_tokens=2,
        kv_transfer_params=store_hit(10 * BLOCK, 0, outcome="fail"),
    )
    d.add("R", 18 * BLOCK, max_tokens=6)
    d.run(40)
    assert d.finished == {"A": "length", "R": "length"}
    assert d.worker.started.count("A") == 1  # one load, then computed locally
    store = d.scheduler.connector._connectors[0]
    admitted = next(
        s.index for s in d.steps if "A" in s.scheduler_output.num_scheduled_tokens
    )
    assert admitted >= 5  # it waited behind R ...
    assert store.lookups.count("A") >= 5  # ... looked up on every step
    side = d.scheduler.wedge_guard
    assert side.stats.load_retry_cutoffs == {STORE: 1}
    lines = _messages(guard_log, "max_failed_loads")
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"request A: 1 loads from {STORE} failed")
    assert_scheduler_empty(d.scheduler)


# ---- 4. disagreements are counted, not requests ----------------------------------
def test_two_disagreements_on_one_request_count_two_and_log_once(
    guard_log: pytest.LogCaptureFixture,
) -> None:
    """vLLM waits on r's receive notice (r in WAITING_FOR_REMOTE_KVS, not yet
    reported) though the ledger saw no receive start. Two such notices reach
    the filter: each is passed on and each is a disagreement -- the counter
    moves twice; the WARNING names r once."""
    d = SchedulerDriver.build(EngineShape(), guarded())
    request = d.add("r", 64, max_tokens=2)
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS  # started unseen
    sched = d.scheduler
    side = sched.wedge_guard
    for n in (1, 2):
        assert sched._awaits_recv_notice("r")
        output = KVConnectorOutput(finished_recving={"r"})
        side.notices.filter(output, sched._awaits_recv_notice, lambda r: ())
        assert output.finished_recving == {"r"}  # vLLM's state wins
        assert side.stats.ledger_disagreements == {"no_recv": n}
    assert len(_messages(guard_log, "ledger disagrees")) == 1
    # Through vLLM's own path too: one more disagreement, r promoted and run.
    d.step(finished_recving={"r"})
    assert side.stats.ledger_disagreements == {"no_recv": 3}
    d.run(20)
    assert d.finished == {"r": "length"}
    assert len(_messages(guard_log, "ledger disagrees")) == 1
    assert_scheduler_empty(sched)


# ---- 5. routing claims by value --------------------------------------------------
NIXL, MOONCAKE = 0, 1
PD_ROUTER = ChildRouter(
    names=("NixlConnector", "MooncakeConnector"),
    claims=(PD_CLAIM_KEYS["NixlConnector"], PD_CLAIM_KEYS["MooncakeConnector"]),
)


@pytest.mark.parametrize(
    ("params", "owner"),
    [
        ({"remote_block_ids": None}, None),
        ({"transfer_id": None, "remote_bootstrap_addr": None}, None),
        ({**MOONCAKE_PARAMS, "remote_block_ids": None}, MOONCAKE),
        ({"remote_block_ids": [1], "transfer_id": None}, NIXL),
        ({"remote_block_ids": None, "transfer_id": "t"}, MOONCAKE),
    ],
    ids=["nixl-key-null", "mooncake-keys-null", "mooncake", "nixl", "mooncake-tid"],
)
def test_a_null_transfer_param_claims_nothing(
    params: dict[str, Any], owner: int | None
) -> None:
    assert PD_ROUTER.owner_for(params) == owner


def test_a_remote_prefill_with_only_null_keys_is_unroutable() -> None:
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": None,
        "transfer_id": None,
        "remote_bootstrap_addr": None,
    }
    with pytest.raises(UnroutableRequest, match=r"got keys \['do_remote_prefill'\]"):
        PD_ROUTER.owner_for(params)


def test_an_unroutable_request_is_told_each_childs_keys_and_the_fix() -> None:
    """The error names the field, what each configured child would claim,
    what the request carried, and the two ways out."""
    with pytest.raises(UnroutableRequest) as caught:
        PD_ROUTER.owner_for({"do_remote_prefill": True, "remote_host": "h"})
    message = str(caught.value)
    assert message.startswith("kv_transfer_params asks for a remote prefill")
    for name, keys in zip(PD_ROUTER.names, PD_ROUTER.claims, strict=True):
        assert f"'{name}': {sorted(keys)!r}" in message
    assert "got keys ['do_remote_prefill', 'remote_host']" in message
    assert message.endswith(
        "Route the request with the params of a configured child, "
        "or add that child to 'connectors'."
    )


def test_mooncake_request_with_a_null_nixl_key_goes_to_mooncake() -> None:
    """vLLM's real NixlConnector and MooncakeConnector as the guard's
    children on a decode rank. A proxy that sends Mooncake's keys plus
    ``remote_block_ids: null`` asks Mooncake for the prefill: Mooncake is
    told to pull, NIXL (listed first) is not asked, no child raises."""
    d = SchedulerDriver.build(
        EngineShape(), real_children_config("WedgeGuardConnector", "kv_consumer")
    )
    connector = d.scheduler.connector
    assert isinstance(connector, WedgeGuardConnector)
    params = {**MOONCAKE_PARAMS, "remote_block_ids": None}
    d.add("mc", PROMPT, max_tokens=3, kv_transfer_params=params)
    first = d.step()
    side = connector.scheduler_side
    assert connector._requests_to_connector == {"mc": MOONCAKE}
    entry = side.ledger.get("mc")
    assert entry is not None and entry.owner == "MooncakeConnector"
    nixl_meta, mooncake_meta = first.scheduler_output.kv_connector_metadata.metadata
    assert "mc" in mooncake_meta.reqs_to_recv[PEER]
    assert not nixl_meta.reqs_to_recv
    assert side.stats.child_errors == {}
    assert side.stats.unroutable_requests == 0
    d.step(finished_recving={"mc"})
    d.run(20)
    assert d.finished == {"mc": "length"}
    assert_scheduler_empty(d.scheduler)


# ---- 6. a lateral victim: its KV cached, its state -------------------------------
@dataclass(frozen=True)
class AfterLateral:
    """A lateral victim as vLLM holds it right after the preemption."""

    victim: Victim
    status: RequestStatus
    num_preemptions: int
    num_computed_tokens: int
    last_event: EngineCoreEventType | None
    at_waiting_head: bool
    in_holder_queue: bool
    in_recv_sets: bool
    in_reservation: bool
    kv_fetch_stage: str | None
    num_blocks: int
    full_blocks: int  # of its prompt
    cached_full_blocks: int  # of those, in the prefix cache by their hash


def _watch_laterals(d: SchedulerDriver) -> list[AfterLateral]:
    """Record each lateral victim right after the guard undid its admission
    (before the admission it made room for is retried), through the guard's
    observer seam."""
    sched = d.scheduler
    pool = sched.kv_cache_manager.block_pool
    seen: list[AfterLateral] = []

    class Watched(GuardObserver):
        def after_lateral(self, victim: Victim, target: Request) -> None:
            record(victim)

    def record(victim: Victim) -> None:
        request = sched.requests[victim.req_id]
        hashes = request.block_hashes[: request.num_prompt_tokens // BLOCK]
        stages = sched._kv_fetch_stages or {}
        seen.append(
            AfterLateral(
                victim=victim,
                status=request.status,
                num_preemptions=request.num_preemptions,
                num_computed_tokens=request.num_computed_tokens,
                last_event=request.events[-1].type if request.events else None,
                at_waiting_head=sched.waiting.peek_request() is request,
                in_holder_queue=request in sched.kv_holding_waiting,
                in_recv_sets=victim.req_id in sched.finished_recving_kv_req_ids
                or victim.req_id in sched.failed_recving_kv_req_ids,
                in_reservation=request in sched._inflight_prefills,
                kv_fetch_stage=stages.get(request),
                num_blocks=len(sched.kv_cache_manager.get_block_ids(victim.req_id)[0]),
                full_blocks=len(hashes),
                cached_full_blocks=sum(
                    pool.get_cached_block(h, [0]) is not None for h in hashes
                ),
            )
        )

    sched.add_guard_observer(Watched())
    return seen


def _first_sent_as_new(d: SchedulerDriver, req_id: str) -> int:
    """The tokens ``req_id`` had computed when it first reached the worker."""
    for step in d.steps:
        for new in step.scheduler_output.scheduled_new_reqs:
            if new.req_id == req_id:
                return int(new.num_computed_tokens)
    raise AssertionError(f"{req_id} never reached the worker")


def test_a_recv_done_victims_kv_is_cached_before_its_blocks_are_freed() -> None:
    """The seed wedge under ``lateral``: B's 50-block P->D receive is done,
    A (promoted) needs 30 more blocks, none free; B is the victim. Right
    after the preemption every one of B's 50 prompt blocks is in the prefix
    cache by its hash, though B holds no block. A's admission then takes 30
    of them and its first decode block one more; B, re-admitted (the P->D
    transfer is one-shot: no second load), hits the 19 left."""
    d = SchedulerDriver.build(SEED.shape, guarded("lateral"))
    seen = _watch_laterals(d)
    play(d, SEED, max_steps=60)
    assert [after.victim.req_id for after in seen] == ["B"]
    (after,) = seen
    assert after.num_blocks == 0
    assert after.full_blocks == 50
    assert after.cached_full_blocks == 50
    assert d.worker.started.count("B") == 1
    assert _first_sent_as_new(d, "B") == 19 * BLOCK
    assert set(d.finished) == {"A", "B"}
    assert_scheduler_empty(d.scheduler)


def test_a_never_executed_victim_waits_as_new_at_the_head_of_waiting() -> None:
    """Step 4 of guard/scheduler.py's life cycle, read off vLLM 0.32's state
    right after the seed's lateral preemption: B never ran, so it is WAITING
    (it must reach the worker as new), its preemption is counted (vLLM's
    ``num_preemptions`` and a PREEMPTED event), nothing computed, first in
    ``waiting``, out of the holder queue, the receive sets and the
    async-load reservation, with no KV-fetch stage and no block."""
    d = SchedulerDriver.build(SEED.shape, guarded("lateral"))
    seen = _watch_laterals(d)
    play(d, SEED, max_steps=60)
    (after,) = seen
    assert after.status == RequestStatus.WAITING
    assert after.num_preemptions == 1
    assert after.last_event == EngineCoreEventType.PREEMPTED
    assert after.num_computed_tokens == 0
    assert after.at_waiting_head
    assert not after.in_holder_queue
    assert not after.in_recv_sets
    assert not after.in_reservation
    assert after.kv_fetch_stage is None
    assert after.num_blocks == 0
    assert not d.scheduler.wedge_guard.has_executed("B")
    assert set(d.finished) == {"A", "B"}


def test_an_executed_victim_waits_as_preempted() -> None:
    """The layout of test_executed_victim_is_resumed_not_new: L ran, was
    preempted by vLLM's running loop (its first preemption), reloaded from
    the store; then it is the lateral victim for X. It ran, so it goes back
    PREEMPTED (it resumes), its second preemption counted."""
    d = SchedulerDriver.build(
        EngineShape(num_blocks=101, policy="priority"), guarded("lateral")
    )
    seen = _watch_laterals(d)
    d.add("R1", 79 * BLOCK, max_tokens=40, priority=0)
    d.add(
        "L",
        20 * BLOCK,
        max_tokens=60,
        priority=5,
        kv_transfer_params=store_hit(19 * BLOCK),
    )
    for i in range(200):
        if i == 3:
            d.add(
                "X",
                90 * BLOCK,
                max_tokens=4,
                priority=1,
                kv_transfer_params=store_hit(50 * BLOCK),
            )
        d.step()
        if not d.scheduler.has_requests():
            break
    assert [after.victim.req_id for after in seen] == ["L"]
    (after,) = seen
    assert after.status == RequestStatus.PREEMPTED
    assert after.num_preemptions == 2
    assert after.num_computed_tokens == 0
    assert after.at_waiting_head
    assert after.kv_fetch_stage is None
    assert after.num_blocks == 0
    assert set(d.finished) == {"R1", "L", "X"}
    assert_scheduler_empty(d.scheduler)
