"""Typed field access over a parsed YAML mapping, with errors that name the field.

Every getter checks the type and range of one field and raises
:class:`ScenarioError` as ``<path>: expected ..., got ...``; :meth:`Reader.done`
rejects fields nobody asked for, so a typo is an error, not a silent default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TypeVar

from vllm_mooncake.tools.sim.dist import Dist, parse_dist
from vllm_mooncake.tools.sim.errors import ScenarioError

T = TypeVar("T")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class Reader:
    """Fields of one mapping at ``path`` (``""`` for the top level)."""

    def __init__(self, raw: object, path: str = "") -> None:
        if not isinstance(raw, Mapping):
            raise ScenarioError(
                path or "(top level)", f"expected a mapping, got {raw!r}"
            )
        self.raw: Mapping[str, object] = raw
        self.path = path
        self._read: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.raw and self.raw[name] is not None

    def where(self, name: str) -> str:
        return _join(self.path, name)

    def _get(self, name: str) -> object:
        self._read.add(name)
        return self.raw.get(name)

    def done(self) -> None:
        """Reject fields that were never read (typos, unknown knobs)."""
        unknown = sorted(set(self.raw) - self._read)
        if unknown:
            known = ", ".join(sorted(self._read))
            raise ScenarioError(
                self.where(str(unknown[0])), f"unknown field; known here: {known}"
            )

    # ---- scalars -------------------------------------------------------------
    def integer(
        self, name: str, default: int, lo: int | None = None, hi: int | None = None
    ) -> int:
        value = self._get(name)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not ((lo is None or value >= lo) and (hi is None or value <= hi))
        ):
            raise ScenarioError(
                self.where(name), f"expected an integer{_range(lo, hi)}, got {value!r}"
            )
        return value

    def number(
        self,
        name: str,
        default: float,
        lo: float | None = None,
        hi: float | None = None,
        lo_open: bool = False,
    ) -> float:
        value = self._get(name)
        if value is None:
            return default
        x = _finite(value)
        ok = x is not None and (hi is None or x <= hi)
        if ok and lo is not None and x is not None:
            ok = x > lo if lo_open else x >= lo
        if not ok or x is None:
            bound = _range(lo, hi, lo_open)
            raise ScenarioError(
                self.where(name), f"expected a number{bound}, got {value!r}"
            )
        return x

    def optional_number(self, name: str, lo: float | None = None) -> float | None:
        if not self.has(name):
            self._get(name)
            return None
        return self.number(name, 0.0, lo)

    def optional_integer(self, name: str, lo: int | None = None) -> int | None:
        if not self.has(name):
            self._get(name)
            return None
        return self.integer(name, 0, lo)

    def boolean(self, name: str, default: bool) -> bool:
        value = self._get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ScenarioError(
                self.where(name), f"expected true or false, got {value!r}"
            )
        return value

    def string(self, name: str, default: str) -> str:
        value = self._get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ScenarioError(self.where(name), f"expected a string, got {value!r}")
        return value

    def choice(self, name: str, default: str, choices: Sequence[str]) -> str:
        value = self._get(name)
        if value is None:
            return default
        if value not in choices:
            options = ", ".join(repr(c) for c in choices)
            raise ScenarioError(
                self.where(name), f"expected one of {options}, got {value!r}"
            )
        return str(value)

    def dist(self, name: str, default: Dist, minimum: float | None = None) -> Dist:
        value = self._get(name)
        if value is None:
            return default
        return parse_dist(value, self.where(name), minimum)

    # ---- containers ------------------------------------------------------------
    def section(self, name: str) -> Reader:
        """A nested mapping (empty when absent)."""
        value = self._get(name)
        return Reader({} if value is None else value, self.where(name))

    def optional_section(self, name: str) -> Reader | None:
        """A nested mapping, or None when absent."""
        if not self.has(name):
            self._get(name)
            return None
        return self.section(name)

    def items(self, name: str) -> list[object] | None:
        value = self._get(name)
        if value is None:
            return None
        if not isinstance(value, list):
            raise ScenarioError(self.where(name), f"expected a list, got {value!r}")
        return value


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def _range(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" in {lo}..{hi}" if not lo_open else f" > {lo} and <= {hi}"
    if lo is not None:
        return f" > {lo}" if lo_open else f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""
