"""W1 and W2 on real vLLM servers with a Mooncake store: red on stock, green guarded.

A store-mode 1P3D on 127.0.0.1 (``local.up(store=True)``): mooncake_master
and a segment owner, one prefill, three decodes, each rank's connector over
[MooncakeStoreConnector, MooncakeConnector]. The three decodes run the same
children and the same vLLM settings (small pool, priority scheduling, no
full-prompt admission check, ``kv_load_failure_policy=recompute``) and differ
only in the connector:

- ``decode-0``: stock vLLM MultiConnector and stock scheduler;
- ``decode-1``: the guard (``reserve+lateral``);
- ``decode-2``: the guard with policy ``reserve``: upstream admission, no
  valve, so it wedges like stock and shows the alarm.

Nothing is faked: prompts go over HTTP, the store's loads and the P->D
transfers are Mooncake's over TCP, the model is the tiny random Llama. The
wedges form from request timing alone (:mod:`vllm_mooncake.tools.cluster.
real_wedges`). W2's failing store load is honest too: the segment owner
holding the prefix is stopped, so the store still lists the keys (until
mooncake_master's ``client_ttl``, set far beyond the test) but every read
of them fails.

Runs in its own pytest session (``make e2e`` runs it after the KV-style
tier), so its four servers never share the machine with another cluster.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest

from vllm_mooncake.guard.metrics import (
    LATERAL_PREEMPTIONS_METRIC,
    LOAD_RETRY_CUTOFFS_METRIC,
)
from vllm_mooncake.testing import log_lines
from vllm_mooncake.tools.cluster import layout
from vllm_mooncake.tools.cluster.client import (
    complete,
    metric_total,
    mooncake_legs,
    scrape,
)
from vllm_mooncake.tools.cluster.local import (
    Cluster,
    down_live,
    free_base_port,
    reference_beside,
    running,
    stop_store_segment,
)
from vllm_mooncake.tools.cluster.real_wedges import (
    MAX_TOKENS,
    W1_DECODE_BLOCKS,
    W1_SERVER_ARGS,
    Background,
    DecodeState,
    W1Prompts,
    W2Prompts,
    WedgeRun,
    form_w1,
    form_w2,
    seed_store,
    wait_for,
    wait_idle,
)

pytestmark = pytest.mark.e2e

RUN = "e2e-store"
BASE_PORT_ENV = "VLLM_MOONCAKE_E2E_BASE_PORT"
STOCK, GUARD, ALARM = 0, 1, 2  # decode indices
# The guard decodes' alarm threshold: short, so the test waits little. (The
# default, 10 s, is several thousand zero-token steps on this CPU.)
STALL_ALARM_S = 2.0
# How long stock must stay wedged to count as wedged. vLLM itself would wait
# for the client (the router's timeout: 20-30 minutes in production).
STOCK_HOLD_S = 15.0
# Guarded, both requests finish within this (measured: under 1 s).
GUARD_DEADLINE_S = 30.0
# mooncake_master keeps a dead client's keys this long: W2's guard run must
# finish long before, so it is not the store forgetting that ends it.
CLIENT_TTL_S = 600
PROMPT_SEEDS = {STOCK: 1, GUARD: 2, ALARM: 3}

WEDGE_COUNTER = "vllm:kv_guard_wedges_detected_total"
LATERAL = f"{LATERAL_PREEMPTIONS_METRIC}_total"
CUTOFFS = f"{LOAD_RETRY_CUTOFFS_METRIC}_total"
# The guard's lines as docs/runbook.md shows them (vllm_mooncake.testing.
# log_lines), with this scenario's owners and sizes.
LATERAL_LINE = re.compile(
    log_lines.LATERAL.pattern.pattern.replace(
        r"\((?:recv_done|promoted_idle), owner=\w+, \d+ blocks\)",
        r"\(recv_done, owner=MooncakeConnector, 3 blocks\)",
    )
)
ALARM_LINE = log_lines.ALARM
CUTOFF_LINE = log_lines.LOAD_RETRY_CUTOFF
DROPPED_LINE = log_lines.RESERVATION_DROPPED


@pytest.fixture(scope="module")
def store_spec() -> layout.ClusterSpec:
    spec = layout.ClusterSpec(
        shape="1p3d",
        store=True,
        store_client_ttl_s=CLIENT_TTL_S,
        decode_blocks=W1_DECODE_BLOCKS,
        server_args=W1_SERVER_ARGS,
        kv_load_failure_policy="recompute",
        guard_extra={"stall_alarm_s": STALL_ALARM_S},
        rank_connectors={"decode-0": "stock", "decode-2": "reserve"},
    )
    base = os.environ.get(BASE_PORT_ENV)
    return replace(spec, base_port=int(base) if base else free_base_port(spec))


Outputs = dict[tuple[int, ...], list[int]]


@pytest.fixture(scope="module")
def reference_started(store_spec: layout.ClusterSpec) -> Future[Outputs]:
    """Greedy outputs of a plain server (no KV transfer, same settings) for
    every prompt the guard decode must complete; the server starts beside
    the cluster."""
    w1, w2 = W1Prompts.make(PROMPT_SEEDS[GUARD]), W2Prompts.make(PROMPT_SEEDS[GUARD])
    prompts = [w1.urgent, w1.holder, w2.failing, w2.holder, _slow_prompt()]

    def ask(url: str) -> Outputs:
        return {tuple(p): complete(url, p, MAX_TOKENS).token_ids for p in prompts}

    down_live("e2e-")  # never two clusters at once on this machine
    return reference_beside(store_spec, f"{RUN}-reference", ask)


@pytest.fixture(scope="module")
def reference(reference_started: Future[Outputs]) -> Outputs:
    return reference_started.result(timeout=900)


@pytest.fixture(scope="module")
def store_cluster(
    store_spec: layout.ClusterSpec, reference_started: Future[Outputs]
) -> Iterator[Cluster]:
    with running(store_spec, RUN, timeout=900, settle=[reference_started]) as started:
        yield started


def _store_metrics(cluster: Cluster) -> str:
    return f"http://{layout.HOST}:{cluster.spec.ports.store_master_metrics}/metrics"


def _w1(cluster: Cluster, decode: int, hold_s: float) -> WedgeRun:
    return form_w1(
        cluster.prefill_urls[0],
        cluster.decode_urls[decode],
        cluster.bootstrap_urls[0],
        _store_metrics(cluster),
        W1Prompts.make(PROMPT_SEEDS[decode]),
        hold_s=hold_s,
        request_timeout=hold_s + 20,
    )


def _w2(cluster: Cluster, decode: int, hold_s: float) -> WedgeRun:
    return form_w2(
        cluster.prefill_urls[0],
        cluster.decode_urls[decode],
        cluster.bootstrap_urls[0],
        W2Prompts.make(PROMPT_SEEDS[decode]),
        hold_s=hold_s,
        request_timeout=hold_s + 20,
    )


def _assert_stock_wedged(run: WedgeRun, hold_s: float = STOCK_HOLD_S) -> None:
    """After every load completed: nothing generated for the whole hold,
    nothing running, both requests waiting, /health 200."""
    assert not run.urgent.done and not run.holder.done, "stock finished: no wedge"
    assert run.prefill_leg.result is not None, run.prefill_leg.error
    assert run.seconds >= hold_s
    assert run.settled.generated == run.formed.generated, "tokens were generated"
    assert run.settled.running == 0
    assert run.settled.waiting == 2
    assert run.settled.healthy


def _assert_outputs(run: WedgeRun, reference: dict[tuple[int, ...], list[int]]) -> None:
    """Each request's greedy tokens equal the plain server's: the laterally
    preempted one (recomputed) and the locally recomputed one included."""
    for call, prompt in (
        (run.urgent, run.urgent_prompt),
        (run.holder, run.holder_prompt),
    ):
        assert call.result is not None, call.error
        assert call.result.token_ids == reference[tuple(prompt)]


def _log(cluster: Cluster, decode: int) -> str:
    return Path(cluster.log(f"decode-{decode}")).read_text(errors="replace")


# ---- W1: priority scheduling without the full-prompt check -------------------------
def test_w1_stock_multiconnector_stays_wedged(store_cluster: Cluster) -> None:
    run = _w1(store_cluster, STOCK, STOCK_HOLD_S)
    _assert_stock_wedged(run)
    # Both loads completed (X's from the store, Y's over P->D): the fetch
    # stage gauge shows both done and waiting for admission.
    assert run.settled.completed_waiting == 2
    wait_idle(store_cluster.decode_urls[STOCK], timeout=60)  # clients gave up


def test_w1_guard_preempts_laterally_and_outputs_match_reference(
    store_cluster: Cluster, reference: dict[tuple[int, ...], list[int]]
) -> None:
    run = _w1(store_cluster, GUARD, GUARD_DEADLINE_S)
    assert run.finished, (run.urgent.error, run.holder.error)
    assert run.seconds < GUARD_DEADLINE_S
    assert run.delta(LATERAL, reason="recv_done", owner="MooncakeConnector") >= 1
    assert run.delta(WEDGE_COUNTER) == 0  # resolved before any alarm
    # X loaded its prefix from the store (a partial external hit)
    assert (
        run.delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        >= 256
    )
    _assert_outputs(run, reference)
    assert LATERAL_LINE.search(_log(store_cluster, GUARD))


# ---- the alarm: real stalls only ----------------------------------------------------
def _slow_prompt() -> list[int]:
    return W1Prompts.make(50).holder


def test_a_slow_transfer_raises_no_alarm(
    store_cluster: Cluster, reference: dict[tuple[int, ...], list[int]]
) -> None:
    """A P->D receive held back for 3x the alarm threshold: the decode waits
    with blocks held and schedules nothing, but a receive is in flight."""
    url = store_cluster.decode_urls[ALARM]
    before = scrape(url)
    prefill_params, decode_params = mooncake_legs(store_cluster.bootstrap_urls[0])
    prompt = _slow_prompt()
    decode_leg = Background(
        lambda: complete(url, prompt, MAX_TOKENS, kv_transfer_params=decode_params)
    )
    wait_for("the receive is pending", lambda: DecodeState.of(url).waiting >= 1, 30)
    time.sleep(3 * STALL_ALARM_S)
    during = scrape(url)
    assert metric_total(during, "vllm:num_requests_running") == 0
    assert metric_total(during, "vllm:kv_guard_stalled_steps") == 0
    complete(
        store_cluster.prefill_urls[0], prompt, 1, kv_transfer_params=prefill_params
    )
    assert decode_leg.join(60) and decode_leg.result is not None, decode_leg.error
    assert decode_leg.result.token_ids == reference[tuple(prompt)]
    after = scrape(url)
    assert metric_total(after, WEDGE_COUNTER) == metric_total(before, WEDGE_COUNTER)


def test_a_real_wedge_raises_the_alarm_in_vllms_log_format(
    store_cluster: Cluster,
) -> None:
    """The guard without its valve (policy reserve) wedges like stock; the
    alarm fires once the stall has lasted stall_alarm_s."""
    hold_s = STALL_ALARM_S + 6
    run = _w1(store_cluster, ALARM, hold_s)
    _assert_stock_wedged(run, hold_s)
    assert run.delta(WEDGE_COUNTER) == 1
    log = _log(store_cluster, ALARM)
    assert ALARM_LINE.search(log)
    assert (
        "hold 5 KV blocks, none runs and no receive is in flight; policy=reserve" in log
    )
    wait_idle(store_cluster.decode_urls[ALARM], timeout=60)


# ---- W2: a store load that fails entirely, kv_load_failure_policy=recompute --------
@pytest.fixture(scope="module")
def lost_store(store_cluster: Cluster) -> Cluster:
    """Seed W2's prefixes, then stop the segment owner: the store still lists
    the keys, every read of them fails. Every W1 test has run before this
    (file order): they need a working store."""
    for decode in (STOCK, GUARD):
        seed_store(
            store_cluster.prefill_urls[0],
            W2Prompts.make(PROMPT_SEEDS[decode]).seed,
            _store_metrics(store_cluster),
        )
    stop_store_segment(store_cluster)
    return store_cluster


def test_w2_stock_multiconnector_stays_wedged(lost_store: Cluster) -> None:
    run = _w2(lost_store, STOCK, STOCK_HOLD_S)
    _assert_stock_wedged(run)
    wait_idle(lost_store.decode_urls[STOCK], timeout=60)


def test_w2_guard_cuts_the_retries_and_outputs_match_reference(
    lost_store: Cluster, reference: dict[tuple[int, ...], list[int]]
) -> None:
    run = _w2(lost_store, GUARD, GUARD_DEADLINE_S)
    assert run.finished, (run.urgent.error, run.holder.error)
    # Well before mooncake_master would forget the dead keys.
    assert run.seconds < GUARD_DEADLINE_S < CLIENT_TTL_S / 10
    assert run.delta(CUTOFFS, child="MooncakeStoreConnector") >= 1
    _assert_outputs(run, reference)
    log = _log(lost_store, GUARD)
    assert CUTOFF_LINE.search(log)
    assert "MooncakeStoreConnector failed (max_failed_loads=3)" in log
    assert DROPPED_LINE.search(log)
