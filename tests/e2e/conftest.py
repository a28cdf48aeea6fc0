"""The end-to-end tier: a real 1P2D vLLM cluster on 127.0.0.1.

Runs only when selected: ``pytest -m e2e tests/e2e`` (``make e2e``) or with
``VLLM_MOONCAKE_E2E=1``; a plain ``pytest`` skips it. Needs the ``transport``
extra (nixl, mooncake-transfer-engine-non-cuda) and libibverbs1
(``make e2e-setup``). The cluster is started once per session
(``deploy.local.up``, run name ``e2e``, its own ports) and stopped at the
end, checking that no process of it is left.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from vllm_mooncake.deploy import layout
from vllm_mooncake.deploy.local import Cluster, all_ports, down, run_dir, up
from vllm_mooncake.deploy.procs import Run, port_in_use

RUN = "e2e"
# A decode pool of 5 blocks of 128 tokens: room for one or two of the burst's
# requests at a time, so the burst queues, waits for KV and preempts.
DECODE_BLOCKS = 5
BASE_PORT_ENV = "VLLM_MOONCAKE_E2E_BASE_PORT"


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


def free_base_port() -> int:
    """``$VLLM_MOONCAKE_E2E_BASE_PORT``, else the first base whose ports are
    all free (another cluster may hold the default ones)."""
    if os.environ.get(BASE_PORT_ENV):
        return int(os.environ[BASE_PORT_ENV])
    for base in range(18600, 30000, 1000):
        spec = layout.ClusterSpec(base_port=base)
        if not any(port_in_use(p) for p in all_ports(spec)):
            return base
    raise RuntimeError("no free port range for the e2e cluster")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if Run(run_dir(RUN)).live():
        down(RUN)  # a previous session's leftovers (e.g. a killed pytest)
    spec = layout.ClusterSpec(
        shape="1p2d",
        base_port=free_base_port(),
        kv_style="mooncake",
        decode_blocks=DECODE_BLOCKS,
    )
    started = up(spec, run=RUN, timeout=900)
    recorded = Run(started.run_dir).procs
    try:
        yield started
    finally:
        started.stop()
        left = {p.name: p.members() for p in recorded if p.members()}
        assert not left, f"processes left after stop: {left}"
