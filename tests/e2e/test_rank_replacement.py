"""A rank replaced under traffic: a prefill crashed, then routed again.

The sample of a rolling restart that ``make e2e`` runs (the whole one, on a
2P2D under ``vllm bench serve``, prefills crashed and decodes drained, is
``make e2e-rolling``). On the session's Mooncake-style 1P2D, guarded with
the guard's defaults (``recv_deadline_s`` 120, ``sender_probe_s`` 5), a
client sends one request every 2 s through vllm-router while prefill-0 is
SIGKILLed, taken out of the router, started again, and the router restarted
(``tools/cluster/rollout.py``). The decode legs of requests it carried lose
their sender: the guard fails them when its probes are refused. The new
prefill registers a new engine id on the same bootstrap server, which
replaces the dead one's entry (vLLM's own bootstrap refuses it: HTTP 400,
"Engine ID mismatch"); vllm-router 0.1.17 reads engine ids once, at its
start, hence its restart.

Sampled for CI's budget: a drained decode's restart took 301 s here (its
start-up shares the cores with the other decode's busy-polling workers),
against 28 s for the prefill; the NIXL-style cluster skips the test (NIXL's
dead sender is test_dead_prefill.py's NIXL case).

Checked: every request ended, served or with an error, none after more than
the deadline plus 10 s; every request sent once the router is back was
served; through the new prefill, outputs equal a plain server's and the
decodes computed no prompt token; afterwards no KV block is held or
quarantined on a decode. Runs last in its cluster (it replaces ranks).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from vllm_mooncake.tools.cluster.client import (
    metric_total,
    pd_complete_mooncake,
    prefill_engine_id,
    scrape,
)
from vllm_mooncake.tools.cluster.local import Cluster
from vllm_mooncake.tools.cluster.rollout import (
    Outcome,
    Step,
    Traffic,
    roll_prefill,
)

pytestmark = pytest.mark.e2e
PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"
DEADLINE_S = 120.0  # the guard's default recv_deadline_s
HANG_BOUND_S = DEADLINE_S + 10
PROBE = [1] + [3 + (i * 53) % 420 for i in range(149)]


def _under_traffic(cluster: Cluster, steps: Any) -> tuple[list[Outcome], list[Step]]:
    """Run ``steps(cluster)`` while a client sends a request every 2 s
    through the router, from 6 s before to 10 s after; wait for every
    request to end (at most the hang bound)."""
    traffic = Traffic(cluster.router_url, PROBE, interval=2.0, timeout=600.0)
    with traffic.running():
        time.sleep(6.0)
        done = steps(cluster)
        time.sleep(10.0)
    left = traffic.join(HANG_BOUND_S + 30)
    assert not left, f"{len(left)} of {traffic.sent()} requests never ended"
    return traffic.outcomes, done


def _check_outcomes(
    outcomes: list[Outcome], killed_at: float, routed_at: float
) -> None:
    """Served before the crash; none hung; every request sent after the last
    router restart served."""
    baseline = [o for o in outcomes if o.end < killed_at]
    assert baseline, "no request ended before the crash"
    assert not [o.error for o in baseline if o.error], "failures before the crash"
    longest = max(o.seconds for o in outcomes)
    assert longest <= HANG_BOUND_S, f"a request took {longest:.1f} s"
    after = [o for o in outcomes if o.start >= routed_at]
    assert after, "no request was sent after the router came back"
    failed = [o.error for o in after if o.error]
    assert not failed, f"{len(failed)}/{len(after)} failed after it: {failed[:3]}"


def _decodes_clean(cluster: Cluster, timeout: float = 60.0) -> None:
    """No KV block held or quarantined on any decode once traffic ended."""
    deadline = time.monotonic() + timeout
    while True:
        samples = [scrape(url) for url in cluster.decode_urls]
        used = [metric_total(s, "vllm:kv_cache_usage_perc") for s in samples]
        held = [metric_total(s, "vllm:kv_guard_quarantined_blocks") for s in samples]
        if not any(used) and not any(held):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV usage {used}, quarantined blocks {held}")
        time.sleep(1.0)


def _pd_outputs_equal_the_reference(cluster: Cluster, reference: list[Any]) -> None:
    """Through the new prefill, by hand: outputs equal the plain server's,
    and the decodes computed no prompt token themselves."""
    prefill = cluster.prefill_urls[0]
    for decode_url, ref in zip(cluster.decode_urls, reference, strict=False):
        before = scrape(decode_url)
        out = pd_complete_mooncake(
            prefill,
            decode_url,
            cluster.bootstrap_urls[0],
            ref.prompt,
            len(ref.token_ids),
        )
        assert out.token_ids == ref.token_ids
        computed = metric_total(
            scrape(decode_url), PROMPT_TOKENS, source="local_compute"
        ) - metric_total(before, PROMPT_TOKENS, source="local_compute")
        assert computed == 0


def test_a_prefill_crashed_under_traffic_ends_every_request_and_serves_again(
    cluster: Cluster, reference_outputs: list[Any]
) -> None:
    if cluster.spec.kv_style != "mooncake":
        # CI's budget (the module docstring).
        pytest.skip("sampled on the Mooncake-style cluster only")
    before = prefill_engine_id(cluster.bootstrap_urls[0])

    def replace_ranks(c: Cluster) -> list[Step]:
        return [roll_prefill(c, "prefill-0")]

    outcomes, steps = _under_traffic(cluster, replace_ranks)
    last = steps[-1]
    _check_outcomes(outcomes, steps[0].started, last.started + last.routed_s)
    for step in steps:
        print(f"[replacement] {step.line()}")
    print(
        f"[replacement] {len(outcomes)} requests, "
        f"{sum(1 for o in outcomes if o.error)} failed, "
        f"longest {max(o.seconds for o in outcomes):.1f} s"
    )
    after = prefill_engine_id(cluster.bootstrap_urls[0])
    assert after != before, "the bootstrap still names the dead prefill"
    log = cluster.log("bootstrap-0").read_text(errors="replace")
    assert "Engine ID mismatch" not in log
    assert f"engine {after} replaces the registration of engine {before}" in log
    _pd_outputs_equal_the_reference(cluster, reference_outputs)
    _decodes_clean(cluster)
