"""The simulator's moving parts: timed receives, the producer's held blocks,
the P->D hand-off and lease, the cost model, determinism, the CLI outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_mooncake.testing.configs import STORE_KEY, scripted_multi, scripted_single
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver
from vllm_mooncake.testing.leaks import assert_scheduler_empty
from vllm_mooncake.tools.sim.__main__ import SCENARIO_LIBRARY, main
from vllm_mooncake.tools.sim.compare import format_table
from vllm_mooncake.tools.sim.cost import CostModel
from vllm_mooncake.tools.sim.plot import plot_results
from vllm_mooncake.tools.sim.results import RunResult, without_wall
from vllm_mooncake.tools.sim.runner import run_scenario, simulate
from vllm_mooncake.tools.sim.scenario import load_scenario, parse_scenario

SEED = SCENARIO_LIBRARY / "seed_1p2d_256.yaml"
SEED_SINGLE = SEED.with_name("seed_single.yaml")


def test_timed_receive_lands_in_the_step_that_covers_its_deadline() -> None:
    d = SchedulerDriver.build(EngineShape(), scripted_single(STORE_KEY))
    params = {STORE_KEY: {"tokens": 48, "done_after_s": 0.05}}
    d.add("a", 64, max_tokens=2, kv_transfer_params=params)
    landed = []
    for k in range(6):
        d.worker.set_window(k * 0.01, (k + 1) * 0.01)  # the load starts at 0.0
        landed.append(bool(d.step().kv_connector_output.finished_recving))
        if k == 0:
            assert d.worker.next_deadline() == pytest.approx(0.05)
    assert landed == [False, False, False, False, True, False]
    d.run(10)
    assert d.finished == {"a": "length"}
    assert_scheduler_empty(d.scheduler)


def test_producer_holds_blocks_until_finished_sending() -> None:
    d = SchedulerDriver.build(EngineShape(), scripted_multi())
    d.add(
        "p",
        64,
        max_tokens=1,
        kv_transfer_params={"pd_load": {"tokens": 0, "delay_free": True}},
    )
    d.run(5)
    assert d.finished == {"p": "length"}
    assert d.num_free_blocks == d.num_usable_blocks - 4  # held for the pull
    assert "p" in d.scheduler.requests
    d.step(finished_sending=["p"])
    assert_scheduler_empty(d.scheduler)


def test_cost_model() -> None:
    cost = CostModel(fixed_s=0.004, per_token_s=2e-5, per_seq_s=5e-5, idle_tick_s=0.001)
    assert cost.step_seconds(2048, 1) == pytest.approx(0.004 + 0.04096 + 0.00005)
    assert cost.step_seconds(0, 0) == 0.001


def _one_request(lease_s: float, transfer_s: float) -> dict[str, Any]:
    return {
        "mode": "pd",
        "pd": {"lease_s": lease_s, "handoff_s": 0.001},
        "cost": {"fixed_s": 0.01, "per_token_s": 0, "per_seq_s": 0},
        "requests": [
            {
                "id": "a",
                "prompt_tokens": 256,
                "max_tokens": 3,
                "transfer": {"done_after_s": transfer_s},
            },
        ],
    }


def test_handoff_pull_and_lease() -> None:
    pulled = run_scenario(parse_scenario(_one_request(lease_s=30, transfer_s=0.2)))
    assert pulled.outcome == "finished" and pulled.lease_expired == 0
    prefill = next(r for r in pulled.ranks if r.role == "prefill")
    assert prefill.min_free_blocks == prefill.usable_blocks - 16  # held, then freed
    # prefill step (10 ms) + hand-off (1 ms) + receive (200 ms, landing in a
    # 1 ms tick) + promotion + the first decode step.
    assert 0.21 < pulled.ttft_s["p50"] < 0.25  # type: ignore[operator]
    expired = run_scenario(parse_scenario(_one_request(lease_s=0.05, transfer_s=0.2)))
    assert expired.outcome == "finished" and expired.lease_expired == 1


def test_same_seed_same_json_except_wall_time() -> None:
    scenario = load_scenario(SEED).with_policy("lateral")
    a = run_scenario(scenario, scale=0.125).to_dict()
    b = run_scenario(scenario, scale=0.125).to_dict()
    assert without_wall(a) == without_wall(b)
    c = run_scenario(scenario.with_seed(7), scale=0.125).to_dict()
    assert without_wall(c) != without_wall(a)


def test_same_seed_same_json_across_processes(tmp_path: Path) -> None:
    """String hashing differs per process (PYTHONHASHSEED); the result must not."""
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    cmd = [sys.executable, "-m", "vllm_mooncake.tools.sim", "run", str(SEED)]
    cmd += ["--policy", "reserve+lateral", "--scale", "0.125", "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    here = run_scenario(load_scenario(SEED).with_policy("reserve+lateral"), 0.125)
    there = json.loads(out.read_text())
    there["source"] = here.source  # the CLI was given an absolute path too
    assert without_wall(there) == without_wall(here.to_dict())


def test_cli_run_policy_override_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["run", "w1", "--policy", "lateral", "--out", str(out), "--plot", str(png)]
    assert main([*argv, "--no-progress"]) == 0
    result = RunResult.read(out)
    assert (result.policy, result.outcome) == ("lateral", "finished")
    assert png.stat().st_size > 10_000
    assert (
        main(["run", "w1", "--out", str(out), "--fail-on-wedge", "--no-progress"]) == 0
    )
    assert (
        main(
            [
                "run",
                "w1",
                "--policy",
                "reserve",
                "--fail-on-wedge",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 1
    )


def test_compare_table_plot_and_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", "w2", "--out-dir", str(tmp_path), "--check", "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "reserve" in printed and "WEDGED" in printed
    assert (tmp_path / "compare.png").exists()
    results = [RunResult.read(p) for p in sorted(tmp_path.glob("*.json"))]
    assert {r.policy for r in results} == {
        "no-reserve",
        "reserve",
        "reserve+lateral",
        "lateral",
    }
    assert format_table(results).count("\n") == len(results) + 1
    assert plot_results(results, tmp_path / "again.png").exists()


def test_on_wedge_can_open_the_valve_and_the_run_goes_on() -> None:
    """The recovery benchmark's hook: a formed wedge, then the valve opened."""
    scenario = load_scenario(SEED_SINGLE).with_policy("no-reserve")
    seen: list[tuple[str, int]] = []

    def open_valve(cluster: Any, rank: Any) -> bool:
        seen.append((rank.name, rank.stalls.streak))
        guard = rank.scheduler.wedge_guard
        guard.config = guard.config.with_policy("lateral")
        return True

    result, cluster = simulate(scenario, on_wedge=open_valve)
    assert seen == [("rank0", scenario.limits.wedge_steps)]
    assert result.outcome == "finished" and result.finished == result.total
    assert result.lateral_preemptions == 1
    assert result.max_stall_steps == scenario.limits.wedge_steps
    assert_scheduler_empty(cluster.ranks[0].scheduler)


def test_on_wedge_returning_false_stops_the_run_as_without_it() -> None:
    scenario = load_scenario(SEED_SINGLE).with_policy("no-reserve")
    calls: list[str] = []

    def give_up(cluster: Any, rank: Any) -> bool:
        calls.append(rank.name)
        return False

    with_hook, _ = simulate(scenario, on_wedge=give_up)
    assert calls == ["rank0"]
    assert without_wall(with_hook.to_dict()) == without_wall(
        run_scenario(scenario).to_dict()
    )
