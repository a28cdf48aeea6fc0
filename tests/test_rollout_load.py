"""A rollout under load that stops part-way keeps what it measured.

``under_load`` drives real servers (vllm bench serve, a probe client, the
decodes' /metrics); here those parts are replaced by stand-ins that record
nothing, because this checks only what the harness keeps when a replaced
rank never comes back: the steps that finished, the load so far, the error.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_mooncake.tools.cluster import rollout, rollout_load
from vllm_mooncake.tools.cluster.procs import StartupError
from vllm_mooncake.tools.cluster.rollout import Outcome, Step


class _Traffic:
    """The probe client, with one request served before the rollout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        now = time.monotonic()
        self.outcomes = [Outcome(now, now + 0.2, "")]

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        yield

    def sent(self) -> int:
        return len(self.outcomes)

    def join(self, timeout: float) -> list[Any]:
        return []


def _stopping_rollout(
    cluster: Any, names: Sequence[str], say: Any, start_timeout: float
) -> Iterator[Step]:
    """The first rank is replaced; the second never answers /health."""
    done = Step(names[0], "crash", time.monotonic(), healthy_s=3.0, routed_s=5.0)
    yield done
    raise StartupError(f"{names[1]}: not healthy within {start_timeout:.0f} s")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for cls in (rollout_load.TokenRate, rollout_load.BenchRounds):
        monkeypatch.setattr(cls, "start", lambda self: None)
        monkeypatch.setattr(cls, "stop", lambda self, *a: None)
    monkeypatch.setattr(rollout_load, "Traffic", _Traffic)
    monkeypatch.setattr(rollout_load, "prompt_tokens", lambda urls: {})
    monkeypatch.setattr(rollout_load, "rolling", _stopping_rollout)


def test_a_rollout_that_stops_keeps_its_finished_steps_and_the_error(
    offline: None, tmp_path: Path
) -> None:
    cluster: Any = SimpleNamespace(
        decode_urls=[], prefill_urls=[], router_url="http://router"
    )
    said: list[str] = []
    run = rollout_load.under_load(
        cluster,
        ["prefill-0", "decode-0"],
        tmp_path,
        prompt=[1, 2, 3],
        baseline_s=0.0,
        tail_s=0.0,
        start_timeout=42.0,
        say=said.append,
    )
    figures = run.summary()
    assert [s.rank for s in run.steps] == ["prefill-0"]
    assert figures["steps"] == [run.steps[0].line()]
    assert figures["probe_sent"] == 1 and figures["probe_failed"] == 0
    assert figures["error"] == "StartupError: decode-0: not healthy within 42 s"
    assert any("stopped after 1 step(s)" in line for line in said)


def test_a_rollout_that_finishes_reports_no_error() -> None:
    now = time.monotonic()
    run = rollout_load.LoadRun(
        now,
        now,
        now + 1,
        [],
        [],
        rollout_load.TokenRate([]),
        rollout_load.BenchRounds(SimpleNamespace(), Path("."), 1.0, 1),  # type: ignore[arg-type]
    )
    assert "error" not in run.summary()


def test_every_step_gets_the_start_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank's start-up bound reaches the launcher for both kinds of rank."""
    seen: list[tuple[str, float]] = []

    def step(cluster: Any, name: str, say: Any, start_timeout: float) -> Step:
        seen.append((name, start_timeout))
        return Step(name, "crash", 0.0)

    monkeypatch.setattr(rollout, "roll_prefill", step)
    monkeypatch.setattr(rollout, "roll_decode", step)
    cluster: Any = SimpleNamespace(
        ranks=[
            SimpleNamespace(name="prefill-0", role="prefill"),
            SimpleNamespace(name="decode-0", role="decode"),
        ]
    )
    steps = list(
        rollout.rolling(cluster, ["prefill-0", "decode-0"], start_timeout=900.0)
    )
    assert [s.rank for s in steps] == ["prefill-0", "decode-0"]
    assert seen == [("prefill-0", 900.0), ("decode-0", 900.0)]
