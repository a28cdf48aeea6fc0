"""The readiness check (``python -m vllm_mooncake.tools.ready``) against a
real HTTP server on 127.0.0.1 serving the pages a vLLM server would.

No vLLM: ``http.server`` in a thread, on an ephemeral port, answers
``/health`` and ``/metrics`` with what each test sets. The tool is run in
process (verdicts) and as a subprocess (exit codes, its one line, and that
it imports neither vLLM nor torch).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_mooncake.tools import ready
from vllm_mooncake.tools.ready import (
    READY,
    UNKNOWN,
    UNREADY,
    MetricsFormatError,
    parse_metrics,
)

# /metrics of a guarded vLLM server, trimmed: HELP/TYPE comments, counters
# with _total and _created, a histogram, labels with escapes, two engines.
METRICS_HEAD = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} {running}
vllm:num_requests_running{engine="1",model_name="m"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} {waiting}
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} {usage}
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.0
# HELP vllm:kv_guard_receives_failed_total Receives failed by the guard.
# TYPE vllm:kv_guard_receives_failed_total counter
vllm:kv_guard_receives_failed_total{child="Nixl",engine="0",reason="deadline"} 2
vllm:kv_guard_receives_failed_created{child="Nixl",engine="0",reason="deadline"} 1.7e9
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 7.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 12.5
# A label value with a quote, a backslash, a newline, a comma and braces:
vllm:odd_gauge{engine="0",note="a \\"q\\" \\\\ \\n, {x}",} NaN 1700000000000
# HELP vllm:kv_guard_stuck_steps not the stuck gauge (a longer name)
# TYPE vllm:kv_guard_stuck_steps gauge
vllm:kv_guard_stuck_steps{engine="0",model_name="m"} 1.0
"""
STUCK_SERIES = """\
# HELP vllm:kv_guard_stuck 1 while the rank is stuck, else 0.
# TYPE vllm:kv_guard_stuck gauge
vllm:kv_guard_stuck{engine="0",model_name="m"} {stuck0}
vllm:kv_guard_stuck{engine="1",model_name="m"} 0.0
"""


def metrics(
    stuck0: str | None = "0.0",
    running: str = "0.0",
    waiting: str = "0.0",
    usage: str = "0.0",
) -> str:
    """A /metrics page; ``stuck0=None``: no guard series at all."""
    head = (
        METRICS_HEAD.replace("{running}", running)
        .replace("{waiting}", waiting)
        .replace("{usage}", usage)
    )
    if stuck0 is None:
        return head
    return head + STUCK_SERIES.replace("{stuck0}", stuck0)


@dataclass
class Pages:
    """What the fake server answers; tests change it while it runs."""

    health: int = 200
    metrics: str = field(default_factory=metrics)
    metrics_status: int = 200
    hits: list[str] = field(default_factory=list)


@pytest.fixture
def server() -> Iterator[tuple[str, Pages]]:
    pages = Pages()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            pages.hits.append(self.path)
            if self.path == "/health":
                status, body = pages.health, b""
            elif self.path == "/metrics":
                status, body = pages.metrics_status, pages.metrics.encode()
            else:
                status, body = 404, b"not found"
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", pages
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def _closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the verdicts, against the live server ------------------------------------
def test_ready_when_healthy_and_no_engine_is_stuck(server: tuple[str, Pages]) -> None:
    url, pages = server
    verdict = ready.check(url)
    assert verdict.code == READY, verdict
    assert (
        verdict.reason == "ready: /health 200, vllm:kv_guard_stuck 0 on engine(s) 0, 1"
    )
    assert pages.hits == ["/health", "/metrics"]


def test_unready_while_an_engine_is_stuck_and_ready_again_after(
    server: tuple[str, Pages],
) -> None:
    url, pages = server
    pages.metrics = metrics(stuck0="1.0")
    verdict = ready.check(url)
    assert verdict.code == UNREADY
    assert "engine 0 is stuck" in verdict.reason
    assert 'vllm:kv_guard_stuck{engine="0",model_name="m"} = 1' in verdict.reason
    pages.metrics = metrics(stuck0="0.0")  # a token was scheduled
    assert ready.check(url).code == READY


def test_no_guard_series_means_cannot_tell(server: tuple[str, Pages]) -> None:
    url, pages = server
    pages.metrics = metrics(stuck0=None)  # vllm:kv_guard_stuck_steps is no match
    verdict = ready.check(url)
    assert verdict.code == UNKNOWN
    assert "no vllm:kv_guard_stuck series" in verdict.reason
    assert "not configured" in verdict.reason


def test_health_500_is_unready_without_reading_metrics(
    server: tuple[str, Pages],
) -> None:
    url, pages = server
    pages.health = 500
    verdict = ready.check(url)
    assert (verdict.code, verdict.reason) == (
        UNREADY,
        "unready: /health answered 500",
    )
    assert pages.hits == ["/health"]


def test_metrics_error_or_garbage_means_cannot_tell(server: tuple[str, Pages]) -> None:
    url, pages = server
    pages.metrics_status = 503
    assert ready.check(url).code == UNKNOWN
    pages.metrics_status = 200
    pages.metrics = metrics() + 'vllm:kv_guard_stuck{engine="2" 1\n'
    verdict = ready.check(url)
    assert verdict.code == UNKNOWN
    assert "not Prometheus text" in verdict.reason and "line " in verdict.reason


def test_connection_refused_means_cannot_tell() -> None:
    verdict = ready.check(f"http://127.0.0.1:{_closed_port()}", timeout=1)
    assert verdict.code == UNKNOWN
    assert verdict.reason.startswith("cannot tell: the server does not answer")


def test_a_proxy_in_the_environment_is_not_used(
    server: tuple[str, Pages], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod's HTTP_PROXY (for model downloads) must not carry the probe."""
    url, _ = server
    dead_proxy = f"http://127.0.0.1:{_closed_port()}"
    for var in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, dead_proxy)
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    assert ready.check(url).code == READY


# ---- the parser -----------------------------------------------------------------
def test_parser_reads_labels_escapes_special_values_and_timestamps() -> None:
    samples = parse_metrics(metrics(stuck0="1"))
    odd = next(s for s in samples if s.name == "vllm:odd_gauge")
    assert odd.labels == {"engine": "0", "note": 'a "q" \\ \n, {x}'}
    assert odd.value != odd.value  # NaN
    inf = next(s for s in samples if s.name.endswith("_bucket"))
    assert inf.labels["le"] == "+Inf"
    names = {s.name for s in samples}
    assert "vllm:kv_guard_receives_failed_total" in names
    assert "vllm:kv_guard_receives_failed_created" in names
    stuck = ready.series(samples, ready.STUCK)
    assert [(s.labels["engine"], s.value) for s in stuck] == [("0", 1.0), ("1", 0.0)]
    bare = ready.parse_sample("up 1")
    assert (bare.name, bare.labels, bare.value) == ("up", {}, 1.0)
    assert ready.parse_sample("x{} -Inf").value == float("-inf")


@pytest.mark.parametrize(
    "line",
    [
        "vllm:x{engine=0} 1",  # unquoted value
        'vllm:x{engine="0"',  # unterminated label set
        'vllm:x{engine="0} 1',  # unterminated value
        'vllm:x{engine="\\t"} 1',  # unknown escape
        'vllm:x{engine="0",engine="1"} 1',  # duplicate label
        "vllm:x one",  # not a number
        "vllm:x",  # no value
        "vllm:x 1 2 3",  # too many fields
        "vllm:x 1 soon",  # bad timestamp
        "9lives 1",  # bad name
        'vllm:x{"a"="b"} 1',  # bad label name
    ],
)
def test_parser_refuses_what_is_not_the_format(line: str) -> None:
    with pytest.raises(MetricsFormatError):
        parse_metrics(f"# TYPE vllm:x gauge\n{line}\n")


def test_nan_or_any_nonzero_stuck_value_is_unready() -> None:
    for value in ("NaN", "2", "0.5"):
        assert ready.judge(200, metrics(stuck0=value)).code == UNREADY, value


# ---- draining -------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_drain_waits_for_no_request_and_no_block(server: tuple[str, Pages]) -> None:
    url, pages = server
    pages.metrics = metrics(running="2", waiting="1", usage="0.4")
    clock = FakeClock()
    steps = iter(
        [
            metrics(running="1", usage="0.2"),  # a request still runs
            metrics(usage="0.1"),  # a prefill's blocks wait for a decode's pull
            metrics(),
        ]
    )

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        pages.metrics = next(steps, pages.metrics)

    verdict = ready.drain(url, bound_s=60, quiet_s=3, clock=clock, sleep=sleep)
    assert verdict.code == READY, verdict
    assert (
        verdict.reason == "drained: no request and no KV block held for 3 s (after 6 s)"
    )


def test_drain_gives_up_at_its_bound_and_says_what_is_left(
    server: tuple[str, Pages],
) -> None:
    url, pages = server
    pages.metrics = metrics(running="1", usage="0.25")
    clock = FakeClock()
    verdict = ready.drain(url, bound_s=10, quiet_s=2, clock=clock, sleep=clock.sleep)
    assert verdict.code == UNREADY
    assert verdict.reason.startswith("drain bound of 10 s reached:")
    assert 'vllm:num_requests_running{engine="0",model_name="m"} = 1' in verdict.reason
    assert "kv_cache_usage_perc" in verdict.reason
    assert clock.now == 10


def test_drain_of_a_server_without_the_usage_series_never_calls_it_idle() -> None:
    page = metrics().replace("vllm:kv_cache_usage_perc", "vllm:other")
    assert ready.busy(parse_metrics(page)) == ["no vllm:kv_cache_usage_perc series"]
    older = metrics().replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert ready.busy(parse_metrics(older)) == []


# ---- the command line, as a probe runs it -----------------------------------------
def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_mooncake.tools.ready", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_exit_codes_and_one_line_as_a_subprocess(server: tuple[str, Pages]) -> None:
    url, pages = server
    out = _run("--url", url, "--timeout", "2")
    assert (out.returncode, out.stdout.count("\n")) == (0, 1), out
    assert out.stdout.startswith("ready:")
    pages.metrics = metrics(stuck0="1")
    out = _run("--url", url)
    assert out.returncode == 1 and out.stdout.startswith("unready: engine 0"), out
    pages.metrics = metrics(stuck0=None)
    out = _run("--url", url)
    assert out.returncode == 2 and "not configured" in out.stdout, out
    out = _run("--url", f"http://127.0.0.1:{_closed_port()}", "--timeout", "1")
    assert out.returncode == 2 and out.stdout.startswith("cannot tell"), out
    pages.metrics = metrics()
    out = _run("--url", url, "--drain", "5", "--quiet", "0")
    assert out.returncode == 0 and out.stdout.startswith("drained"), out


def test_the_tool_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, vllm_mooncake.tools.ready; "
        "print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('vllm', 'torch', 'yaml')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
