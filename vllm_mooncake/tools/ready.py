"""``ready``: is the vLLM server next to this process ready for requests?

::

    python -m vllm_mooncake.tools.ready [--url http://127.0.0.1:8000] [--timeout 2]
    python -m vllm_mooncake.tools.ready --drain 120 [--quiet 5] [--url ...]

A readiness check for a guarded vLLM rank (a Kubernetes ``exec``
readinessProbe, or an operator at a shell). vLLM's ``/health`` answers 200
while a rank is stuck (requests wait, none runs, no token is scheduled); the
guard's gauge ``vllm:kv_guard_stuck`` is 1 then. The check:

1. ``GET /health``: anything but 200 is unready;
2. ``GET /metrics``: unready while any engine's ``vllm:kv_guard_stuck`` is
   1 (the guard sets it after ``recv_deadline_s`` without a scheduled token
   while requests wait, and clears it when a token is scheduled or nothing
   waits).

Exit code 0: ready; 1: unready; 2: cannot tell (the server does not answer,
or its ``/metrics`` has no ``vllm:kv_guard_stuck`` series: the guard is not
configured). One line on stdout says which check decided and why. A probe
treats 1 and 2 alike (not ready).

``--drain SECONDS`` (a ``preStop`` hook) waits instead until the server
holds no request and no KV block (``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` 0, ``vllm:kv_cache_usage_perc`` 0 on every
engine) for ``--quiet`` seconds in a row, at most SECONDS: exit 0 when
drained, 1 when the bound came first, 2 when the server cannot be read.

Standard library only, and nothing of vLLM or torch: a probe starts a fresh
interpreter every few seconds next to a busy server.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

READY, UNREADY, UNKNOWN = 0, 1, 2
STUCK = "vllm:kv_guard_stuck"
# What a drained rank reads: no request, no KV block in use. Each entry
# lists a series' names, newest first (older vLLM releases name the KV
# usage gpu_cache_usage_perc).
DRAIN_ZERO = (
    ("vllm:num_requests_running",),
    ("vllm:num_requests_waiting",),
    ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
)
DEFAULT_URL = "http://127.0.0.1:8000"


# ---- the Prometheus text format ---------------------------------------------
class MetricsFormatError(ValueError):
    """A line of ``/metrics`` that is not the Prometheus text format."""


@dataclass(frozen=True)
class Sample:
    """One sample line: ``name{labels} value [timestamp]``."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    value: float = 0.0

    def show(self) -> str:
        """The sample as Prometheus prints it (labels sorted)."""
        if not self.labels:
            return self.name
        inner = ",".join(f'{k}="{v}"' for k, v in sorted(self.labels.items()))
        return f"{self.name}{{{inner}}}"


_NAME_START = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:"
_NAME_CHARS = _NAME_START + "0123456789"
_LABEL_START = _NAME_START.replace(":", "")
_LABEL_CHARS = _LABEL_START + "0123456789"
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _name_at(line: str, pos: int, start: str, chars: str) -> int:
    """The end of the name beginning at ``pos`` (``pos`` when there is none)."""
    if pos >= len(line) or line[pos] not in start:
        return pos
    end = pos + 1
    while end < len(line) and line[end] in chars:
        end += 1
    return end


def _label_value(line: str, pos: int) -> tuple[str, int]:
    """A quoted label value starting at ``pos`` (the opening quote): the
    unescaped value and the position after the closing quote."""
    if pos >= len(line) or line[pos] != '"':
        raise MetricsFormatError("expected '\"' to open a label value")
    out: list[str] = []
    pos += 1
    while pos < len(line):
        ch = line[pos]
        if ch == '"':
            return "".join(out), pos + 1
        if ch == "\\":
            nxt = line[pos + 1 : pos + 2]
            if nxt not in _ESCAPES:
                raise MetricsFormatError(f"bad escape '\\{nxt}' in a label value")
            out.append(_ESCAPES[nxt])
            pos += 2
            continue
        out.append(ch)
        pos += 1
    raise MetricsFormatError("unterminated label value")


def _labels(line: str, pos: int) -> tuple[dict[str, str], int]:
    """The label set starting at ``pos`` (the ``{``) and the position after
    its ``}``; a trailing comma is allowed, as the format allows it."""
    labels: dict[str, str] = {}
    pos += 1
    while True:
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if line[pos : pos + 1] == "}":
            return labels, pos + 1
        end = _name_at(line, pos, _LABEL_START, _LABEL_CHARS)
        if end == pos:
            raise MetricsFormatError(f"expected a label name at column {pos + 1}")
        name = line[pos:end]
        pos = end
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if line[pos : pos + 1] != "=":
            raise MetricsFormatError(f"expected '=' after label {name!r}")
        value, pos = _label_value(line, pos + 1)
        if name in labels:
            raise MetricsFormatError(f"label {name!r} given twice")
        labels[name] = value
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if line[pos : pos + 1] == ",":
            pos += 1
        elif line[pos : pos + 1] != "}":
            raise MetricsFormatError(f"expected ',' or '}}' after label {name!r}")


def parse_sample(line: str) -> Sample:
    """One sample line of the text format."""
    end = _name_at(line, 0, _NAME_START, _NAME_CHARS)
    if end == 0:
        raise MetricsFormatError("expected a metric name")
    name, pos = line[:end], end
    labels: dict[str, str] = {}
    if line[pos : pos + 1] == "{":
        labels, pos = _labels(line, pos)
    rest = line[pos:].split()
    if not rest or len(rest) > 2 or (line[pos : pos + 1] not in (" ", "\t")):
        raise MetricsFormatError("expected ' value [timestamp]' after the name")
    try:
        value = float(rest[0])  # NaN, +Inf, -Inf included
        if len(rest) == 2:
            int(rest[1])
    except ValueError as exc:
        raise MetricsFormatError(f"not a number: {exc}") from None
    return Sample(name, labels, value)


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a ``/metrics`` page (``# HELP``, ``# TYPE``, other
    comments and blank lines skipped); :class:`MetricsFormatError` names
    the first line that is not the format."""
    samples = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            samples.append(parse_sample(line))
        except MetricsFormatError as exc:
            raise MetricsFormatError(f"line {number}: {exc}: {raw[:120]!r}") from None
    return samples


def series(samples: Iterable[Sample], name: str) -> list[Sample]:
    """The samples of one metric, by its exact name."""
    return [s for s in samples if s.name == name]


# ---- reading the server ------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """What the check decided, with the one line that says why."""

    code: int  # READY / UNREADY / UNKNOWN
    reason: str


class Unreachable(Exception):
    """The server did not answer (refused, timed out, reset)."""


def _get(url: str, timeout: float) -> tuple[int, str]:
    """(status, body) of ``GET url``; no proxy (the server is local, and a
    pod's HTTP_PROXY for model downloads must not carry the probe)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), ""
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"{url}: {reason}") from None


def _engine(sample: Sample) -> str:
    engine = sample.labels.get("engine")
    return f"engine {engine}" if engine is not None else sample.show()


def _unparsable(exc: MetricsFormatError) -> Verdict:
    return Verdict(UNKNOWN, f"cannot tell: /metrics is not Prometheus text ({exc})")


def judge(health_status: int, metrics_text: str) -> Verdict:
    """The verdict from ``/health``'s status and ``/metrics``' text."""
    if health_status != 200:
        return Verdict(UNREADY, f"unready: /health answered {health_status}")
    try:
        stuck = series(parse_metrics(metrics_text), STUCK)
    except MetricsFormatError as exc:
        return _unparsable(exc)
    if not stuck:
        return Verdict(
            UNKNOWN,
            f"cannot tell: /metrics has no {STUCK} series; the wedge guard is not "
            "configured on this server (kv_connector WedgeGuardConnector)",
        )
    for sample in stuck:
        if math.isnan(sample.value) or sample.value != 0:
            return Verdict(
                UNREADY,
                f"unready: {_engine(sample)} is stuck ({sample.show()} = "
                f"{sample.value:g}): requests wait and no token was scheduled "
                "for recv_deadline_s",
            )
    engines = ", ".join(sorted(s.labels.get("engine", "?") for s in stuck))
    return Verdict(READY, f"ready: /health 200, {STUCK} 0 on engine(s) {engines}")


def check(url: str = DEFAULT_URL, timeout: float = 2.0) -> Verdict:
    """Read ``/health`` and ``/metrics`` of the server at ``url``."""
    base = url.rstrip("/")
    try:
        status, _ = _get(f"{base}/health", timeout)
        if status != 200:
            return judge(status, "")
        status, text = _get(f"{base}/metrics", timeout)
    except Unreachable as exc:
        return Verdict(UNKNOWN, f"cannot tell: the server does not answer ({exc})")
    if status != 200:
        return Verdict(UNKNOWN, f"cannot tell: /metrics answered {status}")
    return judge(200, text)


# ---- draining before a stop ---------------------------------------------------
def busy(samples: Sequence[Sample]) -> list[str]:
    """What keeps a server from being drained: each non-zero series of
    :data:`DRAIN_ZERO` (an empty list: drained). A missing series counts as
    busy: the server cannot be shown idle without it."""
    out = []
    for names in DRAIN_ZERO:
        found = next((f for f in (series(samples, n) for n in names) if f), [])
        if not found:
            out.append(f"no {names[0]} series")
        out += [f"{s.show()} = {s.value:g}" for s in found if s.value != 0]
    return out


def drain(
    url: str = DEFAULT_URL,
    bound_s: float = 120.0,
    quiet_s: float = 5.0,
    timeout: float = 2.0,
    interval_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Verdict:
    """Wait until the server holds no request and no KV block for
    ``quiet_s`` seconds in a row, at most ``bound_s`` seconds."""
    start = clock()
    idle_since: float | None = None
    left: list[str] = []
    while True:
        now = clock()
        try:
            status, text = _get(f"{url.rstrip('/')}/metrics", timeout)
            left = (
                busy(parse_metrics(text)) if status == 200 else [f"/metrics {status}"]
            )
        except Unreachable as exc:
            return Verdict(UNKNOWN, f"cannot tell: the server does not answer ({exc})")
        except MetricsFormatError as exc:
            return _unparsable(exc)
        if left:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        if idle_since is not None and now - idle_since >= quiet_s:
            return Verdict(
                READY,
                f"drained: no request and no KV block held for {quiet_s:g} s "
                f"(after {now - start:.0f} s)",
            )
        if now - start >= bound_s:
            return Verdict(
                UNREADY,
                f"drain bound of {bound_s:g} s reached: " + "; ".join(left or ["idle"]),
            )
        sleep(interval_s)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_mooncake.tools.ready",
        description="Readiness of a guarded vLLM server (exit 0 ready, 1 unready, "
        "2 cannot tell), or --drain before a stop.",
    )
    parser.add_argument("--url", default=DEFAULT_URL, help="the server's base URL")
    parser.add_argument(
        "--timeout", type=float, default=2.0, help="seconds per HTTP request"
    )
    parser.add_argument(
        "--drain",
        type=float,
        metavar="SECONDS",
        help="wait (at most SECONDS) until the server holds no request and no "
        "KV block, instead of checking readiness",
    )
    parser.add_argument(
        "--quiet",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="with --drain: how long the server must stay idle (default 5)",
    )
    args = parser.parse_args(argv)
    if args.timeout <= 0 or (args.drain is not None and args.drain < 0):
        parser.error("--timeout must be > 0 and --drain >= 0")
    if args.drain is not None:
        verdict = drain(args.url, args.drain, args.quiet, args.timeout)
    else:
        verdict = check(args.url, args.timeout)
    print(verdict.reason, flush=True)
    return verdict.code


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "DRAIN_ZERO",
    "MetricsFormatError",
    "READY",
    "STUCK",
    "Sample",
    "UNKNOWN",
    "UNREADY",
    "Verdict",
    "busy",
    "check",
    "drain",
    "judge",
    "main",
    "parse_metrics",
    "parse_sample",
    "series",
]
