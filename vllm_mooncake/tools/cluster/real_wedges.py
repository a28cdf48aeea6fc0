"""Forming the wedges on the real vLLM servers of a store-mode cluster.

The scheduler-level catalogue (:mod:`vllm_mooncake.testing.wedges`) builds
each wedge block by block on vLLM's scheduler with a scripted connector.
Here the same wedges form on real servers from nothing but HTTP requests,
real Mooncake store loads and real P->D transfers, in a cluster started by
:func:`vllm_mooncake.tools.cluster.local.up` with ``store=True``.

W1 (priority scheduling without the full-prompt admission check) on one
decode server whose pool is small (:data:`W1_DECODE_BLOCKS` blocks of 128
tokens):

1. the store learns X's prefix: the prefill server computes it once (a plain
   request) and saves its full blocks (:func:`seed_store`);
2. Y (priority 1, less urgent) arrives at the decode as a P->D request
   (Mooncake-style ``transfer_id``); the decode allocates Y's whole prompt
   and waits for the prefill to push it -- which it cannot do yet, because
   Y's prefill leg is held back;
3. X (priority 0) arrives at the decode with a store hit of part of its
   prompt. Without the full-prompt check only the hit's blocks are needed to
   admit it; its store load runs and completes, and X then needs the rest of
   its prompt's blocks, which are not free. X waits, holding its blocks;
4. Y's prefill leg is sent; the prefill pushes Y's KV and Y's receive
   completes.

Now both hold blocks and neither runs. vLLM's admission loop takes X first
(priority), X fails to allocate, the loop breaks, and Y -- which needs no
block to run -- is never reached. Stock stays like this: nothing generated,
``/health`` 200, until the clients give up. The guard preempts Y
laterally (Y recomputes later), X runs, then Y.

The seed (vLLM 0.19-0.22, which have no async-load reservation; vLLM's
default scheduler config), on a decode pool of :data:`SEED_DECODE_BLOCKS`:

1. the store learns A's prefix (4 blocks), as for W1;
2. A (700 tokens: 4 blocks hit, 2 more to compute) and B's decode leg (a
   P->D request of 4 blocks) arrive at the decode back to back, before A's
   store load completes: both are admitted -- A's whole prompt fit the free
   pool when A came -- and together they hold all 8 blocks;
3. A's load completes: A needs its 2 other blocks, none are free, and the
   admission loop breaks on it; B's prefill leg is sent and B's receive
   completes. B needs no block to run but sits behind A.

Whether B arrives before A's load ends would be a race on a real server (the
load takes milliseconds): :func:`form_seed` freezes the store's segment owner
while both are admitted, so A's load ends only after B holds its blocks.

The head-of-line wedge is not formed here: on stock servers over [store,
P->D] the store's deferred lookup defers the holder as well, so the layout
never arises (docs/real-releases.md).

W2 (``kv_load_failure_policy=recompute`` and a store load that fails
entirely), same pool: the store learns A's prefix, then loses it -- its
segment owner stops, while mooncake_master still lists the keys until its
``client_ttl`` -- so A's store hit is offered and every load of it fails. B
waits on a P->D receive; A arrives, its load fails, vLLM frees A's blocks
but keeps A's reservation, and A's re-admission then waits for its own
reserved blocks; B's KV arrives and B waits behind A. The guard cuts A's
retries after ``max_failed_loads`` and prefills it locally.

:func:`form_w1` / :func:`form_w2` drive one decode through this and report
what the decode did (:class:`WedgeRun`); the end-to-end tests and ``python
-m vllm_mooncake.tools.cluster.real_wedges`` judge it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from vllm_mooncake.tools.cluster.client import (
    Completion,
    Sample,
    complete,
    metric_total,
    mooncake_legs,
    scrape,
    scrape_url,
)
from vllm_mooncake.tools.cluster.procs import http_ok

# --num-gpu-blocks-override for the decodes that form W1: 5 usable blocks of
# 128 tokens (vLLM keeps one as its null block).
W1_DECODE_BLOCKS = 6
# What every W1 decode server runs with besides the cluster defaults.
W1_SERVER_ARGS = ("--scheduling-policy", "priority", "--no-scheduler-reserve-full-isl")
MAX_TOKENS = 16

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATED = "vllm:generation_tokens_total"
FETCH_STAGE = "vllm:num_requests_kv_fetch_by_stage"
# mooncake_master's counters of completed puts (single and batched)
STORE_PUTS_DONE = ("master_put_end_requests_total", "master_batch_put_end_items_total")


def token_prompt(n: int, seed: int) -> list[int]:
    """A deterministic prompt of exactly ``n`` token ids, BOS first."""
    return [1] + [3 + (seed * 131 + i * 37) % 420 for i in range(n - 1)]


@dataclass(frozen=True)
class W1Prompts:
    """X: 480 tokens (4 blocks) whose first 300 the store knows (2 full
    blocks saved); Y: 300 tokens (3 blocks) over P->D. With 5 usable blocks:
    Y takes 3, X's hit 2, and X's remaining 2 never fit."""

    urgent: list[int]  # X
    holder: list[int]  # Y
    seed: list[int]  # X's prefix, computed by the prefill and saved

    @classmethod
    def make(cls, seed: int) -> W1Prompts:
        urgent = token_prompt(480, 1000 + seed)
        return cls(urgent, token_prompt(300, 2000 + seed), urgent[:300])


@dataclass(frozen=True)
class W2Prompts:
    """A: 480 tokens whose first 300 the store knew before it lost them; B:
    300 tokens over P->D."""

    failing: list[int]  # A
    holder: list[int]  # B
    seed: list[int]  # A's prefix, saved before the store loses it

    @classmethod
    def make(cls, seed: int) -> W2Prompts:
        failing = token_prompt(480, 3000 + seed)
        return cls(failing, token_prompt(300, 4000 + seed), failing[:300])


# --num-gpu-blocks-override for the decodes that form the seed: 8 usable
# blocks of 128 tokens (vLLM keeps one as its null block), and the
# max-model-len A's 700-token prompt needs.
SEED_DECODE_BLOCKS = 9
SEED_MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class SeedPrompts:
    """A: 700 tokens (6 blocks) whose first 512 (4 full blocks) the store
    knows; B: 500 tokens (4 blocks) over P->D. With 8 usable blocks A's
    hit and B fill the pool, and A's remaining 2 blocks never fit."""

    head: list[int]  # A
    holder: list[int]  # B
    seed: list[int]  # A's prefix, computed by the prefill and saved

    @classmethod
    def make(cls, seed: int) -> SeedPrompts:
        head = token_prompt(700, 5000 + seed)
        return cls(head, token_prompt(500, 6000 + seed), head[:512])


class Background:
    """One completion request in a thread; ``result`` or ``error`` when done."""

    def __init__(self, call: Callable[[], Completion]) -> None:
        self.result: Completion | None = None
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], Completion]) -> None:
        try:
            self.result = call()
        except BaseException as exc:  # reported, not raised, in this thread
            self.error = exc
        self.finished_at = time.monotonic()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()


def wait_for(
    what: str, check: Callable[[], bool], timeout: float, poll: float = 0.2
) -> float:
    """Poll ``check`` until true; return the seconds taken, raise on timeout."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"not reached in {timeout:.0f} s: {what}")
        time.sleep(poll)
    return time.monotonic() - t0


def seed_store(prefill_url: str, prompt: list[int], store_metrics_url: str) -> None:
    """Have the prefill compute ``prompt`` and wait until the store has
    finished a put since (its full blocks, saved asynchronously): the
    master's count of completed put items grows."""
    before = _puts_done(store_metrics_url)
    complete(prefill_url, prompt, 1)
    wait_for(
        "the prefill's store save",
        lambda: _puts_done(store_metrics_url) > before,
        timeout=30,
    )


def _puts_done(store_metrics_url: str) -> float:
    samples = scrape_url(store_metrics_url)
    return sum(metric_total(samples, name) for name in STORE_PUTS_DONE)


@dataclass
class DecodeState:
    """One scrape of a decode server's scheduler gauges and token counter."""

    running: float
    waiting: float
    completed_waiting: float
    generated: float
    healthy: bool
    samples: list[Sample] = field(repr=False)

    @classmethod
    def of(cls, url: str) -> DecodeState:
        s = scrape(url)
        return cls(
            running=metric_total(s, RUNNING),
            waiting=metric_total(s, WAITING),
            completed_waiting=metric_total(s, FETCH_STAGE, stage="completed_waiting"),
            generated=metric_total(s, GENERATED),
            healthy=http_ok(f"{url}/health"),
            samples=s,
        )


@dataclass
class WedgeRun:
    """What one decode did with a wedge's requests."""

    decode_url: str
    urgent: Background  # X (W1) or A (W2)
    holder: Background  # Y (W1) or B (W2): waits on a P->D receive
    urgent_prompt: list[int]
    holder_prompt: list[int]
    prefill_leg: Background
    formed: DecodeState  # right after the last load completed
    settled: DecodeState  # after ``hold_s`` (or once both finished)
    seconds: float  # from the last load's completion to ``settled``
    before: list[Sample] = field(repr=False)

    @property
    def finished(self) -> bool:
        return all(b.done and b.result is not None for b in (self.urgent, self.holder))

    def delta(self, name: str, **labels: str) -> float:
        return metric_total(self.settled.samples, name, **labels) - metric_total(
            self.before, name, **labels
        )


def form_w1(
    prefill_url: str,
    decode_url: str,
    bootstrap_url: str,
    store_metrics_url: str,
    prompts: W1Prompts,
    hold_s: float,
    request_timeout: float,
) -> WedgeRun:
    """Drive ``decode_url`` into W1 (module docstring) and watch it.

    Returns once both requests finished, or after ``hold_s`` seconds of
    watching from the moment both loads completed. Requests still open then
    end when ``request_timeout`` (seconds, from their start) runs out: the
    client closes the connection and vLLM aborts them.
    """
    seed_store(prefill_url, prompts.seed, store_metrics_url)

    def urgent_load_done(urgent: Background) -> None:
        wait_for(
            "X's store load completes and X waits for blocks",
            lambda: _loaded_and_blocked(decode_url, urgent),
            timeout=30,
        )

    legs = PDLegs(prefill_url, decode_url, bootstrap_url, request_timeout)
    return legs.run(prompts.urgent, prompts.holder, urgent_load_done, hold_s)


def form_w2(
    prefill_url: str,
    decode_url: str,
    bootstrap_url: str,
    prompts: W2Prompts,
    hold_s: float,
    request_timeout: float,
    failing_for: float = 2.0,
) -> WedgeRun:
    """Drive ``decode_url`` into W2 (module docstring) and watch it.

    The store must already have lost ``prompts.failing``'s blocks (its
    prefix seeded, then the segment owner stopped: :func:`seed_store`,
    :func:`vllm_mooncake.tools.cluster.local.stop_store_segment`). B waits
    for its P->D receive, A arrives and its store load fails; after
    ``failing_for`` seconds B's prefill leg is sent.
    """
    legs = PDLegs(prefill_url, decode_url, bootstrap_url, request_timeout)
    return legs.run(
        prompts.failing, prompts.holder, lambda _: time.sleep(failing_for), hold_s
    )


def form_seed(
    prefill_url: str,
    decode_url: str,
    bootstrap_url: str,
    store_metrics_url: str,
    prompts: SeedPrompts,
    hold_s: float,
    request_timeout: float,
    hold_store_loads: Callable[[], AbstractContextManager[object]],
    load_s: float = 1.0,
) -> WedgeRun:
    """Drive ``decode_url`` into the seed (module docstring) and watch it.

    On a real server A's store load takes milliseconds, so B would rarely be
    admitted before it ends. ``hold_store_loads`` makes the order certain: it
    freezes the store's segment owner
    (:func:`vllm_mooncake.tools.cluster.local.paused_store_segment`) while A
    is admitted and starts its load, and B's decode leg is admitted next to
    it. Once the store runs again A's load completes; ``load_s`` later B's
    prefill leg is sent, so B's receive completes after A's load.
    """
    seed_store(prefill_url, prompts.seed, store_metrics_url)
    legs = PDLegs(prefill_url, decode_url, bootstrap_url, request_timeout)
    before = scrape(decode_url)
    waiting0 = metric_total(before, WAITING)
    prefill_params, decode_params = mooncake_legs(bootstrap_url)
    with hold_store_loads():
        head = legs.send(decode_url, prompts.head, MAX_TOKENS, 0, None)
        _wait_waiting(decode_url, waiting0 + 1, "A waits for its store load")
        holder = legs.send(decode_url, prompts.holder, MAX_TOKENS, 0, decode_params)
        _wait_waiting(decode_url, waiting0 + 2, "B waits for its P->D receive")
    time.sleep(load_s)
    prefill_leg = legs.send(prefill_url, prompts.holder, 1, 0, prefill_params)
    return _watch(
        decode_url,
        (head, prompts.head),
        (holder, prompts.holder),
        prefill_leg,
        before,
        hold_s,
    )


def _wait_waiting(decode_url: str, n: float, what: str) -> None:
    wait_for(what, lambda: DecodeState.of(decode_url).waiting >= n, timeout=30)


@dataclass(frozen=True)
class PDLegs:
    """The choreography both wedges share on one decode.

    The holder's decode leg goes first (a P->D receive the decode waits on),
    then the other request, then -- once ``between`` returns -- the holder's
    prefill leg, which lets the prefill push the holder's KV.
    """

    prefill_url: str
    decode_url: str
    bootstrap_url: str
    request_timeout: float

    def run(
        self,
        first: list[int],
        holder_prompt: list[int],
        between: Callable[[Background], None],
        hold_s: float,
    ) -> WedgeRun:
        before = scrape(self.decode_url)
        waiting0 = metric_total(before, WAITING)
        prefill_params, decode_params = mooncake_legs(self.bootstrap_url)
        holder = self.send(self.decode_url, holder_prompt, MAX_TOKENS, 1, decode_params)
        wait_for(
            "the holder waits for its P->D receive",
            lambda: DecodeState.of(self.decode_url).waiting >= waiting0 + 1,
            timeout=30,
        )
        urgent = self.send(self.decode_url, first, MAX_TOKENS, 0, None)
        between(urgent)
        prefill_leg = self.send(self.prefill_url, holder_prompt, 1, 0, prefill_params)
        return _watch(
            self.decode_url,
            (urgent, first),
            (holder, holder_prompt),
            prefill_leg,
            before,
            hold_s,
        )

    def send(
        self,
        url: str,
        prompt: list[int],
        max_tokens: int,
        priority: int,
        params: dict[str, Any] | None,
    ) -> Background:
        """One completion to ``url`` in the background (``params``: a PD
        leg's ``kv_transfer_params``)."""
        extra: dict[str, Any] = {"priority": priority}
        if params is not None:
            extra["kv_transfer_params"] = params
        return Background(
            lambda: complete(
                url, prompt, max_tokens, timeout=self.request_timeout, **extra
            )
        )


def _loaded_and_blocked(decode_url: str, urgent: Background) -> bool:
    if urgent.done:  # nothing to wait for: X ran (the pool was larger)
        return True
    samples = scrape(decode_url)
    if not any(x.name == FETCH_STAGE for x in samples):
        # Before 0.32 vLLM exports no KV-fetch stages: a store load of a few
        # blocks takes milliseconds, so a second is plenty.
        time.sleep(1.0)
        return True
    return metric_total(samples, FETCH_STAGE, stage="completed_waiting") >= 1


def _watch(
    decode_url: str,
    urgent_call: tuple[Background, list[int]],
    holder_call: tuple[Background, list[int]],
    prefill_leg: Background,
    before: list[Sample],
    hold_s: float,
) -> WedgeRun:
    (urgent, urgent_prompt), (holder, holder_prompt) = urgent_call, holder_call
    prefill_leg.join(60)  # Y's KV has been pushed once the prefill returns
    t0 = time.monotonic()
    formed = DecodeState.of(decode_url)
    deadline = t0 + hold_s
    while time.monotonic() < deadline and not (urgent.done and holder.done):
        time.sleep(0.2)
    settled = DecodeState.of(decode_url)
    return WedgeRun(
        decode_url,
        urgent,
        holder,
        urgent_prompt,
        holder_prompt,
        prefill_leg,
        formed,
        settled,
        time.monotonic() - t0,
        before,
    )


def wait_idle(decode_url: str, timeout: float) -> None:
    """Wait until the decode has nothing running or waiting."""
    wait_for(
        f"{decode_url} idle",
        lambda: (s := DecodeState.of(decode_url)).running == 0 and s.waiting == 0,
        timeout=timeout,
    )


# ---- CLI -------------------------------------------------------------------------
SHOWN_COUNTERS = (
    "vllm:kv_guard_lateral_preemptions_total",
    "vllm:kv_guard_load_retry_cutoffs_total",
    "vllm:kv_guard_wedges_detected_total",
)


def report(run: WedgeRun) -> list[str]:
    """What the decode did, for people: its gauges and the guard's counters."""
    lines = [
        f"decode {run.decode_url}: "
        + ("both requests finished" if run.finished else "requests still waiting")
        + f" {run.seconds:.1f} s after the last load",
        f"  formed:  {_gauges(run.formed)}",
        f"  settled: {_gauges(run.settled)}",
    ]
    for name in SHOWN_COUNTERS:
        if any(x.name == name for x in run.settled.samples):
            lines.append(f"  {name} +{run.delta(name):g}")
    return lines


def _gauges(state: DecodeState) -> str:
    return (
        f"running={state.running:g} waiting={state.waiting:g} "
        f"completed_waiting={state.completed_waiting:g} "
        f"generation_tokens_total={state.generated:g} "
        f"/health={'200' if state.healthy else 'down'}"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_mooncake.tools.cluster.real_wedges w1 --run R --decode J``:
    form W1 on decode J of a running store-mode cluster and print what
    happened (``w2`` stops the store's segment owner first)."""
    import argparse

    from vllm_mooncake.tools.cluster.local import (
        DEFAULT_RUN,
        attach,
        stop_store_segment,
    )

    ap = argparse.ArgumentParser(
        prog="python -m vllm_mooncake.tools.cluster.real_wedges"
    )
    ap.add_argument("wedge", choices=("w1", "w2"))
    ap.add_argument("--run", default=DEFAULT_RUN)
    ap.add_argument(
        "--decode", default="0", help="decode index, or several: 0,1,2 (in turn)"
    )
    ap.add_argument("--hold", type=float, default=15.0, help="seconds to watch")
    ap.add_argument("--seed", type=int, default=0, help="picks fresh prompts")
    args = ap.parse_args(argv)
    cluster = attach(args.run)
    if not cluster.spec.store:
        raise SystemExit(f"run {args.run!r} is not in store mode (up --store)")
    p, boot = cluster.prefill_urls[0], cluster.bootstrap_urls[0]
    metrics = f"http://127.0.0.1:{cluster.spec.ports.store_master_metrics}/metrics"
    decodes = [int(j) for j in args.decode.split(",")]
    timeout = args.hold + 20
    if args.wedge == "w2":  # every prefix stored, then the store loses them all
        w2 = {j: W2Prompts.make(args.seed + j) for j in decodes}
        for prompts in w2.values():
            seed_store(p, prompts.seed, metrics)
        stop_store_segment(cluster)
    for j in decodes:
        d = cluster.decode_urls[j]
        if args.wedge == "w1":
            prompts1 = W1Prompts.make(args.seed + j)
            run = form_w1(p, d, boot, metrics, prompts1, args.hold, timeout)
        else:
            run = form_w2(p, d, boot, w2[j], args.hold, timeout)
        print("\n".join(report(run)), flush=True)
    return 0


__all__ = [
    "MAX_TOKENS",
    "PDLegs",
    "SEED_DECODE_BLOCKS",
    "SEED_MAX_MODEL_LEN",
    "SeedPrompts",
    "W1_DECODE_BLOCKS",
    "W1_SERVER_ARGS",
    "Background",
    "DecodeState",
    "W1Prompts",
    "W2Prompts",
    "WedgeRun",
    "form_seed",
    "form_w1",
    "form_w2",
    "main",
    "report",
    "seed_store",
    "token_prompt",
    "wait_for",
    "wait_idle",
]


if __name__ == "__main__":
    raise SystemExit(main())
