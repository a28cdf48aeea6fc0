"""The simulator names a load livelock: a store load that always fails under
``kv_load_failure_policy: recompute`` (stock admission reloads it forever;
the guard's retry budget computes the request locally)."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_mooncake.tools.sim.compare import describe, format_table, mismatches
from vllm_mooncake.tools.sim.errors import ScenarioError
from vllm_mooncake.tools.sim.results import RunResult
from vllm_mooncake.tools.sim.runner import run_scenario
from vllm_mooncake.tools.sim.scenario import parse_scenario

RAW: dict[str, Any] = {
    "name": "store-always-fails",
    "mode": "single",
    "engine": {"num_blocks": 101, "kv_load_failure_policy": "recompute"},
    "limits": {"max_steps": 5000, "livelock_loads": 10},
    "requests": [
        {
            "id": "A",
            "arrival_step": 0,
            "prompt_tokens": 320,
            "max_tokens": 4,
            "load": {"child": "store", "tokens": 320, "outcome": "fail"},
        },
        {"id": "B", "arrival_step": 0, "prompt_tokens": 64, "max_tokens": 4},
    ],
    "expect": {"reserve": "livelock", "reserve+lateral": "finished"},
}


def _run(policy: str) -> RunResult:
    return run_scenario(parse_scenario(RAW).with_policy(policy))


def test_stock_admission_livelocks_and_the_run_names_the_request() -> None:
    red = _run("reserve")
    assert red.stop_reason == "livelock" and red.outcome == "livelock"
    assert red.livelocked == [{"rank": "rank0", "request": "A", "loads": 10}]
    assert red.finished == 1  # B finished; A never did
    assert red.steps < 5000  # stopped at the livelock, not at max_steps
    assert red.to_dict()["livelocked"][0]["request"] == "A"
    assert RunResult.from_dict(red.to_dict()).livelocked == red.livelocked
    assert "LIVELOCK" in format_table([red])
    (line,) = describe([red])
    assert "livelock: request A on rank rank0 started 10 loads" in line


def test_the_guard_computes_the_request_locally() -> None:
    green = _run("reserve+lateral")
    assert green.outcome == "finished" and green.livelocked == []
    assert green.finished == 2
    (rank,) = green.ranks
    assert rank.guard["load_retry_cutoffs"] == {"ScriptedLoadConnector[0]": 1}
    scenario = parse_scenario(RAW)
    assert mismatches(scenario, [green, _run("reserve")]) == []


def test_livelock_loads_is_validated_by_field() -> None:
    raw = dict(RAW, limits={"livelock_loads": 1})
    with pytest.raises(ScenarioError, match="limits.livelock_loads"):
        parse_scenario(raw)
