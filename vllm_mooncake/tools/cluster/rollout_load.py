"""A rolling restart under load, measured: what a client and the decodes saw.

:func:`under_load` runs, against a local cluster's router:

- ``vllm bench serve`` (vLLM's own client) in rounds of ``round_prompts``
  requests at ``rate`` per second, one round after another, each round's
  per-request results saved (``--save-detailed``);
- :class:`~vllm_mooncake.tools.cluster.rollout.Traffic`, one request every
  ``probe_interval`` s, which records when each request ended and how;
- a sampler of the decodes' generated tokens per second
  (``vllm:generation_tokens_total``, summed; a restarted decode's counter
  starts again from 0);

first for ``baseline_s`` (the pre-restart level), then while
:func:`~vllm_mooncake.tools.cluster.rollout.rolling` replaces the given
ranks, then for ``tail_s`` more. :class:`LoadRun` holds the record and the
figures read from it (a rollout that raises keeps its finished steps, the
load so far and the error): requests per outcome, the longest request,
and how long after the last router restart the probe's requests were all
served again (the recovery). ``tests/e2e/test_rolling_restart.py`` checks them; run with
``connector="stock"`` in the spec, the same harness measures stock.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_mooncake.tools import vllm_cli
from vllm_mooncake.tools.cluster.client import metric_total, scrape
from vllm_mooncake.tools.cluster.local import Cluster
from vllm_mooncake.tools.cluster.rollout import (
    START_TIMEOUT_S,
    Outcome,
    Say,
    Step,
    Traffic,
    rolling,
)

GENERATED = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
RECOVERY_WINDOW_S = 10.0


@dataclass
class TokenRate:
    """Every second, the decodes' newly generated tokens (summed)."""

    urls: Sequence[str]
    samples: list[tuple[float, float]] = field(default_factory=list)
    _last: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _tick(self) -> None:
        new = 0.0
        for url in self.urls:
            try:
                value = metric_total(scrape(url), GENERATED)
            except OSError:
                continue  # restarting: its tokens count once it is back
            last = self._last.get(url, value)
            new += value - last if value >= last else value  # a restart: from 0
            self._last[url] = value
        self.samples.append((time.monotonic(), new))

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self._tick()

    def start(self) -> None:
        self._tick()
        threading.Thread(target=self._loop, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def rate(self, start: float, end: float) -> float:
        """Mean tokens per second over [start, end)."""
        inside = [n for t, n in self.samples if start <= t < end]
        return sum(inside) / max(end - start, 1e-9)


@dataclass
class BenchRounds:
    """``vllm bench serve`` rounds through the router until :meth:`stop`."""

    cluster: Cluster
    out: Path
    rate: float
    round_prompts: int
    input_len: int = 120
    output_len: int = 8
    results: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def args(self, i: int) -> list[str]:
        c = self.cluster
        return [
            "bench", "serve",
            "--backend", "openai",
            "--base-url", c.router_url,
            "--endpoint", "/v1/completions",
            "--model", c.spec.served_model_name,
            "--tokenizer", c.model,
            "--dataset-name", "random",
            "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len),
            "--num-prompts", str(self.round_prompts),
            "--request-rate", str(self.rate),
            "--seed", str(i),
            "--ignore-eos",
            "--temperature", "0",
            "--disable-tqdm",
            "--save-result", "--save-detailed",
            "--result-dir", str(self.out),
            "--result-filename", f"round-{i}.json",
        ]  # fmt: skip

    def _round(self, i: int) -> None:
        cli = self.args(i)
        log = self.out / f"round-{i}.log"
        with log.open("w") as f:
            f.write("# vllm " + shlex.join(cli) + "\n")
            f.flush()
            proc = subprocess.run(
                vllm_cli.cli_argv(cli), env=vllm_cli.cli_env(), stdout=f, stderr=f,
                check=False,
            )  # fmt: skip
        result = self.out / f"round-{i}.json"
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"vllm bench serve round {i} failed; log {log}")
        self.results.append(json.loads(result.read_text()))

    def _loop(self) -> None:
        i = 0
        while not self._stop.is_set():
            self._round(i)
            i += 1

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Let the round in progress finish (at most ``timeout`` s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def counts(self) -> dict[str, int]:
        sent = len(self.results) * self.round_prompts
        done = sum(int(r["completed"]) for r in self.results)
        failed = sum(int(r.get("failed") or 0) for r in self.results)
        return {
            "rounds": len(self.results),
            "sent": sent,
            "done": done,
            "failed": failed,
        }

    def longest_s(self) -> float:
        """The longest completed request of any round."""
        return max(
            (x for r in self.results for x in r.get("latencies") or []), default=0.0
        )

    def longest_round_overrun_s(self) -> float:
        """How much longer than its arrivals (prompts / rate) a round's
        benchmark (vLLM's ``duration``: first send to last answer, the
        client's start-up excluded) took: bounds every request of it,
        failed ones included."""
        span = self.round_prompts / self.rate
        return max((r["duration"] - span for r in self.results), default=0.0)


@dataclass
class LoadRun:
    """What :func:`under_load` recorded (times from ``time.monotonic()``)."""

    t0: float
    rollout_start: float
    rollout_end: float
    steps: list[Step]
    outcomes: list[Outcome]
    tokens: TokenRate
    bench: BenchRounds
    # Prompt tokens each prefill computed in the tail (after the rollout).
    tail_prefill_tokens: dict[str, float] = field(default_factory=dict)
    # Why the rollout stopped before its last step (None: every step done).
    error: str | None = None

    def baseline_rate(self) -> float:
        return self.tokens.rate(self.t0, self.rollout_start)

    def tail_rate(self) -> float:
        return self.tokens.rate(self.rollout_end + RECOVERY_WINDOW_S, self.end())

    def end(self) -> float:
        return max((o.end for o in self.outcomes), default=self.rollout_end)

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]

    def longest_s(self) -> float:
        return max((o.seconds for o in self.outcomes), default=0.0)

    def recovered_s(self) -> float | None:
        """Seconds from the last router restart until a probe request that
        starts a run of :data:`RECOVERY_WINDOW_S` whose requests all
        succeeded; None if the tail never had one."""
        after = sorted(
            (o for o in self.outcomes if o.start >= self.rollout_end),
            key=lambda o: o.start,
        )
        for i, first in enumerate(after):
            window = [o for o in after[i:] if o.start < first.start + RECOVERY_WINDOW_S]
            if window[-1].start - first.start < RECOVERY_WINDOW_S - 2:
                break  # the tail ends before a whole window
            if not any(o.error for o in window):
                return first.start - self.rollout_end
        return None

    def summary(self) -> dict[str, Any]:
        recovered = self.recovered_s()
        return {
            "probe_sent": len(self.outcomes),
            "probe_failed": len(self.failed()),
            "probe_longest_s": round(self.longest_s(), 1),
            **{f"bench_{k}": v for k, v in self.bench.counts().items()},
            "bench_longest_s": round(self.bench.longest_s(), 1),
            "bench_round_overrun_s": round(self.bench.longest_round_overrun_s(), 1),
            "baseline_tok_s": round(self.baseline_rate(), 2),
            "tail_tok_s": round(self.tail_rate(), 2),
            "recovered_s": None if recovered is None else round(recovered, 1),
            "tail_prefill_tokens": self.tail_prefill_tokens,
            "rollout_s": round(self.rollout_end - self.rollout_start, 1),
            "steps": [s.line() for s in self.steps],
            **({"error": self.error} if self.error else {}),
        }


def under_load(
    cluster: Cluster,
    names: Sequence[str],
    out: Path,
    *,
    prompt: list[int],
    rate: float = 1.0,
    round_prompts: int = 30,
    probe_interval: float = 1.0,
    baseline_s: float = 30.0,
    tail_s: float = 40.0,
    request_timeout: float = 900.0,
    start_timeout: float = START_TIMEOUT_S,
    say: Say = print,
) -> LoadRun:
    """Replace ``names`` in turn under load; see the module docstring."""
    tokens = TokenRate(cluster.decode_urls)
    bench = BenchRounds(cluster, out, rate, round_prompts)
    traffic = Traffic(
        cluster.router_url, prompt, probe_interval, timeout=request_timeout
    )
    t0 = time.monotonic()
    tokens.start()
    bench.start()
    with traffic.running():
        time.sleep(baseline_s)
        rollout_start = time.monotonic()
        steps: list[Step] = []
        error = None
        try:
            steps.extend(rolling(cluster, names, say, start_timeout))
        except Exception as exc:  # the steps done and the load so far are kept
            error = f"{type(exc).__name__}: {exc}"[:500]
            say(f"[load] rollout stopped after {len(steps)} step(s): {error}")
        rollout_end = time.monotonic()
        before = prompt_tokens(cluster.prefill_urls)
        time.sleep(tail_s)
        after = prompt_tokens(cluster.prefill_urls)
    say(f"[load] rollout done; waiting for {traffic.sent()} probe request(s) to end")
    still = traffic.join(request_timeout)
    bench.stop(request_timeout)
    tokens.stop()
    if still:
        say(f"[load] {len(still)} probe request(s) still waiting")
    tail = {url: after[url] - before[url] for url in after}
    return LoadRun(
        t0,
        rollout_start,
        rollout_end,
        steps,
        traffic.outcomes,
        tokens,
        bench,
        tail,
        error,
    )


def prompt_tokens(urls: Sequence[str]) -> dict[str, float]:
    return {url: metric_total(scrape(url), PROMPT_TOKENS) for url in urls}
