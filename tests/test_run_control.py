"""Controlling a run's processes: ``Run.paused`` (the seed on real servers
relies on it to hold a store load: tools/cluster/real_wedges.py,
``form_seed``) and ``down_live``'s spared runs. Real processes: a parent
that forks a child, both in the run's session."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from vllm_mooncake.tools.cluster.local import down_live, run_dir
from vllm_mooncake.tools.cluster.procs import Run

# A leader that forks one child; both sleep until stopped.
FAMILY = (
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    time.sleep(120)\n"
    "else:\n"
    "    time.sleep(120)\n"
)
SLEEP = "import time; time.sleep(120)"


def _state(pid: int) -> str:
    """The one-letter state of ``pid`` (``T``: stopped by a signal)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def _states(pids: list[int], want_stopped: bool) -> list[str]:
    """The states of ``pids`` once all are (or none is) stopped, or after 5 s:
    a signal takes effect soon after ``kill`` returns, not at once."""
    deadline = time.monotonic() + 5
    states = [_state(pid) for pid in pids]
    while not all((s == "T") == want_stopped for s in states):
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
        states = [_state(pid) for pid in pids]
    return states


def _family(tmp_path: Path) -> Run:
    run = Run(tmp_path / "run")
    proc = run.start("family", [sys.executable, "-c", FAMILY], dict(os.environ), "")
    deadline = time.monotonic() + 10
    while len(proc.members()) < 2:
        assert time.monotonic() < deadline, "the child was never forked"
        time.sleep(0.05)
    return run


def test_paused_stops_the_whole_session_and_resumes_it(tmp_path: Path) -> None:
    run = _family(tmp_path)
    try:
        with run.paused("family") as members:
            assert len(members) == 2
            assert _states(members, want_stopped=True) == ["T", "T"]
        assert "T" not in _states(members, want_stopped=False)
    finally:
        run.stop(timeout=5)


def test_paused_resumes_when_the_block_raises(tmp_path: Path) -> None:
    run = _family(tmp_path)
    try:
        with pytest.raises(TimeoutError), run.paused("family") as members:
            raise TimeoutError("a gate inside the block timed out")
        assert "T" not in _states(members, want_stopped=False)
    finally:
        run.stop(timeout=5)


def test_pausing_an_unrecorded_process_names_it(tmp_path: Path) -> None:
    run = Run(tmp_path / "empty")
    with pytest.raises(KeyError, match="'store-segment'"), run.paused("store-segment"):
        pass


def test_down_live_spares_the_named_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reference server started beside the next cluster survives the
    clean-up of the previous one."""
    monkeypatch.setenv("VLLM_MOONCAKE_CACHE", str(tmp_path))
    left, spared = Run(run_dir("t-left")), Run(run_dir("t-reference"))
    for run in (left, spared):
        run.start("sleeper", [sys.executable, "-c", SLEEP], dict(os.environ), "")
    try:
        assert down_live("t-", timeout=5, spare=["t-reference"]) == ["t-left"]
        assert not left.live()
        assert spared.live()
    finally:
        spared.stop(timeout=5)
