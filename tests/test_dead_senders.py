"""Receives whose sender died or went silent: found, failed, and safe.

A P->D receive's writer is its prefill. When the prefill dies mid-transfer,
vLLM waits: a NIXL read is polled with no bound, a Mooncake pull fails after
480 s. The guard's receive watch fails such a receive after
``recv_deadline_s`` (or at once when its sender refuses two probes) through
``kv_load_failure_policy``, and keeps the blocks the old transfer may still
write out of the free pool (quarantine) until the worker reports that
transfer's end or the sender is known dead.

What is real: vLLM's Scheduler, KVCacheManager and block pool; the guard;
the sockets and HTTP servers the probes talk to (127.0.0.1). What is fake:
the worker that would move KV (no GPU, no RDMA) -- a scripted child whose
receive never lands stands for a dead prefill's transfer -- and the clocks,
set by the test so that deadlines come in microseconds.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.request import RequestStatus

from vllm_mooncake.guard.config import GuardConfig, GuardConfigError
from vllm_mooncake.guard.ledger import BlockLedger, RecvState
from vllm_mooncake.guard.receive_watch import FailureReason, ReceiveWatch
from vllm_mooncake.guard.senders import (
    Liveness,
    Sender,
    SenderProbes,
    connect,
    probe,
    sender_of,
)
from vllm_mooncake.guard.stats import GuardStats
from vllm_mooncake.testing.configs import guarded, pd_transfer
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver

NEVER = 10**6  # worker steps: the scripted receive never lands in a test
# Examples of the property at the end (a benchmark runs more:
# VLLM_MOONCAKE_DEAD_SENDER_EXAMPLES=2000).
PROPERTY_EXAMPLES = int(
    os.environ.get("VLLM_MOONCAKE_DEAD_SENDER_EXAMPLES", "60")
)  # worker steps: the scripted receive never lands in a test


class Clock:
    """A clock the test moves (the guard's rooms read ``clock()``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- real endpoints the probes talk to ----------------------------------------------
@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 nobody listens on (connects are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def listener() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield int(sock.getsockname()[1])


def _bootstrap(engines: dict[str, Any]) -> tuple[ThreadingHTTPServer, str]:
    """A Mooncake-bootstrap-shaped HTTP server: GET /query lists engines."""
    body = json.dumps(engines).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/query" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _engines(engine_id: str, worker: str) -> dict[str, Any]:
    return {"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": worker}}}}


# ---- 1. whose transfer, and is it alive ---------------------------------------------
def test_the_sender_is_read_from_each_child_style_of_transfer_params() -> None:
    nixl = {"remote_host": "10.0.0.7", "remote_port": 5600, "remote_block_ids": [1]}
    assert sender_of(nixl) == Sender("nixl", "10.0.0.7:5600")
    # NIXL turns do_remote_prefill off once the load started: still its sender.
    assert sender_of({**nixl, "do_remote_prefill": False}) == Sender(
        "nixl", "10.0.0.7:5600"
    )
    mooncake = {
        "remote_bootstrap_addr": "http://10.0.0.9:8998",
        "remote_engine_id": "p-0",
        "transfer_id": "t",
    }
    assert sender_of(mooncake) == Sender("mooncake", "http://10.0.0.9:8998", "p-0")
    assert sender_of({"store_load": {"tokens": 32}}) is None  # a store: none
    assert sender_of({"remote_host": "h", "remote_port": None}) is None
    assert sender_of(None) is None


def test_a_refused_connect_is_death_an_accepted_one_is_life(
    closed_port: int, listener: int
) -> None:
    assert connect(f"127.0.0.1:{closed_port}") is Liveness.DEAD
    assert connect(f"tcp://127.0.0.1:{listener}") is Liveness.ALIVE
    assert connect("not an address") is Liveness.UNKNOWN
    assert probe(Sender("nixl", f"127.0.0.1:{closed_port}")) is Liveness.DEAD


def test_mooncake_senders_are_found_through_the_bootstrap(
    closed_port: int, listener: int
) -> None:
    live, live_url = _bootstrap(_engines("p-0", f"tcp://127.0.0.1:{listener}"))
    dead, dead_url = _bootstrap(_engines("p-0", f"tcp://127.0.0.1:{closed_port}"))
    try:
        assert probe(Sender("mooncake", live_url, "p-0")) is Liveness.ALIVE
        assert probe(Sender("mooncake", dead_url, "p-0")) is Liveness.DEAD
        # A restarted prefill registers a new engine id: the old one is gone.
        assert probe(Sender("mooncake", live_url, "p-old")) is Liveness.DEAD
    finally:
        live.shutdown()
        dead.shutdown()
    # A bootstrap that does not answer proves nothing about the prefill.
    down = f"http://127.0.0.1:{closed_port}"
    assert probe(Sender("mooncake", down, "p-0")) is Liveness.UNKNOWN


def test_a_sender_is_dead_after_two_refusals_in_a_row(closed_port: int) -> None:
    answers = iter([Liveness.DEAD, Liveness.ALIVE, Liveness.DEAD, Liveness.DEAD])
    probes = SenderProbes(lambda sender: next(answers))
    sender = Sender("nixl", "127.0.0.1:1")
    verdicts = []
    for _ in range(4):
        probes.ask(sender)
        probes.wait()
        verdicts.append((probes.refused(sender), probes.is_dead(sender)))
    # One refusal is a suspect (a restart's gap); an answer clears it.
    assert verdicts == [(True, False), (False, False), (True, False), (True, True)]
    real = SenderProbes()  # the real probe, against a refused port
    target = Sender("nixl", f"127.0.0.1:{closed_port}")
    for _ in range(2):
        real.ask(target)
        real.wait()
    assert real.is_dead(target)
    real.close()


# ---- 2. the watch: per event, and only receives still in flight ----------------------
def _watch(**config: Any) -> tuple[ReceiveWatch, BlockLedger, GuardStats, Clock]:
    ledger, stats, clock = BlockLedger(), GuardStats(), Clock()
    probes = SenderProbes(lambda sender: Liveness.UNKNOWN)
    watch = ReceiveWatch(GuardConfig(**config), ledger, stats, probes)
    watch.clock = clock
    return watch, ledger, stats, clock


def _in_flight(ledger: BlockLedger, req_id: str) -> None:
    ledger.on_arrival(req_id)
    ledger.on_lookup(req_id, "P2P", 64, is_async=True)
    ledger.on_alloc(req_id, 4, 64)
    assert ledger.recv_state(req_id) is RecvState.IN_FLIGHT


def test_the_watch_fails_a_receive_at_its_deadline_and_not_before() -> None:
    watch, ledger, stats, clock = _watch(recv_deadline_s=10.0, sender_probe_s=0)
    assert watch.next_due == float("inf")  # nothing in flight: nothing to do
    _in_flight(ledger, "r1")
    watch.started("r1", "P2P", None)
    assert watch.next_due == clock.now + 5.0  # the halfway mark comes first
    assert watch.due(clock.now + 4.9) == []
    assert stats.stranded_receives == 0
    assert watch.due(clock.now + 5.0) == []
    assert stats.stranded_receives == 1  # past half its deadline
    assert watch.due(clock.now + 9.9) == []
    (stranded,) = watch.due(clock.now + 10.0)
    assert (stranded.req_id, stranded.owner, stranded.reason) == (
        "r1",
        "P2P",
        FailureReason.DEADLINE,
    )
    assert stranded.age_s == pytest.approx(10.0)
    assert stats.stranded_receives == 0 and len(watch) == 0
    assert watch.next_due == float("inf")


def test_a_receive_that_landed_or_restarted_is_never_failed_by_its_old_deadline() -> (
    None
):
    watch, ledger, stats, clock = _watch(recv_deadline_s=10.0, sender_probe_s=0)
    _in_flight(ledger, "landed")
    watch.started("landed", "P2P", None)
    _in_flight(ledger, "silent")  # its notice lands, but nobody told the watch
    watch.started("silent", "P2P", None)
    watch.ended("landed")
    ledger.accept_recv_complete("silent", failed=False)
    _in_flight(ledger, "again")
    watch.started("again", "P2P", None)
    clock.now += 6.0
    watch.started("again", "P2P", None)  # its second receive: a new deadline
    assert watch.due(clock.now - 6.0 + 10.0) == []
    (stranded,) = watch.due(clock.now + 10.0)
    assert stranded.req_id == "again"


def test_a_dead_sender_fails_its_receive_before_the_deadline() -> None:
    ledger, stats, clock = BlockLedger(), GuardStats(), Clock()
    probes = SenderProbes(lambda sender: Liveness.DEAD)
    config = GuardConfig(recv_deadline_s=100.0, sender_probe_s=2.0)
    watch = ReceiveWatch(config, ledger, stats, probes)
    watch.clock = clock
    _in_flight(ledger, "r1")
    sender = Sender("nixl", "10.0.0.7:5600")
    watch.started("r1", "P2P", sender)
    failed = []
    for tick in range(1, 10):
        failed = watch.due(clock.now + 2.0 * tick)
        probes.wait()
        if failed:
            break
    (stranded,) = failed
    assert stranded.reason is FailureReason.SENDER_DEAD
    assert stranded.age_s < 100.0  # long before the deadline
    assert stranded.age_s == pytest.approx(6.0)  # two refusals, then the verdict


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"recv_deadline_s": 0.5}, "wedge_guard.recv_deadline_s: 0.5 is out of range"),
        ({"recv_deadline_s": "2m"}, "wedge_guard.recv_deadline_s: expected a number"),
        ({"sender_probe_s": -1}, "wedge_guard.sender_probe_s: -1 is out of range"),
    ],
)
def test_bad_deadlines_name_the_field(section: dict[str, Any], message: str) -> None:
    with pytest.raises(GuardConfigError, match=message):
        GuardConfig.from_extra_config({"wedge_guard": section})


# ---- 3. on vLLM's real scheduler ----------------------------------------------------
SHAPE = EngineShape(num_blocks=7, block_size=16)  # 6 usable blocks


def _decode(
    policy: str = "fail", deadline: float = 30.0, probe_s: float = 0.0
) -> tuple[SchedulerDriver, Clock]:
    """A decode whose P->D child's receives never land (a dead prefill)."""
    driver = SchedulerDriver.build(
        SHAPE,
        guarded(
            kv_load_failure_policy=policy,
            recv_deadline_s=deadline,
            sender_probe_s=probe_s,
        ),
    )
    clock = Clock()
    side = driver.scheduler.wedge_guard
    side.receives.clock = side.quarantine.clock = side.watch.clock = clock
    return driver, clock


def _stranded_pair(driver: SchedulerDriver, **params: Any) -> None:
    """R1 and R2 (2 blocks each) wait for a push that never comes; C (3
    blocks) then needs more than the 2 blocks left."""
    for req_id in ("R1", "R2"):
        driver.add(
            req_id, 32, kv_transfer_params={**pd_transfer(done_after=NEVER), **params}
        )
    driver.step()
    driver.add("C", 48)
    for _ in range(3):
        driver.step()
    assert driver.status("R1") == "WAITING_FOR_REMOTE_KVS"
    assert driver.status("C") == "WAITING"


def _block_refs(driver: SchedulerDriver, req_id: str) -> list[Any]:
    (blocks,) = driver.scheduler.kv_cache_manager.get_blocks(req_id).blocks
    return list(blocks)


def _block_ids(driver: SchedulerDriver, *req_ids: str) -> set[int]:
    """The block ids (first KV cache group) the live ``req_ids`` hold."""
    manager = driver.scheduler.kv_cache_manager
    return {
        block_id
        for req_id in req_ids
        if req_id in driver.scheduler.requests
        for block_id in (manager.get_block_ids(req_id) or [[]])[0]
    }


def _in_use(driver: SchedulerDriver) -> set[int]:
    """Block ids a live request uses, other than a receive's own blocks while
    it still waits for that receive."""
    return _block_ids(
        driver,
        *(
            req_id
            for req_id, request in driver.scheduler.requests.items()
            if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS
            and not request.is_finished()
        ),
    )


def _run_until(
    driver: SchedulerDriver, clock: Clock, done: Any, steps: int = 40
) -> set[int]:
    """Step (1 s apart) until ``done(driver)``; the block ids of the stranded
    receives R1/R2 any live request held meanwhile."""
    seen: set[int] = set()
    for _ in range(steps):
        if done(driver):
            break
        clock.now += 1.0
        driver.step()
        driver.scheduler.wedge_guard.probes.wait()
        seen |= _in_use(driver)
    return seen


def test_without_a_deadline_due_c_starves_while_the_receives_hang() -> None:
    """The baseline: before the deadline nothing changes however long C
    waits -- vLLM itself never gives up on these receives."""
    driver, clock = _decode(deadline=3600.0)
    _stranded_pair(driver)
    for _ in range(50):
        clock.now += 60.0  # 50 minutes, short of the 1 h deadline
        driver.step()
        assert driver.status("C") == "WAITING"
        assert driver.status("R1") == "WAITING_FOR_REMOTE_KVS"


def test_fail_policy_ends_the_stranded_receives_and_keeps_their_blocks_unused() -> None:
    driver, clock = _decode(policy="fail", deadline=30.0)
    _stranded_pair(driver)
    side = driver.scheduler.wedge_guard
    old = _block_ids(driver, "R1", "R2")
    clock.now += 29.0
    driver.step()
    assert driver.status("R1") == "WAITING_FOR_REMOTE_KVS"  # not before
    clock.now += 1.0
    seen = _run_until(driver, clock, lambda d: "R2" in d.finished)
    assert driver.finished["R1"] == driver.finished["R2"] == "error"
    assert side.stats.receives_failed == {"deadline|ScriptedLoadConnector[1]": 2}
    # No sender to ask: the old transfers may still write, so their 4 blocks
    # stay out of use -- C (3 blocks) waits on, and the rank says it is stuck.
    seen |= _run_until(driver, clock, lambda d: False, steps=35)
    assert side.stats.quarantined_blocks == 4
    assert driver.status("C") == "WAITING"
    assert side.stats.stuck == 1
    assert not old & seen
    # The worker reports the transfers' end at last (Mooncake's own timeout):
    # the quarantine ends, C is served, the pool is whole again.
    driver.step(failed_recving=["R1", "R2"], finished_recving=["R1", "R2"])
    assert side.stats.quarantined_blocks == 0
    assert side.stats.quarantine_releases == {"transfer_ended": 2}
    _run_until(driver, clock, lambda d: "C" in d.finished)
    assert driver.finished["C"] == "length"
    assert side.stats.stuck == 0
    driver.run(10)
    assert driver.num_free_blocks == driver.num_usable_blocks


def test_recompute_policy_prefills_locally_in_other_blocks() -> None:
    driver, clock = _decode(policy="recompute", deadline=30.0)
    _stranded_pair(driver)
    old = _block_ids(driver, "R1", "R2")
    clock.now += 30.0
    seen = _run_until(driver, clock, lambda d: False, steps=20)
    side = driver.scheduler.wedge_guard
    assert side.stats.receives_failed == {"deadline|ScriptedLoadConnector[1]": 2}
    # Back to a local prefill from token 0 (not failed), in other blocks.
    assert driver.status("R1") in ("WAITING", "RUNNING", "PREEMPTED")
    assert "R1" not in driver.finished
    assert side.stats.quarantined_blocks == 4
    assert not old & seen  # never recomputed into while a writer may write
    driver.step(finished_recving=["R1", "R2"])  # the old transfers end
    done = {"R1", "R2", "C"}
    _run_until(driver, clock, lambda d: done <= d.finished.keys(), steps=80)
    assert {driver.finished[r] for r in done} == {"length"}
    driver.run(10)
    assert driver.num_free_blocks == driver.num_usable_blocks


def test_a_dead_sender_fails_its_receives_and_releases_their_blocks(
    closed_port: int,
) -> None:
    driver, clock = _decode(policy="fail", deadline=600.0, probe_s=2.0)
    _stranded_pair(driver, remote_host="127.0.0.1", remote_port=closed_port)
    side = driver.scheduler.wedge_guard
    _run_until(driver, clock, lambda d: "C" in d.finished)
    assert driver.finished["R1"] == driver.finished["R2"] == "error"
    assert driver.finished["C"] == "length"  # within seconds, not 600 s
    assert clock.now - 1000.0 < 20.0
    assert side.stats.receives_failed == {"sender_dead|ScriptedLoadConnector[1]": 2}
    assert side.stats.quarantine_releases == {"sender_dead": 2}
    assert side.stats.quarantined_blocks == 0
    driver.run(10)
    assert driver.num_free_blocks == driver.num_usable_blocks


def test_a_live_but_silent_sender_is_failed_by_the_deadline_and_its_blocks_held(
    listener: int,
) -> None:
    driver, clock = _decode(policy="fail", deadline=20.0, probe_s=2.0)
    _stranded_pair(driver, remote_host="127.0.0.1", remote_port=listener)
    side = driver.scheduler.wedge_guard
    _run_until(driver, clock, lambda d: False, steps=18)
    assert driver.status("R1") == "WAITING_FOR_REMOTE_KVS"  # alive: it waits
    _run_until(driver, clock, lambda d: "R1" in d.finished)
    assert side.stats.receives_failed == {"deadline|ScriptedLoadConnector[1]": 2}
    _run_until(driver, clock, lambda d: False, steps=10)
    assert side.stats.quarantined_blocks == 4  # a writer that lives: held
    assert driver.status("C") == "WAITING"


def test_a_completion_in_the_deadline_step_keeps_the_workers_outcome() -> None:
    """The deadline fires in ``schedule()`` and the worker's completion comes
    in that same step's output: the receive succeeded, nothing is failed, and
    the quarantine's extra references are given back at once."""
    driver, clock = _decode(policy="fail", deadline=30.0)
    driver.add("R1", 32, kv_transfer_params=pd_transfer(done_after=NEVER))
    driver.step()
    refs_before = [b.ref_cnt for b in _block_refs(driver, "R1")]
    clock.now += 30.0
    driver.step(finished_recving=["R1"])  # the deadline and the completion
    side = driver.scheduler.wedge_guard
    assert side.stats.receives_failed.total() == 0
    assert side.stats.quarantined_blocks == 0
    assert side.stats.quarantine_releases == {"transfer_ended": 1}
    assert [b.ref_cnt for b in _block_refs(driver, "R1")] == refs_before
    driver.run(10, until=lambda d: "R1" in d.finished)
    assert driver.finished["R1"] == "length"  # served from its received KV
    assert side.stats.dropped_recv_notices.total() == 0


def test_an_aborted_receive_gives_its_blocks_back() -> None:
    """A client gave up while its receive hung: vLLM keeps the blocks until a
    notice that never comes. The deadline's report frees them from vLLM; the
    quarantine holds them until the old transfer ends."""
    driver, clock = _decode(policy="fail", deadline=30.0)
    driver.add("R1", 32, kv_transfer_params=pd_transfer(done_after=NEVER))
    driver.step()
    driver.abort("R1")
    driver.step()
    assert "R1" in driver.scheduler.requests  # held for its notice
    assert driver.num_free_blocks == driver.num_usable_blocks - 2
    clock.now += 30.0
    driver.step()
    driver.step()
    assert "R1" not in driver.scheduler.requests
    side = driver.scheduler.wedge_guard
    assert side.stats.quarantined_blocks == 2
    assert driver.num_free_blocks == driver.num_usable_blocks - 2
    driver.step(finished_recving=["R1"])  # the old transfer ends
    assert driver.num_free_blocks == driver.num_usable_blocks


def test_time_with_nothing_to_do_is_no_spell_without_progress() -> None:
    """An engine with no request does not step: the hour it sat idle is not
    part of the next spell. A receive cut short (zero-token steps, then its
    client gave up) and new receives an hour later must not make a healthy
    rank report itself stuck on their first zero-token step; receives that
    really hang still do, ``recv_deadline_s`` after they began."""
    driver, clock = _decode(policy="fail", deadline=30.0)
    side = driver.scheduler.wedge_guard
    driver.add("X", 32, kv_transfer_params=pd_transfer(done_after=NEVER))
    for _ in range(10):  # 10 s of zero-token steps, short of the deadline
        clock.now += 1.0
        driver.step()
    driver.abort("X")
    driver.step(finished_recving=["X"])  # its transfer ends: nothing left
    assert not driver.scheduler.has_requests()
    clock.now += 3600.0  # an hour without a request: the engine does not step
    started = clock.now
    _stranded_pair(driver)  # R1, R2 start receiving, C waits: no token yet
    assert side.stats.stuck == 0
    clock.now += 29.0
    driver.step()
    assert side.stats.stuck == 0
    _run_until(driver, clock, lambda d: d.scheduler.wedge_guard.stats.stuck == 1)
    assert side.stats.stuck == 1  # C waits behind the quarantined blocks
    assert clock.now - started == 30.0


# ---- 4. the property: no block under a live writer is ever reused ---------------
NEVER_DONE = -1


@settings(max_examples=PROPERTY_EXAMPLES, deadline=None)
@given(
    policy=st.sampled_from(["fail", "recompute"]),
    deadline_s=st.integers(1, 8),
    done_step=st.sampled_from([NEVER_DONE, *range(1, 13)]),
    done_failed=st.booleans(),
    abort_step=st.sampled_from([None, *range(1, 9)]),
)
def test_no_block_a_live_writer_may_write_is_ever_reused(
    policy: str,
    deadline_s: int,
    done_step: int,
    done_failed: bool,
    abort_step: int | None,
) -> None:
    """R1's receive (2 blocks) may land, fail, or never end; its deadline
    fires at any step, also the step its transfer reports; its client may
    abort. Until the worker reports the transfer's end, R1's blocks are
    never free, never another request's, and never R1's own again once its
    receive was failed. After the end and the drain, the pool is whole
    (unless the transfer never ends: then they stay held)."""
    driver, clock = _decode(policy=policy, deadline=float(deadline_s))
    driver.add("R1", 32, kv_transfer_params=pd_transfer(done_after=NEVER))
    driver.add("C", 48)
    driver.step()
    original = _block_refs(driver, "R1")
    ids = {b.block_id for b in original}
    side = driver.scheduler.wedge_guard
    writer_done = False
    for step in range(1, 16):
        clock.now += 1.0
        if step == abort_step and "R1" in driver.scheduler.requests:
            driver.abort("R1")
        reports: dict[str, list[str]] = {}
        if step == done_step:
            reports["finished_recving"] = ["R1"]
            if done_failed:
                reports["failed_recving"] = ["R1"]
        driver.step(**reports)
        writer_done = writer_done or step == done_step
        if writer_done:
            continue
        assert all(b.ref_cnt > 0 for b in original), "a live writer's block is free"
        if side.stats.receives_failed.total():
            assert not ids & _in_use(driver), "a live writer's block is in use"
        else:
            assert not ids & (_in_use(driver) - _block_ids(driver, "R1"))
    driver.run(60)
    if done_step == NEVER_DONE and side.stats.receives_failed.total():
        assert side.stats.quarantined_blocks == len(original)
    else:
        assert side.stats.quarantined_blocks == 0
        assert driver.num_free_blocks == driver.num_usable_blocks
