"""No private reach into guard/: the rule itself, read by hand.

``make lint`` runs the rule as the house plan's "No private reach" contract
(``tests/test_house_plan.py`` breaks it through ``lint-imports``). Here its
parts: what counts as a private name of ``guard/``, what counts as a reach,
and what does not.
"""

from __future__ import annotations

from pathlib import Path

from vllm_mooncake.testing.private_reach import (
    guard_private_names,
    private_reaches,
    reaches_in,
    vllm_private_names,
)

ROOT = Path(__file__).resolve().parent.parent
GUARD = ROOT / "vllm_mooncake" / "guard"
INTERNALS = ROOT / "vllm_mooncake" / "compat" / "internals.py"
SCANNED = [ROOT / "vllm_mooncake" / "testing", ROOT / "vllm_mooncake" / "tools"]


def test_the_test_doubles_tools_and_benchmarks_reach_nothing_private() -> None:
    assert private_reaches([*SCANNED, ROOT / "bench"], GUARD, INTERNALS, ROOT) == []


def test_guard_private_names_are_its_own_not_vllms() -> None:
    names = guard_private_names(GUARD, INTERNALS)
    # methods, attributes set on self, module-level helpers
    assert {"_may_preempt_for", "_budget", "_reports_loads"} <= names
    # vLLM's private names the guard overrides or sets (compat/internals.py)
    vllm = {"_connectors", "_inflight_prefill_reserved_blocks"}
    assert vllm <= vllm_private_names(INTERNALS)
    assert not vllm & names
    assert not {n for n in names if n.startswith("__")}


def test_each_kind_of_reach_is_found(tmp_path: Path) -> None:
    source = tmp_path / "tool.py"
    source.write_text(
        "from vllm_mooncake.guard.scheduler import _reports_loads\n"
        "import vllm_mooncake.guard.valve\n"
        "def f(scheduler, monkeypatch):\n"
        "    scheduler.guard_valve._budget += 1\n"
        "    monkeypatch.setattr(type(scheduler.guard_valve), '_may_preempt_for', f)\n"
        "class Mine:\n"
        "    def g(self):\n"
        "        self._budget = 0  # its own attribute: no reach\n"
        "        return self.scheduler._connectors  # vLLM's: no reach\n"
    )
    private = guard_private_names(GUARD, INTERNALS)
    found = [(r.line, r.what) for r in reaches_in(source, private)]
    assert found == [
        (1, "import of _reports_loads"),
        (4, "attribute ._budget"),
        (5, "the name '_may_preempt_for'"),
    ]
