"""The HMA finish path with vLLM's REAL NixlConnector and MooncakeConnector.

The guard connector is a ``MultiConnector``, which supports HMA, so vLLM's
scheduler ends every request through ``request_finished_all_groups`` (not
``request_finished``). What that call returns decides whether vLLM keeps the
blocks (a producer waiting for the decode side's pull) and which
``kv_transfer_params`` the proxy gets. Here it runs with the real children's
scheduler sides (no worker, no transfer; see tests/test_routing_real_children.py
for the set-up), on a prefill rank and on a decode rank, and is compared with
stock MultiConnector where both can run.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_mooncake.guard.connector import WedgeGuardConnector
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver
from vllm_mooncake.testing.leaks import assert_scheduler_empty
from vllm_mooncake.testing.real_children import (
    MOONCAKE_PARAMS,
    NIXL_PARAMS,
    PROMPT,
    real_children_config,
)

# Engine-specific values the producer's params carry (differ per build).
VOLATILE = ("remote_engine_id",)


def build(kv_connector: str, role: str) -> SchedulerDriver:
    return SchedulerDriver.build(
        EngineShape(), real_children_config(kv_connector, role)
    )


@pytest.fixture
def finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[str, str, tuple[bool, dict[str, Any] | None]]]:
    """Every ``request_finished_all_groups`` of the guard connector:
    (request, status, what it returned)."""
    calls: list[tuple[str, str, tuple[bool, dict[str, Any] | None]]] = []
    finished = WedgeGuardConnector.request_finished_all_groups

    def spy(self: Any, request: Any, block_ids: Any) -> Any:
        result = finished(self, request, block_ids)
        calls.append((request.request_id, request.status.name, result))
        return result

    monkeypatch.setattr(WedgeGuardConnector, "request_finished_all_groups", spy)
    return calls


def _producer_run(kv_connector: str) -> tuple[SchedulerDriver, dict[str, Any]]:
    """A prefill rank computes a request for a remote decode: it finishes
    after one token and vLLM keeps its blocks for the pull."""
    d = build(kv_connector, "kv_producer")
    d.add("p", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    step = d.step()
    assert d.finished == {"p": "length"}
    [params] = [
        o.kv_transfer_params for eo in step.engine_outputs.values() for o in eo.outputs
    ]
    assert params is not None
    return d, {k: v for k, v in params.items() if k not in VOLATILE}


def test_producer_finish_keeps_blocks_and_returns_nixl_params_as_stock(
    finishes: list[tuple[str, str, Any]],
) -> None:
    stock, stock_params = _producer_run("MultiConnector")
    guarded, params = _producer_run("WedgeGuardConnector")
    assert params == stock_params
    assert params["remote_block_ids"] and params["do_remote_prefill"] is True
    [(req_id, status, (delay_free, returned))] = finishes
    assert (req_id, status, delay_free) == ("p", "FINISHED_LENGTH_CAPPED", True)
    assert returned is not None
    assert returned["remote_block_ids"] == params["remote_block_ids"]
    # Held for the pull, as stock: the blocks go when the send is reported.
    blocks = PROMPT // guarded.scheduler.block_size
    for d in (stock, guarded):
        assert d.num_free_blocks == d.num_usable_blocks - blocks
        d.step(finished_sending={"p"})
        assert_scheduler_empty(d.scheduler)
    assert len(guarded.scheduler.connector.scheduler_side.ledger) == 0


def test_decode_abort_mid_receive_finishes_through_hma_and_drains(
    finishes: list[tuple[str, str, Any]],
) -> None:
    """A decode rank aborts a NIXL receive in flight: the finish goes through
    ``request_finished_all_groups`` at once, vLLM keeps the blocks until the
    receive notice lands, the ledger drains with it."""
    d = build("WedgeGuardConnector", "kv_consumer")
    side = d.scheduler.connector.scheduler_side
    d.add("nx", PROMPT, max_tokens=3, kv_transfer_params=dict(NIXL_PARAMS))
    d.step()
    assert d.status("nx") == "WAITING_FOR_REMOTE_KVS"
    d.abort("nx")
    assert [(r, s) for r, s, _ in finishes] == [("nx", "FINISHED_ABORTED")]
    [(_, _, (delay_free, _))] = finishes
    assert delay_free is False  # a consumer never delays a free
    assert "nx" in d.scheduler.requests  # kept: the transfer may still write
    entry = side.ledger.get("nx")
    assert entry is not None and entry.finished
    d.step(finished_recving={"nx"})
    assert side.ledger.get("nx") is None
    assert side.stats.ledger_errors == 0
    assert_scheduler_empty(d.scheduler)


def test_decode_finish_of_a_mooncake_receive_goes_through_hma(
    finishes: list[tuple[str, str, Any]],
) -> None:
    d = build("WedgeGuardConnector", "kv_consumer")
    d.add("mc", PROMPT, max_tokens=3, kv_transfer_params=dict(MOONCAKE_PARAMS))
    d.step()
    d.step(finished_recving={"mc"})
    d.run(20)
    assert d.finished == {"mc": "length"}
    assert finishes == [("mc", "FINISHED_LENGTH_CAPPED", (False, None))]
    assert len(d.scheduler.connector.scheduler_side.ledger) == 0
    assert not d.scheduler.connector._requests_to_connector
    assert_scheduler_empty(d.scheduler)
