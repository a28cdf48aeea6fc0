"""The end-to-end tier: a real 1P2D vLLM cluster on 127.0.0.1.

Runs only when selected: ``pytest -m e2e tests/e2e`` (``make e2e``) or with
``VLLM_MOONCAKE_E2E=1``; a plain ``pytest`` skips it. Needs the ``transport``
extra (nixl, mooncake-transfer-engine-non-cuda, vllm-router) and libibverbs1
(``make setup-e2e``).

Order of a session: a plain single vLLM server (no KV transfer) starts,
answers :data:`PROMPTS` greedily and stops (:func:`reference_outputs`); then
the cluster starts (``deploy.local.up``, run name ``e2e-<style>``, its own
ports), serves every test, and is stopped, checking that no process of it is
left; then the same again with the other KV style (Mooncake, then NIXL).
No two of them run at once, so they do not compete for the cores.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace

import pytest

from vllm_mooncake.tools.cluster import layout
from vllm_mooncake.tools.cluster.client import complete
from vllm_mooncake.tools.cluster.local import (
    Cluster,
    down_live,
    reference_beside,
    running,
)
from vllm_mooncake.tools.cluster.local import free_base_port as local_free_base_port

RUN = "e2e"
# A decode pool of 5 blocks of 128 tokens (one is vLLM's null block): room
# for one or two of the burst's requests at a time, so the burst queues.
DECODE_BLOCKS = 5
BASE_PORT_ENV = "VLLM_MOONCAKE_E2E_BASE_PORT"
MAX_TOKENS = 16


def _ids(n: int, seed: int) -> list[int]:
    """A token-id prompt of exactly ``n`` tokens (BOS first), deterministic."""
    return [1] + [3 + (seed * 131 + i * 37) % 420 for i in range(n - 1)]


# Greedy prompts compared between the cluster and the reference server: text
# (tokenized by the servers) and token ids around the CPU block size (128),
# where a transfer of one block too few or too many would show.
PROMPTS: tuple[str | list[int], ...] = (
    "Hello from the local PD cluster:",
    "Prefill and decode run on different servers and exchange the KV cache. "
    "A wedge is a scheduler stall where nothing runs and blocks stay held.",
    _ids(127, 1),
    _ids(128, 2),
    _ids(129, 3),
    _ids(300, 4),
)


@dataclass(frozen=True)
class Reference:
    """What the plain server answered for ``prompt`` (greedy)."""

    prompt: str | list[int]
    token_ids: list[int]
    prompt_tokens: int


def e2e_selected(config: pytest.Config) -> bool:
    return "e2e" in (config.getoption("-m") or "") or bool(
        os.environ.get("VLLM_MOONCAKE_E2E")
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if e2e_selected(config):
        return
    skip = pytest.mark.skip(reason="e2e tier: run with -m e2e (make e2e)")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


def free_base_port(spec: layout.ClusterSpec | None = None) -> int:
    """``$VLLM_MOONCAKE_E2E_BASE_PORT``, else the first base whose ports are
    all free (another cluster may hold the default ones)."""
    if os.environ.get(BASE_PORT_ENV):
        return int(os.environ[BASE_PORT_ENV])
    return local_free_base_port(spec or layout.ClusterSpec())


@pytest.fixture(scope="session")
def spec() -> layout.ClusterSpec:
    return layout.ClusterSpec(
        shape="1p2d",
        base_port=free_base_port(),
        kv_style="mooncake",
        decode_blocks=DECODE_BLOCKS,
    )


REFERENCE_RUN = f"{RUN}-reference"


def _references(url: str) -> list[Reference]:
    outs = [complete(url, p, MAX_TOKENS) for p in PROMPTS]
    return [
        Reference(p, o.token_ids, int(o.raw["usage"]["prompt_tokens"]))
        for p, o in zip(PROMPTS, outs, strict=True)
    ]


@pytest.fixture(scope="session")
def reference_started(spec: layout.ClusterSpec) -> Future[list[Reference]]:
    """The reference server, started beside the first cluster."""
    down_live("e2e-")  # a previous session's leftovers (e.g. a killed pytest)
    return reference_beside(spec, REFERENCE_RUN, _references)


@pytest.fixture(scope="session")
def reference_outputs(reference_started: Future[list[Reference]]) -> list[Reference]:
    """Greedy outputs of a plain single server for :data:`PROMPTS`."""
    return reference_started.result(timeout=900)


@pytest.fixture(scope="session", params=layout.KV_STYLES)
def cluster(
    request: pytest.FixtureRequest,
    spec: layout.ClusterSpec,
    reference_started: Future[list[Reference]],
) -> Iterator[Cluster]:
    """The cluster, once per KV style: ``mooncake`` (the prefill's KV moves
    over Mooncake's transfer engine) and ``nixl`` (over NIXL/UCX).
    Session-scoped, so pytest runs every test of a style, in every module,
    stops that cluster, then starts the next."""
    # reference_started: the reference server starts beside the first one.
    style = str(request.param)
    run = f"{RUN}-{style}"
    down_live("e2e-", spare=[REFERENCE_RUN])  # the previous style's cluster
    with running(
        replace(spec, kv_style=style), run, timeout=900, settle=[reference_started]
    ) as started:
        yield started
