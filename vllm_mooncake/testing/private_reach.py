"""No private reach: the test doubles, tools and benchmarks use guard/'s public names.

The import contracts see which module imports which, not which names are
used: a checker that patches ``scheduler._preempt_laterally`` or a tool that
reads ``scheduler._lateral_this_call`` imports nothing private, yet breaks
when ``guard/`` is refactored. This house rule reads the source instead
(``docs/architecture.md``, "Seams"):

- a guard-private name is one ``guard/`` defines -- a module-level function,
  class or variable, a method or class attribute, an attribute its code sets
  on ``self`` -- that starts with one underscore, less the private vLLM
  names the guard overrides or sets (``_connectors``,
  ``_inflight_prefill_reserved_blocks``, ...), each of which
  ``compat/internals.py`` lists as vLLM's;
- a reach is, in a scanned file, an attribute of that name on anything but
  the file's own ``self`` / ``cls``, a string equal to it (``getattr``,
  ``monkeypatch.setattr``, a table of method names), or an import of a
  ``_name`` from ``vllm_mooncake.guard``.

What the tools and tests need goes through the observer seam
(``guard/observer.py``) or another public name. ``make lint`` runs the rule
as the house plan's "No private reach" contract
(:class:`NoPrivateReachContract`, ``[tool.importlinter]`` in
``pyproject.toml``); ``tests/test_house_plan.py`` plants a reach and sees it
caught.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck

GUARD_PACKAGE = "vllm_mooncake.guard"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.Module) -> Iterator[str]:
    """Every name a module defines: at module level, in its classes, and as
    ``self.<name>`` in its functions."""
    for node in tree.body:
        yield from _bound(node)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                yield from _bound(item)
    for found in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(found, ast.Assign):
            targets = found.targets
        elif isinstance(found, ast.AnnAssign | ast.AugAssign):
            targets = [found.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id in ("self", "cls")
            ):
                yield target.attr


def _bound(node: ast.stmt) -> Iterator[str]:
    """The names one module- or class-level statement binds."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        yield node.name
    elif isinstance(node, ast.Assign):
        for target in node.targets:
            yield from (n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        yield node.target.id


def vllm_private_names(internals: Path) -> frozenset[str]:
    """The private vLLM names ``compat/internals.py`` lists (its strings)."""
    tree = ast.parse(internals.read_text(), str(internals))
    return frozenset(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and _is_private(node.value)
    )


def guard_private_names(guard: Path, internals: Path) -> frozenset[str]:
    """The private names of ``guard/`` (see the module docstring)."""
    names: set[str] = set()
    for path in sorted(guard.glob("*.py")):
        names.update(_defined(ast.parse(path.read_text(), str(path))))
    return frozenset(n for n in names if _is_private(n)) - vllm_private_names(internals)


@dataclass(frozen=True)
class Reach:
    """One use of a guard-private name outside guard/."""

    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def reaches_in(path: Path, private: frozenset[str], shown: str = "") -> list[Reach]:
    """The reaches into ``private`` in one Python file."""
    tree = ast.parse(path.read_text(), str(path))
    where = shown or str(path)
    found: list[Reach] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not own:
                found.append(Reach(where, node.lineno, f"attribute .{node.attr}"))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in private
        ):
            found.append(Reach(where, node.lineno, f"the name {node.value!r}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            GUARD_PACKAGE
        ):
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(Reach(where, node.lineno, f"import of {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if alias.name.startswith(GUARD_PACKAGE) and any(
                    _is_private(p) for p in parts
                ):
                    found.append(Reach(where, node.lineno, f"import of {alias.name}"))
    return sorted(found, key=lambda r: r.line)


def private_reaches(
    scanned: Iterable[Path], guard: Path, internals: Path, root: Path | None = None
) -> list[Reach]:
    """Every reach into guard/'s private names under the ``scanned`` paths
    (directories are read recursively; paths shown relative to ``root``)."""
    private = guard_private_names(guard, internals)
    found: list[Reach] = []
    for top in scanned:
        files = [top] if top.is_file() else sorted(top.rglob("*.py"))
        for path in files:
            shown = str(path)
            if root is not None and path.resolve().is_relative_to(root.resolve()):
                shown = str(path.resolve().relative_to(root.resolve()))
            found.extend(reaches_in(path, private, shown))
    return found


class NoPrivateReachContract(Contract):  # type: ignore[misc]
    """The rule as an import-linter contract (``type = "no_private_reach"``).

    Options (paths relative to the directory ``lint-imports`` runs in):
    ``guard`` (the guard package's directory), ``internals``
    (``compat/internals.py``) and ``scanned`` (the directories whose files
    may not reach in). A scanned path that does not exist breaks the
    contract: a rule that reads nothing proves nothing.
    """

    type_name = "no_private_reach"

    guard = fields.StringField()
    internals = fields.StringField()
    scanned = fields.ListField(subfield=fields.StringField())

    def check(self, graph: object, verbose: bool) -> ContractCheck:
        root = Path.cwd()
        guard = root / str(self.guard)
        internals = root / str(self.internals)
        scanned = [root / str(p) for p in self.scanned]  # type: ignore[attr-defined]
        missing = [str(p) for p in (guard, internals, *scanned) if not p.exists()]
        if missing:
            return ContractCheck(kept=False, metadata={"missing": missing})
        reaches = private_reaches(scanned, guard, internals, root)
        return ContractCheck(
            kept=not reaches, metadata={"reaches": [str(r) for r in reaches]}
        )

    def render_broken_contract(self, check: ContractCheck) -> None:
        for path in check.metadata.get("missing", ()):
            output.print_error(f"{path}: no such path to read", bold=False)
        for reach in check.metadata.get("reaches", ()):
            output.print_error(
                f"{reach} (a private name of guard/; use guard/observer.py "
                "or a public name)",
                bold=False,
            )
            output.new_line()


__all__ = [
    "NoPrivateReachContract",
    "Reach",
    "guard_private_names",
    "private_reaches",
    "reaches_in",
    "vllm_private_names",
]
