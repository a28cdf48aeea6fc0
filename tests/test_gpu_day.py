"""The GPU-day check's plan (``tools/cluster/gpu_day.py``), without a GPU.

What runs here is what can: the argument parsing and the exact commands and
environments the check would start on a GPU machine with vLLM 0.34.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllm_mooncake.tools.cluster import gpu_day


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert gpu_day.main(["--dry-run", *args]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return {d["rank"]: d for d in map(json.loads, lines)}


def _ktc(rank: dict[str, Any]) -> dict[str, Any]:
    argv = rank["argv"]
    cfg: dict[str, Any] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return cfg


def test_plan_is_a_store_mode_1p2d_stock_beside_guard_on_gpus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan = _plan(capsys, "--vllm-version", "0.34.0", "--base-port", "23000")
    assert set(plan) == {"prefill-0", "decode-0", "decode-1"}
    assert [plan[r]["env"]["CUDA_VISIBLE_DEVICES"] for r in sorted(plan)] == [
        "1",
        "2",
        "0",
    ]
    assert _ktc(plan["decode-0"])["kv_connector"] == "MultiConnector"
    guard = _ktc(plan["decode-1"])
    assert guard["kv_connector"] == "WedgeGuardConnector"
    assert guard["kv_load_failure_policy"] == "recompute"
    store, p2d = guard["kv_connector_extra_config"]["connectors"]
    assert store["kv_connector"] == "MooncakeStoreConnector"
    assert p2d["kv_connector_extra_config"]["mooncake_protocol"] == "rdma"
    for rank in plan.values():
        argv = rank["argv"]
        assert "--enforce-eager" not in argv  # GPU: vLLM's own defaults
        assert argv[argv.index("--scheduling-policy") + 1] == "priority"
        assert "--no-scheduler-reserve-full-isl" in argv
    # 0.34 takes the launcher's bootstrap server and shares prefix hashes.
    prefill_mc = _ktc(plan["prefill-0"])["kv_connector_extra_config"]["connectors"][1]
    assert prefill_mc["kv_connector_extra_config"]["bootstrap_server_address"] == (
        "127.0.0.1:23300"
    )
    assert "PYTHONHASHSEED" not in plan["decode-1"]["env"]


def test_tcp_and_pool_size_are_options(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(capsys, "--protocol", "tcp", "--decode-blocks", "12")
    argv = plan["decode-1"]["argv"]
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "12"
    p2d = _ktc(plan["decode-1"])["kv_connector_extra_config"]["connectors"][1]
    assert p2d["kv_connector_extra_config"]["mooncake_protocol"] == "tcp"


def test_a_bad_argument_fails_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gpu_day.main(["--protocol", "ib"])
    assert "--protocol" in capsys.readouterr().err


def test_an_unsupported_release_fails_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match=r"0\.35"):
        gpu_day.main(["--dry-run", "--vllm-version", "0.35.0"])
