"""Check the private vLLM names the guard relies on in a release's *source*.

For releases that cannot run here (the CUDA-only ``vllm`` 0.33 / 0.34
wheels), ``internals.py``'s list is checked by reading the wheel's Python
files with :mod:`ast` -- nothing is imported, so no CUDA code runs. Each
internal's shape is compared with the installed (proven) release's:

- a method: present; the parameters the guard passes still there; for the
  hooks the guard *overrides*, the same parameters exactly and no new
  required one; its return annotation; the ``self.<name>`` it uses (a new
  one, e.g. 0.34's ``_reserve_parked``, is state the guard may have to keep
  in step);
- an attribute: still assigned in ``__init__`` (and what to);
- the call sites the valve depends on: ``Scheduler`` still calls the hooks,
  and passes ``reserved_blocks=`` to ``allocate_slots`` by keyword.

``bench/version_matrix.py`` runs it on downloaded wheels and records the
table; ``tests/test_version_matrix.py`` runs it when the wheels are in the
project cache. This is evidence about *names and shapes*, not behaviour:
a release is only supported once the guard ran on it.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from vllm_mooncake.compat.internals import BASELINE, INTERNALS, Internal

# Scheduler call sites the valve depends on: (callee, keyword it must pass).
SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
CALL_SITES: tuple[tuple[str, str | None], ...] = (
    ("_handle_blocked_waiting_request", None),
    ("_inflight_prefill_reserved_blocks", None),
    ("kv_cache_manager.allocate_slots", "reserved_blocks"),
    ("_update_waiting_for_remote_kv", None),
)
# New Scheduler state worth a look when it appears (waiting / KV / reservation).
STATE_WORDS = ("waiting", "kv", "inflight", "park", "reserv", "recv")


class SourceTree(Protocol):
    label: str

    def read(self, path: str) -> str | None: ...


class WheelSource:
    """The Python files of a wheel (a zip), unimported."""

    def __init__(self, wheel: Path) -> None:
        self.label = wheel.name
        self._zip = zipfile.ZipFile(wheel)

    def read(self, path: str) -> str | None:
        try:
            return self._zip.read(path).decode()
        except KeyError:
            return None


class DirSource:
    """A directory holding the ``vllm`` package (site-packages or a target)."""

    def __init__(self, root: Path, label: str = "") -> None:
        self.root = root
        self.label = label or str(root)

    def read(self, path: str) -> str | None:
        file = self.root / path
        return file.read_text() if file.is_file() else None


def installed_source() -> DirSource:
    """The installed vLLM's source, located without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vLLM is not installed")
    package = Path(next(iter(spec.submodule_search_locations)))
    return DirSource(package.parent, "installed")


# ---- shapes ------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What one internal looks like in one release's source."""

    present: bool
    where: str = ""  # why absent, or where found
    params: tuple[str, ...] = ()  # method: parameters after self
    required: tuple[str, ...] = ()  # method: parameters without a default
    returns: str = ""  # method: the return annotation
    uses: frozenset[str] = frozenset()  # method: self.<name> it references
    assigned: str = ""  # attribute: what __init__ assigns


def _split(owner: str) -> tuple[str, str]:
    module, _, cls = owner.rpartition(".")
    return module.replace(".", "/") + ".py", cls


class ClassIndex:
    """Parsed classes of one source tree, by dotted owner."""

    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree
        self._classes: dict[str, ast.ClassDef | None] = {}
        self._sources: dict[str, str] = {}

    def find(self, owner: str) -> ast.ClassDef | None:
        if owner not in self._classes:
            path, name = _split(owner)
            text = self.tree.read(path)
            found = None
            if text is not None:
                self._sources[owner] = text
                for node in ast.walk(ast.parse(text)):
                    if isinstance(node, ast.ClassDef) and node.name == name:
                        found = node
                        break
            self._classes[owner] = found
        return self._classes[owner]

    def segment(self, owner: str, node: ast.AST | None) -> str:
        if node is None:
            return ""
        return ast.get_source_segment(self._sources.get(owner, ""), node) or ""


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {
        n.name: n
        for n in cls.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _self_names(fn: ast.AST) -> frozenset[str]:
    return frozenset(
        n.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    )


def _assignments(fn: ast.AST) -> dict[str, ast.expr | None]:
    """``self.<name>`` assigned in ``fn``: name -> value (first assignment)."""
    out: dict[str, ast.expr | None] = {}
    for node in ast.walk(fn):
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                out.setdefault(t.attr, value)
    return out


def read_shape(index: ClassIndex, item: Internal) -> Shape:
    cls = index.find(item.owner)
    if cls is None:
        path, name = _split(item.owner)
        return Shape(False, f"class {name} not found in {path}")
    methods = _methods(cls)
    if item.kind == "method":
        fn = methods.get(item.name)
        if fn is None:
            return Shape(False, f"no method {item.name} in class {cls.name}")
        args = fn.args
        positional = [a.arg for a in args.posonlyargs + args.args]
        static = any(_dotted(d) == "staticmethod" for d in fn.decorator_list)
        if not static:
            positional = positional[1:]  # self / cls
        names = tuple(positional + [a.arg for a in args.kwonlyargs])
        n_defaults = len(args.defaults)
        required_pos = positional[: len(positional) - n_defaults]
        required_kw = [
            a.arg
            for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
            if d is None
        ]
        return Shape(
            True,
            f"{cls.name}.{item.name}",
            params=names,
            required=tuple(required_pos + required_kw),
            returns=index.segment(item.owner, fn.returns),
            uses=_self_names(fn),
        )
    init = methods.get("__init__")
    assigned = _assignments(init) if init is not None else {}
    if item.name in assigned:
        return Shape(
            True, "__init__", assigned=index.segment(item.owner, assigned[item.name])
        )
    for node in cls.body:  # a class-level attribute
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == item.name for t in targets):
                return Shape(True, "class body")
        # a property reads the same as a class-level attribute
        if isinstance(node, ast.FunctionDef) and node.name == item.name:
            return Shape(True, "class body")
    elsewhere = [m for m, fn in methods.items() if item.name in _assignments(fn)]
    if elsewhere:
        return Shape(True, f"assigned in {elsewhere[0]} (not __init__)")
    return Shape(False, f"{cls.name}.{item.name} is never assigned")


# ---- comparing a release with the proven one ----------------------------------------
OK, CHANGED, BROKEN, MISSING = "ok", "changed", "BROKEN", "MISSING"


@dataclass
class Finding:
    item: Internal
    status: str
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.item.owner.rsplit('.', 1)[1]}.{self.item.name}"


def _overridden(item: Internal) -> bool:
    return item.why.startswith("overridden")


def compare(item: Internal, base: Shape, other: Shape) -> Finding:
    if not other.present:
        return Finding(item, MISSING, [other.where])
    broken: list[str] = []
    notes: list[str] = []
    if item.kind == "method":
        gone = [p for p in item.params if p not in other.params]
        if gone:
            broken.append(f"parameter(s) {gone} the guard passes are gone")
        new_required = [p for p in other.required if p not in base.params]
        if new_required:
            broken.append(f"new required parameter(s) {new_required}")
        if _overridden(item) and other.params != base.params:
            broken.append(
                f"the guard overrides it with ({', '.join(base.params)}); now "
                f"({', '.join(other.params)})"
            )
        elif other.params != base.params:
            notes.append(f"parameters now ({', '.join(other.params)})")
        if item.body_matters:
            notes += _body_notes(base, other)
    else:
        if other.where != base.where:
            notes.append(other.where)
        if other.assigned != base.assigned:
            notes.append(f"assigned {other.assigned!r} (was {base.assigned!r})")
    if broken:
        return Finding(item, BROKEN, broken + notes)
    return Finding(item, CHANGED if notes else OK, notes)


def _body_notes(base: Shape, other: Shape) -> list[str]:
    """What changed in a method's return annotation and the state it reads."""
    notes = []
    if other.returns != base.returns:
        notes.append(f"returns {other.returns or '?'} (was {base.returns or '?'})")
    added = sorted(other.uses - base.uses)
    removed = sorted(base.uses - other.uses)
    if added:
        notes.append(f"now uses self.{', self.'.join(added)}")
    if removed:
        notes.append(f"no longer uses self.{', self.'.join(removed)}")
    return notes


def call_sites(index: ClassIndex) -> dict[str, list[str]]:
    """Callee -> its call sites in Scheduler, as ``method`` or, where the
    valve needs a keyword, ``method(keyword=)`` / ``method (no keyword=)``."""
    cls = index.find(SCHEDULER)
    found: dict[str, list[str]] = {callee: [] for callee, _ in CALL_SITES}
    if cls is None:
        return found
    for name, fn in _methods(cls).items():
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            dotted = _dotted(node.func)
            for callee, keyword in CALL_SITES:
                if dotted != f"self.{callee}":
                    continue
                kws = {k.arg for k in node.keywords}
                site = name if keyword is None else f"{name}({keyword}=)"
                if keyword is None or keyword in kws:
                    found[callee].append(site)
                else:
                    found[callee].append(f"{name} (no {keyword}=)")
    return found


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def new_state(base: ClassIndex, other: ClassIndex) -> list[str]:
    """Scheduler attributes ``other`` assigns in __init__ that ``base`` does not
    (waiting / KV / reservation state only)."""

    def init_names(index: ClassIndex) -> set[str]:
        cls = index.find(SCHEDULER)
        init = _methods(cls).get("__init__") if cls else None
        return set(_assignments(init)) if init is not None else set()

    added = init_names(other) - init_names(base)
    return sorted(n for n in added if any(w in n.lower() for w in STATE_WORDS))


@dataclass
class Report:
    label: str
    findings: list[Finding]
    sites: dict[str, list[str]]
    new_state: list[str]

    def missing_sites(self) -> list[str]:
        """Call sites the valve needs that this release lacks."""
        missing = []
        for callee, keyword in CALL_SITES:
            sites = self.sites.get(callee, [])
            if keyword is None and not sites:
                missing.append(f"nothing calls self.{callee}")
            elif keyword is not None and not any(f"({keyword}=)" in s for s in sites):
                missing.append(f"no call of self.{callee} passes {keyword}=")
        return missing

    @property
    def ok(self) -> bool:
        fatal = [f for f in self.findings if f.status in (MISSING, BROKEN)]
        return not fatal and not self.missing_sites()


def check_tree(
    tree: SourceTree,
    base: SourceTree | None = None,
    series: Iterable[str] = BASELINE,
) -> Report:
    """Compare ``tree`` with ``base`` (default: the installed vLLM) for the
    internals of ``series``' layout (default: the installed release's)."""
    wanted = set(series)
    items = [i for i in INTERNALS if wanted & set(i.series)]
    base_index = ClassIndex(base or installed_source())
    index = ClassIndex(tree)
    findings = [
        compare(i, read_shape(base_index, i), read_shape(index, i)) for i in items
    ]
    return Report(tree.label, findings, call_sites(index), new_state(base_index, index))


# ---- wheels in the project cache --------------------------------------------------
def wheel_path(cache: Path, spec: str) -> Path | None:
    """The cached wheel for ``dist==version`` (e.g. ``vllm==0.34.0``), if any."""
    dist, _, version = spec.partition("==")
    matches = sorted(cache.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    return matches[0] if matches else None


def fetch_wheel(cache: Path, spec: str, timeout: float = 300) -> Path:
    """The wheel for ``spec``, downloaded (``pip download --no-deps``) if absent."""
    found = wheel_path(cache, spec)
    if found is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
    cmd += ["--disable-pip-version-check", "-d", str(cache), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    found = wheel_path(cache, spec)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"pip download {spec} failed: {proc.stderr.strip()[-500:]}")
    return found


__all__ = [
    "BROKEN",
    "CHANGED",
    "MISSING",
    "OK",
    "ClassIndex",
    "DirSource",
    "Finding",
    "Report",
    "Shape",
    "SourceTree",
    "WheelSource",
    "call_sites",
    "check_tree",
    "compare",
    "fetch_wheel",
    "installed_source",
    "new_state",
    "read_shape",
    "wheel_path",
]
