"""Random distributions for scenario fields (lengths, latencies, think times).

A field that takes a distribution accepts either a plain number (a constant)
or a mapping with ``dist`` and that distribution's parameters, plus optional
``min`` / ``max`` clamps::

    prompt_tokens: 512                                   # constant
    prompt_tokens: {dist: uniform, low: 256, high: 2048}
    latency_s: {dist: lognormal, median: 0.05, sigma: 0.5, max: 1.0}
    output_tokens: {dist: choice, values: [16, 128], weights: [3, 1]}

Sampling takes the caller's ``random.Random``: the simulator never touches
the global random state, so a seed fixes every draw.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_mooncake.tools.sim.errors import ScenarioError

# dist -> required parameters
KINDS: dict[str, tuple[str, ...]] = {
    "constant": ("value",),
    "uniform": ("low", "high"),
    "normal": ("mean", "std"),
    "lognormal": ("median", "sigma"),
    "exponential": ("mean",),
    "choice": ("values",),
}
_CLAMPS = ("min", "max")


@dataclass(frozen=True)
class Dist:
    """One distribution; ``params`` holds its named numeric parameters."""

    kind: str
    params: tuple[tuple[str, float], ...] = ()
    values: tuple[float, ...] = ()
    weights: tuple[float, ...] = ()
    lo: float | None = None
    hi: float | None = None

    @classmethod
    def constant(cls, value: float) -> Dist:
        return cls("constant", (("value", float(value)),))

    def param(self, name: str) -> float:
        return dict(self.params)[name]

    # ---- sampling ----------------------------------------------------------
    def sample(self, rng: random.Random) -> float:
        return self._clamp(self._draw(rng))

    def sample_int(self, rng: random.Random) -> int:
        return int(round(self.sample(rng)))

    def _draw(self, rng: random.Random) -> float:
        p = dict(self.params)
        if self.kind == "constant":
            return p["value"]
        if self.kind == "uniform":
            return rng.uniform(p["low"], p["high"])
        if self.kind == "normal":
            return rng.gauss(p["mean"], p["std"])
        if self.kind == "lognormal":
            return rng.lognormvariate(math.log(p["median"]), p["sigma"])
        if self.kind == "exponential":
            return rng.expovariate(1.0 / p["mean"]) if p["mean"] > 0 else 0.0
        if self.kind == "choice":
            weights = list(self.weights) or None
            return rng.choices(self.values, weights=weights)[0]
        raise ValueError(f"unknown distribution {self.kind!r}")

    def _clamp(self, x: float) -> float:
        if self.lo is not None:
            x = max(self.lo, x)
        if self.hi is not None:
            x = min(self.hi, x)
        return x

    # ---- bounds, for validation ----------------------------------------------
    def upper_bound(self) -> float:
        """The largest value a draw can take (inf when unbounded)."""
        if self.hi is not None:
            return self.hi
        p = dict(self.params)
        bounds = {
            "constant": lambda: p["value"],
            "uniform": lambda: max(p["low"], p["high"]),
            "choice": lambda: max(self.values),
        }
        return bounds.get(self.kind, lambda: math.inf)()

    def lower_bound(self) -> float:
        """The smallest value a draw can take (-inf when unbounded)."""
        if self.lo is not None:
            return self.lo
        p = dict(self.params)
        bounds = {
            "constant": lambda: p["value"],
            "uniform": lambda: min(p["low"], p["high"]),
            "choice": lambda: min(self.values),
            "lognormal": lambda: 0.0,
            "exponential": lambda: 0.0,
        }
        return bounds.get(self.kind, lambda: -math.inf)()

    def to_json(self) -> object:
        if self.kind == "constant" and self.lo is None and self.hi is None:
            return self.param("value")
        out: dict[str, object] = {"dist": self.kind, **dict(self.params)}
        if self.kind == "choice":
            out["values"] = list(self.values)
            if self.weights:
                out["weights"] = list(self.weights)
        if self.lo is not None:
            out["min"] = self.lo
        if self.hi is not None:
            out["max"] = self.hi
        return out


def _number(raw: object, where: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ScenarioError(where, f"expected a number, got {raw!r}")
    if not math.isfinite(raw):
        raise ScenarioError(where, f"expected a finite number, got {raw!r}")
    return float(raw)


def parse_dist(raw: object, where: str, minimum: float | None = None) -> Dist:
    """A number or a ``{dist: ...}`` mapping; draws must stay >= ``minimum``."""
    if not isinstance(raw, Mapping):
        dist = Dist.constant(_number(raw, where))
    else:
        dist = _parse_mapping(raw, where)
    if minimum is not None and dist.lower_bound() < minimum:
        raise ScenarioError(
            where,
            f"draws can go below {minimum:g} (lowest {dist.lower_bound():g}); "
            f"add min: {minimum:g}",
        )
    return dist


def _parse_mapping(raw: Mapping[str, object], where: str) -> Dist:
    kind = raw.get("dist")
    if kind not in KINDS:
        raise ScenarioError(
            f"{where}.dist", f"expected one of {', '.join(KINDS)}, got {kind!r}"
        )
    assert isinstance(kind, str)
    allowed = {"dist", *KINDS[kind], *_CLAMPS} | (
        {"weights"} if kind == "choice" else set()
    )
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ScenarioError(
            f"{where}.{unknown[0]}",
            f"unknown field for dist {kind}; known: {sorted(allowed)}",
        )
    for name in KINDS[kind]:
        if name not in raw:
            raise ScenarioError(f"{where}.{name}", f"required for dist {kind}")
    values, weights = _choice_lists(raw, where) if kind == "choice" else ((), ())
    params = tuple(
        (name, _number(raw[name], f"{where}.{name}"))
        for name in KINDS[kind]
        if name != "values"
    )
    _check_params(kind, dict(params), where)
    lo = _number(raw["min"], f"{where}.min") if "min" in raw else None
    hi = _number(raw["max"], f"{where}.max") if "max" in raw else None
    if lo is not None and hi is not None and lo > hi:
        raise ScenarioError(f"{where}.min", f"{lo:g} is above max {hi:g}")
    return Dist(kind, params, values, weights, lo, hi)


def _choice_lists(
    raw: Mapping[str, object], where: str
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    values = raw["values"]
    if not isinstance(values, list) or not values:
        raise ScenarioError(
            f"{where}.values", f"expected a non-empty list, got {values!r}"
        )
    nums = tuple(_number(v, f"{where}.values[{i}]") for i, v in enumerate(values))
    weights = raw.get("weights")
    if weights is None:
        return nums, ()
    if not isinstance(weights, list) or len(weights) != len(values):
        raise ScenarioError(
            f"{where}.weights",
            f"expected a list of {len(values)} numbers, got {weights!r}",
        )
    ws = tuple(_number(w, f"{where}.weights[{i}]") for i, w in enumerate(weights))
    if any(w < 0 for w in ws) or not sum(ws) > 0:
        raise ScenarioError(
            f"{where}.weights", "expected non-negative weights, not all 0"
        )
    return nums, ws


def _check_params(kind: str, p: dict[str, float], where: str) -> None:
    non_negative = {
        "normal": ("std",),
        "lognormal": ("sigma",),
        "exponential": ("mean",),
    }
    for name in non_negative.get(kind, ()):
        if p[name] < 0:
            raise ScenarioError(f"{where}.{name}", f"expected >= 0, got {p[name]:g}")
    if kind == "lognormal" and p["median"] <= 0:
        raise ScenarioError(f"{where}.median", f"expected > 0, got {p['median']:g}")
