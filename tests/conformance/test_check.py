"""The conformance checker: unlisted, stale and misclassified differences."""

from __future__ import annotations

from check import Difference, Entry, Run, check, differences

STOCK: Run = {"a": {"outcome": "passed"}, "b": {"outcome": "passed"}}
GUARD: Run = {
    "a": {"outcome": "failed"},
    "b": {"outcome": "passed", "unswapped": ["X"]},
}


def entry(test: str, guard: str = "failed", cause: str = "guard") -> Entry:
    return Entry(test, "passed", guard, cause, "why")


def test_differences_label_outcome_and_unswapped() -> None:
    assert differences(STOCK, GUARD) == [
        Difference("a", "passed", "failed"),
        Difference("b", "passed", "passed+unswapped"),
    ]


def test_unlisted_difference_fails() -> None:
    problems = check(differences(STOCK, GUARD), [entry("a")], {"a": STOCK["a"]})
    assert problems == ["unlisted difference: b: stock passed, guard passed+unswapped"]


def test_listed_differences_pass_with_wildcards() -> None:
    entries = [entry("a"), entry("[b]", guard="passed+unswapped", cause="swap")]
    assert check(differences(STOCK, GUARD), entries, {"a": STOCK["a"]}) == []


def test_stale_entry_fails() -> None:
    problems = check([], [entry("a")], {})
    assert problems == [
        "stale entry (no such difference any more): a: stock passed, guard failed"
    ]


def test_cause_contradicted_by_control_run() -> None:
    diff = [Difference("a", "passed", "failed")]
    wrapping_fails_too = {"a": {"outcome": "failed"}}
    assert check(diff, [entry("a", cause="wrapping")], wrapping_fails_too) == []
    problems = check(diff, [entry("a", cause="guard")], wrapping_fails_too)
    assert len(problems) == 1 and "cause 'guard' contradicted" in problems[0]
