"""A prefill server restarted under a running Mooncake bootstrap server.

A restarted prefill comes back with a new engine id and registers it on the
same bootstrap server, whose entry for that data-parallel rank still names
its dead predecessor. vLLM's own bootstrap refuses it (HTTP 400, "Engine ID
mismatch"), so the prefill serves nothing until the bootstrap is restarted
too; the project's bootstrap (tools/cluster/mooncake_bootstrap.py) replaces
an entry whose workers no longer answer. Mooncake-style clusters only: NIXL
needs no bootstrap. Runs last in its cluster (it restarts a rank).

The requests after the restart are routed by hand, reading the engine id
from the bootstrap as vLLM's Mooncake proxy does: vllm-router (0.1.17) reads
each prefill's engine id once, at its own start, and keeps sending the dead
one (the decode's load then fails: "remote engine_id ... not found"), so a
restarted prefill also needs a router restart (docs/runbook.md).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllm_mooncake.tools.cluster.client import (
    get_text,
    metric_total,
    pd_complete_mooncake,
    scrape,
)
from vllm_mooncake.tools.cluster.local import Cluster, restart_rank

pytestmark = pytest.mark.e2e
PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"


def _engine_id(cluster: Cluster) -> str:
    entries = json.loads(get_text(f"{cluster.bootstrap_urls[0]}/query"))
    return str(entries["0"]["engine_id"])


def test_a_restarted_prefill_registers_again_and_serves(
    cluster: Cluster, reference_outputs: list[Any]
) -> None:
    if cluster.spec.kv_style != "mooncake":
        pytest.skip("NIXL needs no bootstrap server")
    before = _engine_id(cluster)
    restart_rank(cluster, "prefill-0")
    after = _engine_id(cluster)
    assert after != before, "the bootstrap still names the dead prefill"
    log = cluster.log("bootstrap-0").read_text(errors="replace")
    assert "Engine ID mismatch" not in log
    assert f"engine {after} replaces the registration of engine {before}" in log
    # The new prefill pushes its KV to both decodes: outputs equal the plain
    # server's, and the decodes computed no prompt token themselves.
    for decode_url, ref in zip(cluster.decode_urls, reference_outputs, strict=False):
        before = scrape(decode_url)
        out = pd_complete_mooncake(
            cluster.prefill_urls[0],
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
