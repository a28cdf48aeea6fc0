"""Malformed guard configurations: one clear error at start-up, and the same
from ``check-config`` (``python -m vllm_mooncake.tools.check_config``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_mooncake.guard.config import GuardConfigError
from vllm_mooncake.plugin import check_scheduler_cls
from vllm_mooncake.testing.configs import SCRIPTED_MODULE, guarded, scripted_child
from vllm_mooncake.testing.driver import EngineShape, SchedulerDriver, make_vllm_config
from vllm_mooncake.tools.check_config import check, check_kv_transfer_config, main

ROOT = Path(__file__).resolve().parent.parent
CHECK_CONFIG = "vllm_mooncake.tools.check_config"
CHILDREN = "kv_connector_extra_config.connectors"


def _with_children(*children: Any, raw: Any = None) -> dict[str, Any]:
    cfg = guarded()
    connectors = list(children) if raw is None else raw
    cfg["kv_connector_extra_config"]["connectors"] = connectors
    return cfg


def _with_guard(section: Any) -> dict[str, Any]:
    cfg = guarded()
    cfg["kv_connector_extra_config"]["wedge_guard"] = section
    return cfg


def _child(**fields: Any) -> dict[str, Any]:
    return {**scripted_child("store_load"), **fields}


# (config, the field the message names, the fix it gives)
BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "unknown child": (
        _with_children({"kv_connector": "NixlConector", "kv_role": "kv_both"}),
        f"{CHILDREN}[0].kv_connector: 'NixlConector' is not a connector vLLM knows",
        "did you mean 'NixlConnector'?",
    ),
    "child module not importable": (
        _with_children(_child(kv_connector_module_path="no_such_pkg.connector")),
        f"{CHILDREN}[0].kv_connector_module_path: cannot import "
        "'no_such_pkg.connector'",
        "install the package that provides it or fix the path",
    ),
    "child class not in its module": (
        _with_children(_child(kv_connector="NoSuchConnector")),
        f"{CHILDREN}[0].kv_connector: '{SCRIPTED_MODULE}' has no class "
        "'NoSuchConnector'",
        "name a connector class defined there",
    ),
    "guard as its own child": (
        _with_children({"kv_connector": "WedgeGuardConnector"}),
        f"{CHILDREN}[0].kv_connector: the guard cannot be its own child",
        "list the transports it wraps",
    ),
    "duplicate child": (
        _with_children(scripted_child("a"), scripted_child("a")),
        f"{CHILDREN}[1]: duplicates kv_transfer_config.{CHILDREN}[0]",
        "list each child once",
    ),
    "empty children": (
        _with_children(),
        f"{CHILDREN}: expected a non-empty list",
        "child connector configs",
    ),
    "children not a list": (
        _with_children(raw="NixlConnector"),
        f"{CHILDREN}: expected a non-empty list",
        "child connector configs",
    ),
    "child not an object": (
        _with_children("NixlConnector", "MooncakeConnector"),
        f"{CHILDREN}[0]: expected a JSON object",
        "got 'NixlConnector'",
    ),
    "child without a name": (
        _with_children({"kv_role": "kv_both"}),
        f"{CHILDREN}[0].kv_connector: missing",
        "name the child, e.g. NixlConnector",
    ),
    "child role": (
        _with_children(_child(kv_role="decode")),
        f"{CHILDREN}[0].kv_role: 'decode' is not a role",
        "use one of 'kv_producer', 'kv_consumer', 'kv_both'",
    ),
    "child extra config type": (
        _with_children(_child(kv_connector_extra_config=["params_key"])),
        f"{CHILDREN}[0].kv_connector_extra_config: expected a JSON object",
        "got ['params_key']",
    ),
    "child module path type": (
        _with_children(_child(kv_connector_module_path=7)),
        f"{CHILDREN}[0].kv_connector_module_path: expected a module path",
        "got 7",
    ),
    "unknown policy": (
        _with_guard({"policy": "greedy"}),
        "kv_connector_extra_config.wedge_guard.policy: 'greedy' is not a policy",
        "use one of 'reserve', 'reserve+lateral', 'lateral', 'no-reserve'",
    ),
    "max_attempts too low": (
        _with_guard({"max_attempts": 0}),
        "wedge_guard.max_attempts: 0 is out of range",
        "use 1..1024",
    ),
    "max_attempts too high": (
        _with_guard({"max_attempts": 5000}),
        "wedge_guard.max_attempts: 5000 is out of range",
        "use 1..1024",
    ),
    "max_attempts type": (
        _with_guard({"max_attempts": "16"}),
        "wedge_guard.max_attempts: expected an integer, got '16' (str)",
        "write e.g. 16",
    ),
    "max_failed_loads too low": (
        _with_guard({"max_failed_loads": 0}),
        "wedge_guard.max_failed_loads: 0 is out of range",
        "use 1..1000",
    ),
    "max_failed_loads type": (
        _with_guard({"max_failed_loads": 2.5}),
        "wedge_guard.max_failed_loads: expected an integer, got 2.5 (float)",
        "write e.g. 3",
    ),
    "bool type": (
        _with_guard({"strict": "yes"}),
        "wedge_guard.strict: expected true or false",
        "got 'yes'",
    ),
    "unknown guard field": (
        _with_guard({"polcy": "lateral"}),
        "wedge_guard.polcy: unknown field",
        "the known fields are",
    ),
    "guard section type": (
        _with_guard("lateral"),
        "kv_connector_extra_config.wedge_guard: expected a JSON object",
        '{"policy": "reserve+lateral"}',
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_config_fails_at_start_up_with_field_and_fix(name: str) -> None:
    config, field, fix = BAD[name]
    # vLLM's config (pydantic) re-raises GuardConfigError as a ValueError.
    with pytest.raises(ValueError) as info:
        SchedulerDriver.build(EngineShape(), config)
    assert field in str(info.value)
    assert fix in str(info.value)


@pytest.mark.parametrize("name", list(BAD))
def test_check_config_gives_the_same_error(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config, field, fix = BAD[name]
    assert main([json.dumps(config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert field in err and fix in err
    assert len(err.strip().splitlines()) == 1  # one clear line


# ---- scheduler_cls ------------------------------------------------------------------
@pytest.fixture
def composed_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_guarded_sched.py").write_text(
        "from vllm.v1.core.sched.scheduler import Scheduler\n"
        "from vllm_mooncake.guard.scheduler import WedgeGuardMixin\n"
        "class MyGuarded(WedgeGuardMixin, Scheduler):\n    pass\n"
        "class NotGuarded(Scheduler):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_guarded_sched"


def test_composed_scheduler_cls_by_dotted_path_is_accepted(
    composed_module: str,
) -> None:
    """What the conflict message tells users to do must work (it was refused:
    only class objects were checked, never the --scheduler-cls string)."""
    path = f"{composed_module}.MyGuarded"
    vc = make_vllm_config(EngineShape(), guarded(), scheduler_cls=path)
    assert vc.scheduler_config.scheduler_cls == path


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        ("NotGuarded", "conflicts with the wedge guard"),
        ("Missing", "cannot import it"),
    ],
)
def test_scheduler_cls_that_cannot_run_the_guard_is_refused(
    composed_module: str, cls: str, message: str
) -> None:
    path = f"{composed_module}.{cls}"
    with pytest.raises(ValueError, match=message) as info:
        make_vllm_config(EngineShape(), guarded(), scheduler_cls=path)
    assert f"scheduler_config.scheduler_cls='{path}'" in str(info.value)
    assert "Compose them" in str(info.value)
    with pytest.raises(GuardConfigError, match=message):
        check_scheduler_cls(path)


def test_check_config_reads_scheduler_cls_next_to_the_config(
    composed_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    wrapper = {"kv_transfer_config": guarded(), "scheduler_cls": "vllm.Foo"}
    assert main([json.dumps(wrapper)]) == 1
    assert "scheduler_cls='vllm.Foo': cannot import it" in capsys.readouterr().err
    wrapper["scheduler_cls"] = f"{composed_module}.MyGuarded"
    assert main([json.dumps(wrapper)]) == 0


# ---- the command --------------------------------------------------------------
README_CONFIG = {
    "kv_connector": "WedgeGuardConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "connectors": [
            {
                "kv_connector": "MooncakeConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"mooncake_protocol": "rdma"},
            },
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        ],
        "wedge_guard": {"policy": "reserve+lateral", "max_attempts": 16},
    },
}


def test_readme_config_is_ok_from_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(README_CONFIG))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: policy=reserve+lateral max_attempts=16 ")
    assert "children=[MooncakeConnector, NixlConnector]" in out


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("{not json", "the argument is not valid JSON"),
        ("missing.json", "is not valid JSON (no such file)"),
        ("[1, 2]", "expected a JSON object"),
        ('{"kv_connector": "NixlConnector"}', "'NixlConnector' is not the guard"),
        (
            '{"kv_connector": "WedgeGuardConnector", '
            '"kv_connector_extra_config": ["x"]}',
            "kv_connector_extra_config: expected a JSON object",
        ),
        (
            json.dumps({**README_CONFIG, "kv_load_failure_policy": "retry"}),
            "kv_load_failure_policy",
        ),
    ],
)
def test_check_config_input_errors(
    arg: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([arg]) == 1
    assert message in capsys.readouterr().err


def test_check_returns_a_summary_or_the_error() -> None:
    assert check({"kv_transfer_config": guarded("lateral")}).startswith(
        "policy=lateral max_attempts=16 max_failed_loads=3 stall_alarm_s=10 "
        "children=[ScriptedLoadConnector, "
    )
    assert check_kv_transfer_config(guarded()) is None
    config, field, _ = BAD["unknown policy"]
    assert field in (check_kv_transfer_config(config) or "")


def test_the_module_runs_as_a_command(tmp_path: Path) -> None:
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(README_CONFIG))
    ok = subprocess.run(
        [sys.executable, "-m", "vllm_mooncake.tools.check_config", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("OK: ")
    bad = subprocess.run(
        [sys.executable, "-m", CHECK_CONFIG, '{"kv_connector": 1}'],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 1
    assert "error: kv_transfer_config.kv_connector: 1 is not the guard" in bad.stderr


# ---- whole messages of a bad child ---------------------------------------------
def _registered() -> str:
    """vLLM's registered connector names, as the message lists them."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return ", ".join(sorted(KVConnectorFactory._registry))


def test_an_unknown_child_gets_the_close_name_every_name_and_the_other_way() -> None:
    error = check_kv_transfer_config(
        _with_children({"kv_connector": "NixlConector", "kv_role": "kv_both"})
    )
    assert error == (
        f"kv_transfer_config.{CHILDREN}[0].kv_connector: 'NixlConector' is not "
        "a connector vLLM knows; did you mean 'NixlConnector'? use a registered name "
        f"({_registered()}) or set kv_connector_module_path to the module "
        "that defines it"
    )


def test_an_unknown_child_with_no_close_name_gets_no_guess() -> None:
    error = check_kv_transfer_config(
        _with_children({"kv_connector": "Zq", "kv_role": "kv_both"})
    )
    assert error is not None
    assert "did you mean" not in error
    assert "'Zq' is not a connector vLLM knows; use a registered name (" in error


@pytest.mark.parametrize(
    "child",
    [
        {"kv_connector": "WedgeGuardConnector", "kv_role": "kv_both"},
        {
            "kv_connector": "AnyName",
            "kv_connector_module_path": "vllm_mooncake.guard.connector",
            "kv_role": "kv_both",
        },
    ],
    ids=["by-name", "by-module-path"],
)
def test_the_guard_as_its_own_child_is_told_what_to_list(child: dict[str, Any]) -> None:
    assert check_kv_transfer_config(_with_children(child)) == (
        f"kv_transfer_config.{CHILDREN}[0].kv_connector: the guard cannot be "
        "its own child; list the transports it wraps, e.g. MooncakeConnector "
        "and NixlConnector"
    )
