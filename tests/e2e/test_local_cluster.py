"""A real 1P2D cluster on 127.0.0.1: outputs, the guard in every engine, a burst.

Three vLLM CPU servers (one prefill, two decodes, each
``WedgeGuardConnector`` over [MooncakeConnector, NixlConnector] with the
guarded scheduler) behind ``vllm-router --vllm-pd-disaggregation``. Every
test runs twice, once per KV style: ``mooncake`` (the router sends Mooncake
``transfer_id`` / ``remote_bootstrap_addr`` params; the guard gives the load
to the Mooncake child, whose transfer engine moves the KV over TCP on
loopback) and ``nixl`` (``remote_block_ids``; NIXL over UCX). Nothing is
faked: the only stand-in is the tiny random model (``deploy/tiny_model.py``).

The burst does not form a wedge in these servers, and the test does not
pretend it does. Every P->D request on a decode receives its whole prompt,
so once its receive lands it needs no new block to be promoted; vLLM 0.32
serves the KV-holding queue before new arrivals and reserves blocks for
in-flight loads, so the admission loop never breaks with holders stranded
behind it. (With the guard's ``lateral`` policy, no reservation, and
``--no-scheduler-reserve-full-isl`` a 24-request burst against 4 usable
blocks still finished without a lateral preemption.) The wedges need a
partial load -- a store prefix hit next to a P->D receive, W1's priority
order, W2's failed store load -- which the local cluster does not produce;
``tests/test_guard_wedges.py`` drives those through vLLM's real scheduler.
What the burst does assert: every request comes back complete from a pool
it overflows, and the guard's ledger ends empty and consistent (no stranded
holder, no ledger error, no stall, no alarm).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from vllm_mooncake.guard.metrics import (
    COUNTER_METRICS,
    DROPPED_RECV_NOTICES_METRIC,
    GAUGE_METRICS,
    LATERAL_PREEMPTIONS_METRIC,
)
from vllm_mooncake.testing import log_lines
from vllm_mooncake.tools.cluster.client import (
    Completion,
    Sample,
    complete,
    get_text,
    metric_names,
    metric_total,
    parse_metrics,
    scrape,
)
from vllm_mooncake.tools.cluster.local import Cluster

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"
GUARD_SCHEDULER_LOG = (
    "Using custom scheduler class vllm_mooncake.guard.scheduler.WedgeGuard"
)
GUARD_CONNECTOR_LOG = "Creating v1 connector with name: WedgeGuardConnector"

BURST = 24
QUEUED_S = 2.0  # seconds of queueing on the decodes that only a full pool explains
BURST_MAX_TOKENS = 32


def _by_source(samples: list[Sample], source: str) -> float:
    return metric_total(samples, PROMPT_TOKENS, source=source)


def _delta(
    before: list[Sample], after: list[Sample], name: str, **labels: str
) -> float:
    return metric_total(after, name, **labels) - metric_total(before, name, **labels)


# ---- (a) outputs equal a single server's: the KV really moved --------------------
def test_pd_outputs_equal_the_single_server_reference(
    cluster: Cluster, reference_outputs: list[Any]
) -> None:
    """``reference_outputs``: conftest's ``Reference`` per prompt, taken from a
    plain vLLM server (no KV transfer) before the cluster started."""
    before = {url: scrape(url) for url in cluster.decode_urls}
    prefill_before = scrape(cluster.prefill_urls[0])
    outs = [
        complete(cluster.router_url, ref.prompt, len(ref.token_ids))
        for ref in reference_outputs
    ]

    for out, ref in zip(outs, reference_outputs, strict=True):
        assert out.finish_reason == "length"
        assert out.token_ids == ref.token_ids, f"prompt {ref.prompt!r:.60}"

    # Every prompt token reached a decode by transfer, none was computed
    # there, and the prefill computed them: PD, not two local prefills.
    total = sum(r.prompt_tokens for r in reference_outputs)
    after = {url: scrape(url) for url in cluster.decode_urls}
    transferred = {
        url: _by_source(after[url], "external_kv_transfer")
        - _by_source(before[url], "external_kv_transfer")
        for url in cluster.decode_urls
    }
    computed = {
        url: _by_source(after[url], "local_compute")
        - _by_source(before[url], "local_compute")
        for url in cluster.decode_urls
    }
    assert sum(transferred.values()) == total, transferred
    assert all(v > 0 for v in transferred.values()), f"round robin: {transferred}"
    assert set(computed.values()) == {0.0}, computed
    prefill_after = scrape(cluster.prefill_urls[0])
    prefill_computed = _by_source(prefill_after, "local_compute") - _by_source(
        prefill_before, "local_compute"
    )
    assert prefill_computed == total


# ---- (b) the guard connector and the guarded scheduler in every engine ------------
GUARD_SERIES = (
    [f"{name}_total" for name, _, _ in COUNTER_METRICS]
    + [name for name, _, _ in GAUGE_METRICS]
    + [f"{DROPPED_RECV_NOTICES_METRIC}_total"]
)


def test_every_server_exports_the_guard_metrics_with_help(cluster: Cluster) -> None:
    for url in cluster.prefill_urls + cluster.decode_urls:
        text = get_text(f"{url}/metrics")
        names = metric_names(parse_metrics(text))
        missing = [n for n in GUARD_SERIES if n not in names]
        assert not missing, f"{url}/metrics lacks {missing}"
        for name, _, help_text in COUNTER_METRICS + GAUGE_METRICS:
            assert f"# HELP {name}" in text and help_text[:40] in text, name
        assert f"# TYPE {LATERAL_PREEMPTIONS_METRIC}_total counter" in text


def test_every_engine_runs_the_guard_connector_and_scheduler(cluster: Cluster) -> None:
    for rank in cluster.ranks:
        log = Path(cluster.log(rank.name)).read_text(errors="replace")
        assert GUARD_CONNECTOR_LOG in log, rank.name
        # vLLM names the scheduler class the engine core built.
        assert GUARD_SCHEDULER_LOG in log, rank.name
        assert "Traceback" not in log, rank.name


# The start-up line as docs/runbook.md shows it, with this cluster's policy.
GUARD_START_LINE = re.compile(
    log_lines.START.pattern.pattern.replace(r"policy=\S+", r"policy=reserve\+lateral")
)


def test_guard_log_lines_come_out_in_vllms_format(cluster: Cluster) -> None:
    """The guard's loggers sit under vLLM's ``vllm`` logger, so its lines carry
    vLLM's prefix and level, INFO included (a logger outside ``vllm`` would
    print WARNING lines bare and INFO lines not at all)."""
    for rank in cluster.ranks:
        log = Path(cluster.log(rank.name)).read_text(errors="replace")
        assert GUARD_START_LINE.search(log), rank.name
        bare = [ln for ln in log.splitlines() if ln.startswith(("wedge ", "KV conn"))]
        assert not bare, f"{rank.name}: unformatted guard lines {bare[:3]}"


# ---- (c) a burst against the small decode pool -------------------------------------
@dataclass
class Peaks:
    """Highest values seen on the decodes' /metrics while the burst ran."""

    kv_usage: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, float] = field(default_factory=dict)


@pytest.fixture
def watch(cluster: Cluster) -> Iterator[Peaks]:
    """Scrape the decodes every 0.2 s until the test ends."""
    peaks = Peaks()
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for url in cluster.decode_urls:
                try:
                    s = scrape(url)
                except OSError:
                    continue
                usage = metric_total(s, "vllm:kv_cache_usage_perc")
                waiting = metric_total(s, "vllm:num_requests_waiting")
                peaks.kv_usage[url] = max(peaks.kv_usage.get(url, 0.0), usage)
                peaks.waiting[url] = max(peaks.waiting.get(url, 0.0), waiting)
            stop.wait(0.2)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    yield peaks
    stop.set()
    thread.join(timeout=10)


def _burst_prompt(i: int) -> list[int]:
    # 100-219 tokens: with 32 more, each needs 2 of a decode's 4 usable blocks
    # (some cross into a third), so 12 requests per decode overflow its pool.
    n = 100 + (i * 37) % 120
    return [1] + [3 + (i * 53 + k * 29) % 420 for k in range(n - 1)]


def test_burst_against_the_small_decode_pool_completes_every_request(
    cluster: Cluster, watch: Peaks
) -> None:
    for url in cluster.decode_urls:
        info = [s for s in scrape(url) if s.name == "vllm:cache_config_info"]
        blocks = cluster.spec.decode_blocks
        assert info and info[0].labels["num_gpu_blocks"] == str(blocks)
    before = {url: scrape(url) for url in cluster.decode_urls}

    t0 = time.monotonic()
    with ThreadPoolExecutor(BURST) as pool:
        outs: list[Completion] = list(
            pool.map(
                lambda i: complete(
                    cluster.router_url, _burst_prompt(i), BURST_MAX_TOKENS, timeout=300
                ),
                range(BURST),
            )
        )
    elapsed = time.monotonic() - t0
    time.sleep(1.5)  # one more scrape interval for the gauges

    # No request lost: each came back with all its tokens.
    assert [(len(o.token_ids), o.finish_reason) for o in outs] == [
        (BURST_MAX_TOKENS, "length")
    ] * BURST, f"after {elapsed:.1f} s"
    after = {url: scrape(url) for url in cluster.decode_urls}
    served = sum(
        _delta(before[u], after[u], "vllm:request_success_total")
        for u in cluster.decode_urls
    )
    assert served == BURST

    # The pool was small enough to matter: requests queued for it. Seen
    # either by the 0.2 s gauge samples (the pool filled, requests waited) or,
    # when the burst outran the sampler, by vLLM's queue-time histogram: with
    # a pool that fits the burst, 24 requests queue for milliseconds in all.
    queued_s = sum(
        _delta(before[u], after[u], "vllm:request_queue_time_seconds_sum")
        for u in cluster.decode_urls
    )
    sampled = max(watch.kv_usage.values()) >= 0.5 and max(watch.waiting.values()) > 0
    assert sampled or queued_s >= QUEUED_S, (watch, queued_s)

    for url in cluster.decode_urls:
        _assert_guard_ledger_clean(url, before[url], after[url])


def _assert_guard_ledger_clean(
    url: str, before: list[Sample], after: list[Sample]
) -> None:
    """After the burst nothing holds blocks without running, nothing stalls,
    the ledger never disagreed with vLLM, and any lateral preemption was part
    of a resolved stall."""
    for gauge in (
        "vllm:kv_guard_recv_done_holders_waiting",
        "vllm:kv_guard_blocks_held_by_non_running",
        "vllm:kv_guard_stalled_steps",
    ):
        assert metric_total(after, gauge) == 0, (url, gauge)
    for counter in ("ledger_errors", "wedges_detected"):
        name = f"vllm:kv_guard_{counter}_total"
        assert _delta(before, after, name) == 0, (url, name)
    lateral = _delta(before, after, f"{LATERAL_PREEMPTIONS_METRIC}_total")
    resolved = _delta(before, after, "vllm:kv_guard_wedges_resolved_total")
    assert (lateral > 0) == (resolved > 0), (url, lateral, resolved)
