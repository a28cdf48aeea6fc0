"""Routing with vLLM's REAL NixlConnector and MooncakeConnector as children.

These tests build the real vLLM 0.32 ``NixlConnector`` (which vLLM builds as
``NixlPullConnector``) and ``MooncakeConnector`` under vLLM's
``MultiConnector`` or our ``WedgeGuardConnector``, and drive vLLM's real
``Scheduler`` with :class:`~vllm_mooncake.testing.driver.SchedulerDriver`.

Only the connectors' *scheduler side* runs. No worker side is built: no NIXL
agent, no Mooncake TransferEngine, no RDMA/TCP transfer, no GPU. The
transport is faked by the driver's worker, which moves no bytes and reports a
receive as finished only when a test injects it with
``d.step(finished_recving={req_id})``. What the children *would* ask their
workers to do is visible in the per-child connector metadata of each step
(``scheduler_output.kv_connector_metadata.metadata[i]``).

The rank is a decode rank (``kv_role="kv_consumer"``, the receiving side of a
P/D pair). NIXL gets ``kv_buffer_device="cpu"`` and Mooncake
``mooncake_protocol="tcp"``: the settings both need on a host without a GPU
or RDMA (the local cluster in ``vllm_mooncake/tools/cluster`` runs them so).
Stock MultiConnector hands a Mooncake-style request to the child listed
first when both key on ``do_remote_prefill``; NIXL then asserts on the
missing NIXL fields -- the routing the guard fixes.

Two tests guard fixes found this way: the owning child is told about the
allocation first (NIXL, running first with 0 tokens, used to consume the
shared ``do_remote_prefill`` so Mooncake never pulled), and NIXL is matched
by its 0.32 base class (``NixlConnector`` is only an alias there).
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnector,
    MooncakeConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)

from vllm_mooncake.guard.connector import WedgeGuardConnector
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver, StepResult
from vllm_mooncake.testing.leaks import assert_scheduler_empty
from vllm_mooncake.testing.real_children import (
    MOONCAKE_PARAMS,
    NIXL_PARAMS,
    PEER,
    PROMPT,
    real_children_config,
)

ROLE = "kv_consumer"  # a decode rank: it pulls prefills from a remote P
NIXL, MOONCAKE = 0, 1  # child indices, in config order
# Asks for a remote prefill but carries neither child's keys.
UNROUTABLE_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": PEER,
}


def build(kv_connector: str) -> SchedulerDriver:
    d = SchedulerDriver.build(EngineShape(), real_children_config(kv_connector, ROLE))
    children = d.scheduler.connector._connectors
    assert isinstance(children[NIXL], NixlConnector)
    assert isinstance(children[MOONCAKE], MooncakeConnector)
    return d


def build_guarded() -> tuple[SchedulerDriver, WedgeGuardConnector]:
    d = build("WedgeGuardConnector")
    connector = d.scheduler.connector
    assert isinstance(connector, WedgeGuardConnector)
    return d, connector


def child_metadata(step: StepResult) -> tuple[Any, ...]:
    return tuple(step.scheduler_output.kv_connector_metadata.metadata)


def nixl_pulls(step: StepResult) -> set[str]:
    meta = child_metadata(step)[NIXL]
    assert isinstance(meta, NixlConnectorMetadata)
    return set(meta.reqs_to_recv)


def mooncake_pulls(step: StepResult) -> set[str]:
    meta = child_metadata(step)[MOONCAKE]
    assert isinstance(meta, MooncakeConnectorMetadata)
    return {
        req_id for per_engine in meta.reqs_to_recv.values() for req_id in per_engine
    }


def assert_children_hold_nothing(connector: Any) -> None:
    """The real children's scheduler sides keep no per-request state."""
    nixl = connector._connectors[NIXL].connector_scheduler
    assert not nixl._reqs_need_recv
    assert not nixl._reqs_need_send
    assert not nixl._heartbeat_req_engine
    mooncake = connector._connectors[MOONCAKE].connector_scheduler
    assert not mooncake._reqs_need_recv
    assert not mooncake._reqs_need_send
    assert not connector._requests_to_connector


def park_promote_finish(d: SchedulerDriver, req_id: str) -> None:
    """(1) parked, no token computed; (2) injected receive; (3) promoted."""
    blocks = PROMPT // d.scheduler.block_size
    assert d.status(req_id) == "WAITING_FOR_REMOTE_KVS"
    assert d.num_free_blocks == d.num_usable_blocks - blocks
    # Nothing lands until the (fake) worker says so.
    assert d.step().num_scheduled_tokens == 0
    assert d.status(req_id) == "WAITING_FOR_REMOTE_KVS"
    d.step(finished_recving={req_id})
    assert req_id in d.scheduler.finished_recving_kv_req_ids
    promoted = d.step()
    assert d.status(req_id) == "RUNNING"
    # The whole prompt was loaded; vLLM recomputes only its last token.
    assert promoted.scheduler_output.num_scheduled_tokens == {req_id: 1}
    d.run(20)
    assert d.finished == {req_id: "length"}


# ---- 1. stock MultiConnector -------------------------------------------------
def test_stock_multiconnector_gives_mooncake_request_to_nixl_which_asserts() -> None:
    """The crash of cpu-pd-e2e.md 4c, reproduced on the scheduler alone.

    Both children report the full prompt for ``do_remote_prefill``; the first
    (NIXL) claims the request, then finds no ``remote_block_ids`` in its
    ``update_state_after_alloc`` and asserts inside ``schedule()`` -- on a
    server that kills the engine core.
    """
    d = build("MultiConnector")
    d.add("mc", PROMPT, max_tokens=3, kv_transfer_params=dict(MOONCAKE_PARAMS))
    with pytest.raises(AssertionError) as excinfo:
        d.step()
    assert d.scheduler.connector._requests_to_connector == {"mc": NIXL}
    crash_site = excinfo.traceback[-1]
    assert str(crash_site.path).endswith("nixl/pull_scheduler.py")
    assert "num_external_tokens == 0" in str(crash_site.statement)


# ---- 2. the guard, Mooncake-style request ------------------------------------
def test_guard_routes_mooncake_request_to_mooncake_child() -> None:
    d, connector = build_guarded()
    d.add("mc", PROMPT, max_tokens=3, kv_transfer_params=dict(MOONCAKE_PARAMS))
    first = d.step()
    assert first.num_scheduled_tokens == 0
    assert connector._requests_to_connector == {"mc": MOONCAKE}
    entry = connector.scheduler_side.ledger.get("mc")
    assert entry is not None and entry.owner == "MooncakeConnector"
    assert connector.scheduler_side.stats.unroutable_requests == 0
    assert nixl_pulls(first) == set()  # NIXL is not asked to pull it
    park_promote_finish(d, "mc")
    assert connector.scheduler_side.ledger.get("mc") is None
    assert connector.scheduler_side.stats.ledger_errors == 0
    # Neither real child delays a free on a decode rank (both return False
    # from request_finished), so the pool drains completely.
    assert_children_hold_nothing(connector)
    assert_scheduler_empty(d.scheduler)


def test_guard_mooncake_child_is_told_to_pull() -> None:
    d, connector = build_guarded()
    d.add("mc", PROMPT, max_tokens=3, kv_transfer_params=dict(MOONCAKE_PARAMS))
    first = d.step()
    assert connector._requests_to_connector == {"mc": MOONCAKE}
    assert mooncake_pulls(first) == {"mc"}
    pull = child_metadata(first)[MOONCAKE].reqs_to_recv[PEER]["mc"]
    assert pull.transfer_id == "xfer-1"
    assert pull.local_block_ids == [d.scheduler.kv_cache_manager.get_block_ids("mc")[0]]


# ---- 3. the guard, NIXL-style request ----------------------------------------
def test_guard_routes_nixl_request_to_nixl_child() -> None:
    d, connector = build_guarded()
    assert connector.scheduler_side.router.claims[NIXL] == frozenset(
        {"remote_block_ids"}
    )
    d.add("nx", PROMPT, max_tokens=3, kv_transfer_params=dict(NIXL_PARAMS))
    first = d.step()
    assert connector.scheduler_side.stats.unroutable_requests == 0
    assert first.num_scheduled_tokens == 0
    assert connector._requests_to_connector == {"nx": NIXL}
    entry = connector.scheduler_side.ledger.get("nx")
    assert (
        entry is not None and entry.owner == connector.scheduler_side.child_names[NIXL]
    )
    assert nixl_pulls(first) == {"nx"}
    assert mooncake_pulls(first) == set()
    park_promote_finish(d, "nx")
    assert_children_hold_nothing(connector)
    assert_scheduler_empty(d.scheduler)


# ---- 4. the guard, a remote prefill no child can serve -----------------------
def test_guard_computes_unroutable_remote_prefill_locally() -> None:
    d, connector = build_guarded()
    d.add("x", PROMPT, max_tokens=3, kv_transfer_params=dict(UNROUTABLE_PARAMS))
    first = d.step()
    assert connector.scheduler_side.stats.unroutable_requests == 1
    # The whole prompt is computed here, in the first step.
    assert first.scheduler_output.num_scheduled_tokens == {"x": PROMPT}
    assert d.status("x") == "RUNNING"
    assert "x" not in connector._requests_to_connector
    entry = connector.scheduler_side.ledger.get("x")
    assert entry is not None and entry.owner is None
    assert nixl_pulls(first) == set()
    assert mooncake_pulls(first) == set()
    d.run(20)
    assert d.finished == {"x": "length"}
    assert connector.scheduler_side.stats.unroutable_requests == 1
    assert connector.scheduler_side.stats.ledger_errors == 0
    assert_children_hold_nothing(connector)
    assert_scheduler_empty(d.scheduler)


# ---- 4. Prometheus: MooncakeConnector's transfer stats -----------------------------
def _prom(registry: Any, vllm_config: Any) -> Any:
    """vLLM's front-end ``KVConnectorProm`` for ``vllm_config``, on ``registry``."""
    from vllm_mooncake.testing.prom import prom_in

    return prom_in(registry)(vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})


def _mooncake_transfer_report() -> dict[str, Any]:
    """What a worker's MooncakeConnector reports after one transfer, as the
    front-end receives it: stats keyed by the child's class name."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import (
        MooncakeKVConnectorStats,
    )

    stats = MooncakeKVConnectorStats()
    stats.record_transfer(0.004, 1 << 20, 8)
    return {"MooncakeConnector": stats.data}


@pytest.mark.parametrize("kv_connector", ["MultiConnector", "WedgeGuardConnector"])
def test_mooncake_transfer_stats_reach_prometheus_without_killing_the_front_end(
    kv_connector: str,
) -> None:
    """vLLM 0.32's MooncakeConnector reports transfer stats but builds no
    Prometheus metrics. Stock MultiConnector asserts that every child with
    stats has them: the first P->D transfer raises in the API server's
    output handler (on a real 1P2D it ended the server). The guard connector
    keeps those stats in the log line and goes on."""
    from prometheus_client import CollectorRegistry

    d = build(kv_connector)
    prom = _prom(CollectorRegistry(), d.scheduler.vllm_config)
    report = _mooncake_transfer_report()
    if kv_connector == "MultiConnector":
        with pytest.raises(AssertionError, match="MooncakeConnector is not contained"):
            prom.observe(report, 0)
        return
    for _ in range(3):  # every later report too
        prom.observe(report, 0)
