"""The source check: the guard's private vLLM internals read from source.

``vllm_mooncake.compat.source_check`` reads a release's Python files with
``ast`` (no import) and compares every internal with the installed 0.32. It
is the first look at a release before it can run here (a new one, say 0.35);
0.33 and 0.34 are read from their overlays (``scripts/fetch_vllm_releases.sh``,
else their wheels), and both are also *run*, which is what supports them
(``tests/test_vllm_releases.py``). What reading alone found on 0.34 -- the
parked reservations -- is what running it had to handle.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_mooncake.compat.internals import BASELINE, INTERNALS
from vllm_mooncake.compat.source_check import (
    BROKEN,
    CHANGED,
    MISSING,
    OK,
    DirSource,
    Report,
    WheelSource,
    check_tree,
    fetch_wheel,
    installed_source,
)
from vllm_mooncake.compat.versions import SUPPORTED_VLLM
from vllm_mooncake.offline import cache_dir

SCHEDULER_PY = "vllm/v1/core/sched/scheduler.py"


def _report(spec: str) -> Report:
    overlay = cache_dir() / "vllm-releases" / spec.partition("==")[2]
    if (overlay / SCHEDULER_PY).is_file():
        return check_tree(DirSource(overlay, spec))
    try:
        wheel = fetch_wheel(cache_dir() / "wheels", spec, timeout=120)
    except (RuntimeError, OSError) as exc:  # no package index reachable
        pytest.skip(f"{spec} not in the cache and not downloadable: {exc}")
    return check_tree(WheelSource(wheel))


def _statuses(report: Report) -> dict[str, str]:
    return {f.label: f.status for f in report.findings}


def test_installed_release_matches_itself() -> None:
    report = check_tree(installed_source())
    assert report.ok
    assert set(_statuses(report).values()) == {OK}
    assert len(report.findings) == sum(
        1 for i in INTERNALS if set(BASELINE) & set(i.series)
    )


def test_vllm_0_33_keeps_every_internal_unchanged() -> None:
    report = _report("vllm==0.33.0")
    assert report.ok, report
    assert set(_statuses(report).values()) == {OK}
    assert report.new_state == []


def test_vllm_0_34_keeps_the_names_but_parks_async_load_reservations() -> None:
    """0.34 keeps every name and shape, but an async load's reservation moves
    out of ``_inflight_prefills`` into ``_parked_reservations`` (set by
    ``_reserve_parked`` at admission and again at promotion): the guard's
    lateral preemption must give a victim's parked reservation back
    (``SchedulerAccess.release_parked``; tests/test_parked_reservations.py
    runs it)."""
    report = _report("vllm==0.34.0")
    assert report.ok, report
    changed = {f.label: f.notes for f in report.findings if f.status == CHANGED}
    assert changed == {
        "Scheduler._inflight_prefill_reserved_blocks": [
            "now uses self._parked_reserved_blocks"
        ],
        "Scheduler._handle_blocked_waiting_request": ["now uses self._reserve_parked"],
        # The quarantine's release: one more parameter, with a default
        # (evict_first=False) the guard's positional call keeps.
        "BlockPool.free_blocks": [
            "parameters now (ordered_blocks, evict_first)",
            "now uses self._weak_self",
        ],
    }
    assert "_parked_reservations" in report.new_state
    assert "async_kv_waiting" in report.new_state
    assert {"0.33", "0.34"} <= set(SUPPORTED_VLLM)


@pytest.fixture
def edited_tree(tmp_path: Path) -> tuple[DirSource, Path]:
    """A copy of the installed sources the guard reads, to break on purpose."""
    src = installed_source()
    for rel in (
        SCHEDULER_PY,
        "vllm/v1/core/kv_cache_manager.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src.root / rel, tmp_path / rel)
    return DirSource(tmp_path, "edited"), tmp_path / SCHEDULER_PY


@pytest.mark.parametrize(
    ("old", "new", "label", "status", "note"),
    [
        (
            "def _handle_blocked_waiting_request(self, request: Request)",
            "def _handle_blocked_waiting_request(self, req: Request)",
            "Scheduler._handle_blocked_waiting_request",
            BROKEN,
            "parameter(s) ['request'] the guard passes are gone",
        ),
        (
            "def _free_request_blocks(self, request: Request)",
            "def _free_request_blocks(self, request: Request, now: bool)",
            "Scheduler._free_request_blocks",
            BROKEN,
            "new required parameter(s) ['now']",
        ),
        (
            "self.kv_holding_waiting",
            "self.kv_holders",
            "Scheduler.kv_holding_waiting",
            MISSING,
            "Scheduler.kv_holding_waiting is never assigned",
        ),
    ],
)
def test_a_changed_internal_is_caught_in_source(
    edited_tree: tuple[DirSource, Path],
    old: str,
    new: str,
    label: str,
    status: str,
    note: str,
) -> None:
    tree, scheduler_py = edited_tree
    text = scheduler_py.read_text()
    assert old in text
    scheduler_py.write_text(text.replace(old, new))
    report = check_tree(tree)
    finding = next(f for f in report.findings if f.label == label)
    assert finding.status == status
    assert note in "; ".join(finding.notes)
    assert not report.ok


def test_a_lost_reserved_blocks_keyword_is_caught(
    edited_tree: tuple[DirSource, Path],
) -> None:
    tree, scheduler_py = edited_tree
    text = scheduler_py.read_text()
    assert text.count("reserved_blocks=reserved_blocks") == 1
    scheduler_py.write_text(
        text.replace("reserved_blocks=reserved_blocks", "reserved=reserved_blocks")
    )
    report = check_tree(tree)
    assert report.missing_sites() == [
        "no call of self.kv_cache_manager.allocate_slots passes reserved_blocks="
    ]


def test_a_method_wrapped_whole_is_judged_by_its_signature_only() -> None:
    """``VllmConfig.__post_init__`` and NIXL's worker ``__init__`` are wrapped
    whole: a new body is fine, a parameter we pass that disappears is not."""
    from vllm_mooncake.compat.source_check import Shape, compare

    (item,) = [i for i in INTERNALS if i.name == "__init__" and not i.body_matters]
    base = Shape(
        True, "__init__", params=("vllm_config", "engine_id"), uses=frozenset()
    )
    new_body = Shape(True, "__init__", params=base.params, uses=frozenset({"_x"}))
    assert compare(item, base, new_body).status == OK
    renamed = Shape(True, "__init__", params=("config", "engine_id"))
    assert compare(item, base, renamed).status == BROKEN
