"""The real-release tier's results as the README's table.

``make real-releases`` (tests/real_releases) writes one JSON file per release
under ``.cache/real-releases/results/``; this prints them as a Markdown table:

    python bench/real_release_table.py [RESULTS_DIR] [--record]

(``--record`` also writes it between the markers of docs/real-releases.md.)

A release with no file says "not run"; a check that started and did not
pass says "FAILED".
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = (
    Path(os.environ.get("VLLM_MOONCAKE_CACHE", str(ROOT / ".cache")))
    / "real-releases"
    / "results"
)
HEADER = (
    "| release | guarded servers | PD outputs = plain server | guard series on "
    "/metrics | wedge formed | stock | guard | measured |\n"
    "|---|---|---|---|---|---|---|---|"
)


WEDGE_NAMES = {
    "seed": "seed (vLLM's default config)",
    "w1": "W1 (priority, no full-prompt check)",
}


def _mark(value: object) -> str:
    if isinstance(value, str):
        return value
    return "ok" if value is True else "FAILED" if value is False else "not run"


def row(data: dict[str, object]) -> str:
    wedge = data.get("wedge")
    if "wedge" not in data:
        wedge_cells = ["not run", "", ""]
    elif wedge is None:
        wedge_cells = ["none on servers: " + str(data.get("why", "")), "–", "–"]
    else:
        wedge_cells = [
            WEDGE_NAMES.get(str(wedge), str(wedge)),
            str(data.get("stock") or "FAILED"),
            str(data.get("guard") or "FAILED"),
        ]
    cells = [
        str(data["version"]),
        _mark(data.get("guard_started")),
        _mark(data.get("pd_outputs_equal")),
        _mark(data.get("series_exported")),
        *wedge_cells,
        str(data.get("date", "")),
    ]
    return "| " + " | ".join(cells) + " |"


def table(results_dir: Path) -> str:
    rows = []
    for path in sorted(
        results_dir.glob("*.json"),
        key=lambda p: tuple(int(x) for x in p.stem.split(".")),
    ):
        rows.append(row(json.loads(path.read_text())))
    return "\n".join([HEADER, *rows])


BEGIN, END = "<!-- real-releases:begin -->", "<!-- real-releases:end -->"
DOC = ROOT / "docs" / "real-releases.md"


def record(doc: Path, text: str) -> None:
    """Replace what stands between the markers in ``doc`` with ``text``."""
    content = doc.read_text()
    if BEGIN not in content or END not in content:
        raise SystemExit(f"{doc}: add the markers {BEGIN} and {END} first")
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str]) -> int:
    record_it = "--record" in argv
    args = [a for a in argv if a != "--record"]
    text = table(Path(args[0]) if args else DEFAULT_DIR)
    print(text)
    if record_it:
        record(DOC, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
