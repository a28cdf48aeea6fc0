"""Compare the stock and guarded runs against ``known_differences.toml``.

A *difference* is a test whose label differs between the stock and the
guarded run. A label is the outcome (passed, failed, error, skipped, xfailed,
xpassed, absent), with ``+unswapped`` when the guarded run still built one of
vLLM's own schedulers (a construction site the swap misses).

Each ``[[difference]]`` entry names a test (a node id; fnmatch wildcards
allowed), the two labels, a ``cause`` and a ``reason``:

* ``guard``    -- the guard changes the outcome: the control run (vLLM's
  MultiConnector with the same child, vLLM's scheduler) matches stock;
* ``wrapping`` -- wrapping the connector at all changes it: the control run
  differs from stock the same way;
* ``swap``     -- the swap cannot apply to this test (not checked against
  the control run).

The check fails on a difference no entry lists, on an entry that matches no
difference (stale), and on an entry whose cause the control run contradicts.
"""

from __future__ import annotations

import fnmatch
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CAUSES = ("guard", "wrapping", "swap")

Run = dict[str, dict[str, Any]]  # node id -> recorded outcome


@dataclass(frozen=True)
class Difference:
    test: str
    stock: str
    guard: str


@dataclass(frozen=True)
class Entry:
    test: str
    stock: str
    guard: str
    cause: str
    reason: str

    def matches(self, diff: Difference) -> bool:
        return (
            fnmatch.fnmatchcase(diff.test, self.test)
            and diff.stock == self.stock
            and diff.guard == self.guard
        )


def label(record: dict[str, Any] | None) -> str:
    if record is None:
        return "absent"
    suffix = "+unswapped" if record.get("unswapped") else ""
    return f"{record['outcome']}{suffix}"


def load_run(path: Path) -> Run:
    tests: Run = json.loads(path.read_text())["tests"]
    return tests


def differences(stock: Run, guard: Run) -> list[Difference]:
    found = []
    for test in sorted(set(stock) | set(guard)):
        before, after = label(stock.get(test)), label(guard.get(test))
        if before != after:
            found.append(Difference(test, before, after))
    return found


def load_entries(path: Path) -> list[Entry]:
    with path.open("rb") as f:
        raw = tomllib.load(f).get("difference", [])
    entries = []
    for i, item in enumerate(raw):
        missing = {"test", "stock", "guard", "cause", "reason"} - set(item)
        if missing:
            raise ValueError(f"{path}: difference #{i + 1} lacks {sorted(missing)}")
        if item["cause"] not in CAUSES:
            raise ValueError(f"{path}: difference #{i + 1}: cause must be {CAUSES}")
        entries.append(Entry(**{k: item[k] for k in Entry.__dataclass_fields__}))
    return entries


def _cause_problem(entry: Entry, diff: Difference, control: Run) -> str | None:
    """Why the control run contradicts ``entry``'s cause (None: it agrees)."""
    if entry.cause == "swap":
        return None
    seen = label(control.get(diff.test))
    expected = diff.guard if entry.cause == "wrapping" else diff.stock
    if seen.split("+")[0] == expected.split("+")[0]:
        return None
    return (
        f"cause {entry.cause!r} contradicted: {diff.test} is {seen} with "
        f"MultiConnector alone (stock {diff.stock}, guard {diff.guard})"
    )


def check(
    diffs: list[Difference], entries: list[Entry], control: Run, stale: bool = True
) -> list[str]:
    """Every problem, one line each (an empty list: the tier passes).

    ``stale=False`` (a run of a few tests) leaves out unmatched entries.
    """
    problems: list[str] = []
    used: set[Entry] = set()
    for diff in diffs:
        entry = next((e for e in entries if e.matches(diff)), None)
        if entry is None:
            problems.append(
                f"unlisted difference: {diff.test}: stock {diff.stock}, "
                f"guard {diff.guard}"
            )
            continue
        used.add(entry)
        problem = _cause_problem(entry, diff, control)
        if problem:
            problems.append(problem)
    for entry in entries:
        if stale and entry not in used:
            problems.append(
                f"stale entry (no such difference any more): {entry.test}: "
                f"stock {entry.stock}, guard {entry.guard}"
            )
    return problems
