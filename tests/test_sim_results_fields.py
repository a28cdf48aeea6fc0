"""The simulator's newer scenario and result fields, each on a real run.

Schema: ``valid_tokens`` checked against the tokens offered, scripted aborts
(``abort_at_step`` / ``abort_at_s``), ``expect`` bounds on lateral
preemptions. Result: ``aborted``, ``laterals`` (every lateral preemption),
``attempts_exhausted`` (and the compare table's ``exhausted`` column), and
``leaks`` (the drain and leak check that ends every run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_mooncake.tools.sim.__main__ import SCENARIO_LIBRARY, main
from vllm_mooncake.tools.sim.compare import describe, format_table, mismatches
from vllm_mooncake.tools.sim.errors import ScenarioError
from vllm_mooncake.tools.sim.results import RunResult
from vllm_mooncake.tools.sim.runner import run_scenario, simulate
from vllm_mooncake.tools.sim.scenario import Expectation, parse_scenario


def _seed_single() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load(
        (SCENARIO_LIBRARY / "seed_single.yaml").read_text()
    )
    return raw


def _single(*requests: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"mode": "single", "requests": list(requests), **more}


# One wedge that needs three victims: A (store hit of 30 of its 81 blocks)
# is promoted while four P->D receives (17 blocks each) wait behind it.
THREE_VICTIMS: dict[str, Any] = {
    "name": "three-victims",
    "mode": "single",
    "engine": {"num_blocks": 101, "block_size": 16},
    "guard": {"max_attempts": 1},
    "limits": {"wedge_steps": 50},
    "requests": [
        {
            "id": "A",
            "arrival_step": 0,
            "prompt_tokens": 1280,
            "max_tokens": 4,
            "load": {"child": "store", "tokens": 480, "done_after_steps": 2},
        },
        *(
            {
                "id": f"B{i}",
                "arrival_step": 1,
                "prompt_tokens": 272,
                "max_tokens": 4,
                "load": {"child": "pd", "done_after_steps": 1},
            }
            for i in range(4)
        ),
    ],
}


# ---- valid_tokens ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("load", "message"),
    [
        (
            {"tokens": 100, "outcome": "partial", "valid_tokens": 120},
            "requests[0].load.valid_tokens: 120 exceeds load.tokens (100); "
            "give at most 100",
        ),
        (
            {"outcome": "partial", "valid_tokens": 200},
            "requests[0].load.valid_tokens: 200 exceeds prompt_tokens (160; "
            "load.tokens is -1: the whole prompt); give at most 160",
        ),
    ],
)
def test_valid_tokens_beyond_the_load_is_rejected_by_field(
    load: dict[str, Any], message: str
) -> None:
    raw = _single({"id": "a", "prompt_tokens": 160, "load": {"child": "store", **load}})
    with pytest.raises(ScenarioError) as info:
        parse_scenario(raw)
    assert message in str(info.value)
    assert info.value.field == "requests[0].load.valid_tokens"


def test_valid_tokens_up_to_the_load_is_accepted() -> None:
    load = {"child": "store", "tokens": 100, "outcome": "partial", "valid_tokens": 100}
    scenario = parse_scenario(_single({"id": "a", "prompt_tokens": 160, "load": load}))
    assert scenario.requests[0].load is not None
    assert scenario.requests[0].load.valid_tokens == 100


def test_transfer_valid_tokens_beyond_the_prompt_is_rejected() -> None:
    raw = {
        "mode": "pd",
        "requests": [
            {
                "id": "a",
                "prompt_tokens": 64,
                "transfer": {"outcome": "partial", "valid_tokens": 65},
            }
        ],
    }
    with pytest.raises(ScenarioError) as info:
        parse_scenario(raw)
    assert info.value.field == "requests[0].transfer.valid_tokens"
    assert "65 exceeds prompt_tokens (64" in str(info.value)


def test_cli_validate_names_the_valid_tokens_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = _seed_single()
    raw["requests"][0]["load"].update(outcome="partial", valid_tokens=801)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "requests[0].load.valid_tokens: 801 exceeds load.tokens (800)" in err


# ---- aborts ------------------------------------------------------------------------
def test_abort_at_step_ends_a_wedge_and_counts_as_aborted() -> None:
    """Stock admission wedges the seed; aborting B (the router giving up on
    it) through vLLM's finish_requests frees its blocks and A finishes."""
    raw = _seed_single()
    raw["requests"][1]["abort_at_step"] = 20
    scenario = parse_scenario(raw).with_policy("no-reserve")
    result, cluster = simulate(scenario)
    assert result.outcome == "finished"
    assert (result.finished, result.failed, result.aborted, result.total) == (
        1,
        0,
        1,
        2,
    )
    assert result.finished + result.failed + result.aborted == result.total
    assert result.max_stall_steps >= 15  # wedged until the abort
    assert cluster.ranks[0].driver.finished == {"A": "length", "B": "abort"}
    assert result.leaks == []


def test_abort_goes_through_vllm_finish_requests_as_aborted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.request import RequestStatus

    seen: list[tuple[list[str], Any]] = []
    finish = Scheduler.finish_requests

    def spy(self: Any, request_ids: Any, status: Any) -> Any:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        seen.append((ids, status))
        return finish(self, ids, status)

    monkeypatch.setattr(Scheduler, "finish_requests", spy)
    raw = _seed_single()
    raw["requests"][1]["abort_at_step"] = 5
    run_scenario(parse_scenario(raw).with_policy("no-reserve"))
    assert (["B"], RequestStatus.FINISHED_ABORTED) in seen


def test_abort_at_s_in_pd_mode_on_both_sides() -> None:
    """One request aborted while the prefill rank waits on its store load,
    one after the hand-off, while the decode rank waits on its P->D receive
    (vLLM keeps each until its receive lands, then frees it)."""
    raw = {
        "name": "pd-aborts",
        "mode": "pd",
        "pd": {"transfer": {"latency_s": 0.05}},
        "requests": [
            {
                "id": "early",
                "prompt_tokens": 512,
                "abort_at_s": 0.001,
                "load": {"child": "store", "tokens": 256, "done_after_s": 0.01},
            },
            {"id": "mid", "prompt_tokens": 256, "abort_at_s": 0.03},
            {"id": "kept", "prompt_tokens": 256},
        ],
    }
    result, cluster = simulate(parse_scenario(raw).with_policy("reserve+lateral"))
    assert result.outcome == "finished"
    assert (result.finished, result.aborted, result.failed) == (1, 2, 0)
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    assert prefill.driver.finished["early"] == "abort"
    assert "early" not in decode.driver.finished  # never handed off
    assert prefill.driver.finished["mid"] == "length"  # prefilled, then held
    assert decode.driver.finished["mid"] == "abort"
    assert result.leaks == []


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"abort_at_step": 3},
            "requests[0].abort_at_step: only for mode: single",
        ),
        (
            {"abort_at_s": 0.1, "arrival_s": 0.2},
            "requests[0].abort_at_s: 0.1 is before arrival_s (0.2)",
        ),
        ({"abort_at_s": -1}, "requests[0].abort_at_s: expected a number >= 0"),
    ],
)
def test_bad_aborts_are_named(entry: dict[str, Any], message: str) -> None:
    raw = {"mode": "pd", "requests": [{"id": "a", "prompt_tokens": 64, **entry}]}
    with pytest.raises(ScenarioError) as info:
        parse_scenario(raw)
    assert message in str(info.value)


def test_abort_step_and_seconds_together_is_rejected() -> None:
    entry = {"id": "a", "prompt_tokens": 64, "abort_at_step": 2, "abort_at_s": 0.1}
    with pytest.raises(ScenarioError, match="give abort_at_step or abort_at_s"):
        parse_scenario(_single(entry))
    early = {"id": "a", "prompt_tokens": 64, "arrival_step": 4, "abort_at_step": 2}
    with pytest.raises(ScenarioError, match="2 is before arrival_step"):
        parse_scenario(_single(early))


# ---- laterals and attempts_exhausted -----------------------------------------
def test_every_lateral_preemption_is_recorded_with_max_attempts_one() -> None:
    """One wedge, three victims, one preemption per step: the guard's
    ``wedges_resolved`` says 3, the records show one target over three
    consecutive steps and two calls that ran out of attempts."""
    result = run_scenario(parse_scenario(THREE_VICTIMS).with_policy("lateral"))
    assert result.outcome == "finished" and result.leaks == []
    records = result.laterals
    assert len(records) == result.lateral_preemptions == 3
    assert {r["target"] for r in records} == {"A"}
    assert sorted(r["victim"] for r in records) == ["B1", "B2", "B3"]
    assert {r["rank"] for r in records} == {"rank0"}
    assert {r["reason"] for r in records} == {"recv_done"}
    steps = [r["step"] for r in records]
    assert steps == list(range(steps[0], steps[0] + 3))
    times = [r["t_s"] for r in records]
    assert times == sorted(times) and times[0] > 0
    assert all(r["owner"] for r in records)
    assert result.ranks[0].guard["wedges_resolved"] == 3
    assert result.attempts_exhausted == 2
    assert result.attempts_exhausted == result.ranks[0].guard["attempts_exhausted"]


def test_enough_attempts_clear_the_wedge_in_one_call() -> None:
    raw = {**THREE_VICTIMS, "guard": {"max_attempts": 16}}
    result = run_scenario(parse_scenario(raw).with_policy("lateral"))
    assert result.attempts_exhausted == 0
    assert len({r["step"] for r in result.laterals}) == 1
    assert len(result.laterals) == 3


def test_compare_table_has_an_exhausted_column() -> None:
    result = run_scenario(parse_scenario(THREE_VICTIMS).with_policy("lateral"))
    head, _, row = format_table([result]).splitlines()
    assert head.split()[-4:] == ["lateral", "exhausted", "wall", "s"]
    assert row.split()[-3:-1] == ["3", "2"]


def test_new_fields_round_trip_through_json(tmp_path: Path) -> None:
    result = run_scenario(parse_scenario(THREE_VICTIMS).with_policy("lateral"))
    data = json.loads(result.to_json())
    for name in ("aborted", "attempts_exhausted", "laterals", "leaks"):
        assert name in data
    again = RunResult.read(result.write(tmp_path / "r.json"))
    assert again.laterals == result.laterals
    assert again.attempts_exhausted == 2 and again.leaks == []


# ---- leaks -------------------------------------------------------------------------
def test_a_wedged_run_is_drained_and_found_clean() -> None:
    result, cluster = simulate(parse_scenario(_seed_single()).with_policy("no-reserve"))
    assert result.outcome == "wedged"
    assert result.leaks == []
    assert not cluster.ranks[0].scheduler.requests


def test_a_leaking_run_is_reported_not_hidden(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A scheduler that never frees a finished request's blocks: the run's
    JSON lists the leak, the CLI prints it and exits 1."""
    monkeypatch.setattr(Scheduler, "_free_blocks", lambda self, request: None)
    scenario = tmp_path / "seed.yaml"
    scenario.write_text(yaml.safe_dump(_seed_single()))
    out = tmp_path / "r.json"
    code = main(
        ["run", str(scenario), "--policy", "lateral", "--out", str(out),
         "--no-progress"]
    )  # fmt: skip
    assert code == 1
    captured = capsys.readouterr()
    assert "leak: lateral: rank0: blocks with ref_cnt > 0" in captured.err
    assert "LEAK:" in captured.out
    result = RunResult.read(out)
    assert any("rank0: free blocks" in leak for leak in result.leaks)
    assert any("LEAK: " in line for line in describe([result]))


# ---- expect: bounds on lateral preemptions ------------------------------------
def test_expect_bounds_lateral_preemptions() -> None:
    raw = {
        **THREE_VICTIMS,
        "expect": {
            "lateral": {"outcome": "finished", "lateral_preemptions": {"max": 2}},
            "reserve+lateral": {"lateral_preemptions": {"min": 0, "max": 0}},
            "no-reserve": "wedged",
        },
    }
    scenario = parse_scenario(raw)
    assert scenario.expectations()["lateral"] == Expectation("finished", None, 2)
    assert scenario.expectations()["reserve+lateral"] == Expectation(None, 0, 0)
    assert scenario.expected() == {"lateral": "finished", "no-reserve": "wedged"}
    results = [
        run_scenario(scenario.with_policy(p))
        for p in ("lateral", "reserve+lateral", "no-reserve")
    ]
    assert mismatches(scenario, results) == [
        "lateral: expected lateral_preemptions <= 2, got 3"
    ]
    raw["expect"]["lateral"]["lateral_preemptions"] = {"min": 3, "max": 3}
    assert mismatches(parse_scenario(raw), results) == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({}, "expect.lateral: give outcome:, lateral_preemptions: or both"),
        (
            {"lateral_preemptions": {"max": -1}},
            "expect.lateral.lateral_preemptions.max: expected an integer >= 0",
        ),
        (
            {"lateral_preemptions": {"min": 3, "max": 2}},
            "expect.lateral.lateral_preemptions.min: 3 exceeds max (2)",
        ),
        (
            {"lateral_preemptions": {}},
            "expect.lateral.lateral_preemptions: give min:, max: or both",
        ),
        ({"outcome": "fine"}, "expect.lateral.outcome: expected one of 'finished'"),
        ({"laterals": 2}, "expect.lateral.laterals: unknown field"),
    ],
)
def test_bad_expect_bounds_are_named(value: object, message: str) -> None:
    raw = {**THREE_VICTIMS, "expect": {"lateral": value}}
    with pytest.raises(ScenarioError) as info:
        parse_scenario(raw)
    assert message in str(info.value)
