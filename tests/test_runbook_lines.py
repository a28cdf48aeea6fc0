"""docs/runbook.md shows each guard log line as a real server prints it.

The shapes live in ``vllm_mooncake.testing.log_lines``; the end-to-end tier
finds them in real servers' logs. Here every shape must match one of the
runbook's examples (code blocks, whose wrapped lines are joined back), and
every example that looks like a guard line must match its shape: a line
that changes in the code, or an example edited by hand, fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_mooncake.testing.log_lines import RUNBOOK_LINES, LogLine

RUNBOOK = Path(__file__).resolve().parents[1] / "docs" / "runbook.md"
_FENCE = re.compile(r"^\s*```[^\n]*\n(.*?)^\s*```", re.S | re.M)
_LINE_START = re.compile(r"^\((?:EngineCore|APIServer|Worker)")


def _examples() -> list[str]:
    """Every log line in the runbook's code blocks, unwrapped."""
    lines: list[str] = []
    for block in _FENCE.findall(RUNBOOK.read_text()):
        for raw in block.splitlines():
            text = raw.strip()
            if _LINE_START.match(text):
                lines.append(text)
            elif lines and text and not text.startswith(("#", "max", "increase")):
                lines[-1] += " " + text
    return lines


@pytest.mark.parametrize("line", RUNBOOK_LINES, ids=lambda x: x.name)
def test_the_runbook_shows_each_guard_line(line: LogLine) -> None:
    assert any(line.search(ex) for ex in _examples()), line.name


def test_every_guard_example_in_the_runbook_has_its_shape() -> None:
    examples = [ex for ex in _examples() if "wedge" in ex or "max_failed_loads" in ex]
    assert examples
    for ex in examples:
        assert any(line.search(ex) for line in RUNBOOK_LINES), ex
