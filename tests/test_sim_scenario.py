"""Scenario files: the library validates; a bad file fails by field, and the
CLI says so and exits non-zero (no vLLM needed for either)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_mooncake.tools.sim.__main__ import SCENARIO_LIBRARY, main
from vllm_mooncake.tools.sim.errors import ScenarioError
from vllm_mooncake.tools.sim.scenario import load_scenario, parse_scenario
from vllm_mooncake.tools.sim.workload import build_workload

LIBRARY = sorted(SCENARIO_LIBRARY.glob("*.yaml"))
SMALL_PD: dict[str, Any] = {
    "mode": "pd",
    "ranks": {"prefill": 1, "decode": 2},
    "workload": {"num_requests": 8, "concurrency": 4},
}


def _with(path: str, value: object, base: dict[str, Any] | None = None) -> Any:
    raw = yaml.safe_load(yaml.safe_dump(base or SMALL_PD))
    node = raw
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return raw


def test_library_is_valid_and_expects_outcomes() -> None:
    names = {p.stem for p in LIBRARY}
    assert {
        "seed_1p2d_256",
        "w1",
        "w2",
        "healthy_baseline",
        "async_load_heavy",
    } <= names
    for path in LIBRARY:
        scenario = load_scenario(path)
        assert scenario.expected(), f"{path.name} has no expect section"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("ranks.decode", -1, "ranks.decode: expected an integer >= 1, got -1"),
        ("ranks.prefill", "two", "ranks.prefill: expected an integer >= 1, got 'two'"),
        ("engine.num_blok", 10, "engine.num_blok: unknown field"),
        ("engine.policy", "lifo", "engine.policy: expected one of 'fcfs', 'priority'"),
        ("guard.policy", "yolo", "guard.policy: expected one of 'reserve'"),
        ("cost.idle_tick_s", 0, "cost.idle_tick_s: expected a number > 0, got 0"),
        ("workload.prompt_tokens", {"dist": "zipf"}, "workload.prompt_tokens.dist:"),
        (
            "workload.prompt_tokens",
            {"dist": "normal", "mean": 100, "std": 10},
            "workload.prompt_tokens: draws can go below 1",
        ),
        (
            "workload.store.hit_ratio",
            1.5,
            "workload.store.hit_ratio: expected a number in 0..1",
        ),
        (
            "pd.transfer.fail_rate",
            -0.1,
            "pd.transfer.fail_rate: expected a number in 0..1",
        ),
        (
            "expect.lateral",
            "fine",
            "expect.lateral: expected one of 'finished', 'wedged'",
        ),
        (
            "workload.prompt_tokens",
            100_000,
            "workload.prompt_tokens: prompt + output (100064 tokens) exceeds",
        ),
    ],
)
def test_bad_field_is_named(path: str, value: object, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(_with(path, value))
    assert message in str(info.value)


def test_request_list_errors_name_the_entry() -> None:
    base = {"mode": "pd", "requests": [{"id": "a", "prompt_tokens": 64}]}
    cases = [
        (
            "requests.0.arrival_step",
            3,
            "requests[0].arrival_step: only for mode: single",
        ),
        ("requests.0.load", {"child": "pd"}, "requests[0].load.child: 'pd' is only"),
        ("requests.0.load", {"tokens": 99}, "requests[0].load.tokens: 99 exceeds"),
        (
            "requests.0.prompt_tokens",
            0,
            "requests[0].prompt_tokens: expected an integer",
        ),
    ]
    for path, value, message in cases:
        raw = yaml.safe_load(yaml.safe_dump(base))
        entry = raw["requests"][0]
        entry[path.split(".")[2]] = value
        with pytest.raises(ScenarioError) as info:
            parse_scenario(raw)
        assert message in str(info.value), (path, str(info.value))


def test_workload_is_fixed_by_the_seed_not_the_policy() -> None:
    scenario = load_scenario(SCENARIO_LIBRARY / "seed_1p2d_256.yaml")
    a = build_workload(scenario)
    b = build_workload(scenario.with_policy("lateral"))
    assert a == b
    other = build_workload(scenario.with_seed(scenario.seed + 1))
    assert other != a
    # Growing the workload only appends.
    small = build_workload(scenario.scaled(0.125))
    assert small.requests == a.requests[: len(small.requests)]


def test_cli_bad_scenario_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_with("ranks.decode", -1)))
    assert main(["run", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: ranks.decode: expected an integer >= 1, got -1" in err
    assert main(["validate", str(bad)]) == 2
    assert main(["compare", str(tmp_path / "missing.yaml")]) == 2


def test_cli_subprocess_exit_code() -> None:
    bad = yaml.safe_dump(_with("ranks.decode", -1))
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_mooncake.tools.sim", "validate", "/dev/stdin"],
        input=bad,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "ranks.decode: expected an integer >= 1, got -1" in proc.stderr


def test_cli_rejects_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "w1", "--policy", "yolo"])
    assert info.value.code == 2
    assert "invalid choice: 'yolo'" in capsys.readouterr().err
