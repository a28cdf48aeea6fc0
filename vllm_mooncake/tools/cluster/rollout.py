"""Rolling restarts of a local PD cluster, one rank at a time, under load.

::

    python -m vllm_mooncake.tools.cluster.rollout --run local      # every rank
    python -m vllm_mooncake.tools.cluster.rollout --run local prefill-0 decode-1

A **prefill** is replaced as a crash replaces it (:func:`roll_prefill`):

1. its process group is SIGKILLed: the decodes' receives from it lose their
   sender mid-request, and the prefill's own requests fail;
2. it is taken out of the router (``DELETE /workers/<url>``), as a failing
   readiness probe takes a pod out of a k8s Service, so no new request is
   sent to a dead prefill while its replacement starts;
3. it is started again with the same command and waits for ``/health``;
   it registers a new Mooncake engine id on its bootstrap server;
4. the router is restarted. vllm-router 0.1.17 reads each prefill's engine
   id from the bootstrap once, at its own start, and keeps sending the old
   one (the decode then fails the request: "remote engine_id ... not
   found"); and its PD mode has no HTTP call that adds a worker back
   (``POST /workers`` answers 400 "PD router requires specific
   add_prefill_server or add_decode_server methods"). A new router reads
   every prefill's current engine id.

A **decode** is replaced as a planned rollout replaces it
(:func:`roll_decode`): taken out of the router first, drained (no running
and no waiting request, read from its ``/metrics``), stopped (SIGTERM),
started again, and the router restarted to route to it again.

The router restart is a gap (8-36 s measured on 2 shared cores): its
graceful shutdown refuses new connections while the requests it carries
finish, then the new router starts (:func:`restart_router`).
:class:`Traffic` is a client that sends one request at a fixed interval
through the router and records when each ended and how, so a caller can
check that none hung.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from vllm_mooncake.tools.cluster import layout
from vllm_mooncake.tools.cluster.client import complete, metric_total, scrape
from vllm_mooncake.tools.cluster.local import Cluster, attach, base_env, start_rank
from vllm_mooncake.tools.cluster.procs import Run, StartupError

ROUTER = "router"
# How long a replaced rank may take to answer /health again: the launcher's
# start-up bound. A loaded 2-core host has taken 2-10 minutes.
START_TIMEOUT_S = 600.0
Say = Callable[[str], None]


@dataclass
class Step:
    """One rank's replacement, in seconds from the step's start."""

    rank: str
    kind: str  # "crash" (prefill) or "drain" (decode)
    started: float  # time.monotonic() at the step's start
    drained_s: float = 0.0
    healthy_s: float = 0.0  # the rank answers /health again
    routed_s: float = 0.0  # the new router answers /health

    def line(self) -> str:
        drain = f"drained in {self.drained_s:.1f} s, " if self.kind == "drain" else ""
        return (
            f"{self.rank} ({self.kind}): {drain}healthy after {self.healthy_s:.1f} s, "
            f"routed after {self.routed_s:.1f} s"
        )


# ---- the router -------------------------------------------------------------------
def unroute(cluster: Cluster, url: str) -> None:
    """Take ``url`` out of the router: no new request goes to it."""
    quoted = urllib.parse.quote(url, safe="")
    req = urllib.request.Request(
        f"{cluster.router_url}/workers/{quoted}", method="DELETE"
    )
    with urllib.request.urlopen(req, timeout=10):
        pass


def restart_router(cluster: Cluster, timeout: float = 120.0) -> float:
    """Stop the router (SIGTERM: its graceful shutdown) and start it again
    with every rank of the spec; return the seconds until it is healthy."""
    state = Run(cluster.run_dir)
    t0 = time.monotonic()
    state.stop_one(ROUTER)
    env = base_env()
    proc = state.start(
        ROUTER,
        layout.router_argv(cluster.spec, cluster.ranks),
        {**env, "RUST_LOG": env.get("RUST_LOG", "info")},
        f"{cluster.router_url}/health",
    )
    state.wait_healthy([proc], timeout=timeout)
    return time.monotonic() - t0


# ---- one rank ---------------------------------------------------------------------
def kill_rank(cluster: Cluster, name: str, timeout: float = 30.0) -> int:
    """SIGKILL every process of rank ``name`` (a crash); return how many."""
    state = Run(cluster.run_dir)
    proc = [p for p in state.procs if p.name == name][-1]
    members = proc.members()
    state.stop_one(name, timeout, sig=signal.SIGKILL)
    if proc.members():
        raise StartupError(f"{name}: processes {proc.members()} outlived SIGKILL")
    return len(members)


def in_flight(url: str) -> float:
    """Running plus waiting requests of the server at ``url``."""
    samples = scrape(url)
    return metric_total(samples, "vllm:num_requests_running") + metric_total(
        samples, "vllm:num_requests_waiting"
    )


def drain(url: str, timeout: float, quiet_s: float = 3.0, poll: float = 0.5) -> float:
    """Wait until the server at ``url`` has had no request for ``quiet_s``
    (a request the router sent just before the decode left it may not have
    arrived yet); return the seconds taken."""
    t0 = time.monotonic()
    quiet_since = None
    while True:
        now = time.monotonic()
        if in_flight(url) > 0:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= quiet_s:
            return now - t0
        if now - t0 > timeout:
            raise TimeoutError(f"{url}: requests still in flight after {timeout:.0f} s")
        time.sleep(poll)


def _rank(cluster: Cluster, name: str) -> layout.Rank:
    return next(r for r in cluster.ranks if r.name == name)


def _start_and_route(
    cluster: Cluster, step: Step, say: Say, start_timeout: float
) -> Step:
    """The end of both steps: start the rank again, then a new router."""
    start_rank(cluster, step.rank, timeout=start_timeout)
    step.healthy_s = time.monotonic() - step.started
    say(f"[rollout] {step.rank}: healthy again after {step.healthy_s:.1f} s")
    restart_router(cluster)
    step.routed_s = time.monotonic() - step.started
    say(f"[rollout] router restarted; {step.rank} routed after {step.routed_s:.1f} s")
    return step


def roll_prefill(
    cluster: Cluster,
    name: str,
    say: Say = print,
    start_timeout: float = START_TIMEOUT_S,
) -> Step:
    """Crash prefill ``name`` and replace it (the module's prefill steps)."""
    rank = _rank(cluster, name)
    step = Step(name, "crash", time.monotonic())
    n = kill_rank(cluster, name)
    say(f"[rollout] {name}: SIGKILL to {n} process(es)")
    unroute(cluster, rank.url)
    return _start_and_route(cluster, step, say, start_timeout)


def roll_decode(
    cluster: Cluster,
    name: str,
    say: Say = print,
    start_timeout: float = START_TIMEOUT_S,
    drain_timeout: float = 600.0,
) -> Step:
    """Drain decode ``name``, stop it and replace it (the module's decode steps)."""
    rank = _rank(cluster, name)
    step = Step(name, "drain", time.monotonic())
    unroute(cluster, rank.url)
    step.drained_s = drain(rank.url, drain_timeout)
    say(f"[rollout] {name}: out of the router, drained in {step.drained_s:.1f} s")
    Run(cluster.run_dir).stop_one(name)
    return _start_and_route(cluster, step, say, start_timeout)


def rolling(
    cluster: Cluster,
    names: Sequence[str],
    say: Say = print,
    start_timeout: float = START_TIMEOUT_S,
) -> Iterator[Step]:
    """Replace ranks ``names`` in turn (prefills crashed, decodes drained),
    yielding each step once it is done: a caller that collects them keeps
    the finished steps when a later one raises."""
    for name in names:
        role = _rank(cluster, name).role
        step = roll_prefill if role == "prefill" else roll_decode
        yield step(cluster, name, say, start_timeout)


def every_rank(cluster: Cluster) -> list[str]:
    """Every prefill, then every decode: the order of a fleet rollout."""
    prefills = [r.name for r in cluster.ranks if r.role == "prefill"]
    return prefills + [r.name for r in cluster.ranks if r.role == "decode"]


# ---- what a client sees -----------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """One request of :class:`Traffic`: when it started and ended, and how."""

    start: float  # time.monotonic()
    end: float
    error: str  # "" when the completion came back

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Traffic:
    """A client sending one request every ``interval`` s through the router,
    each on its own thread, until :meth:`stop`; records every outcome."""

    url: str
    prompt: list[int]
    interval: float = 1.0
    max_tokens: int = 8
    timeout: float = 900.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _one(self, i: int) -> None:
        start = time.monotonic()
        error = ""
        # A different last token per request: no two share a whole prompt.
        prompt = [*self.prompt[:-1], 3 + i % 400]
        try:
            complete(self.url, prompt, self.max_tokens, timeout=self.timeout)
        except Exception as exc:  # what the client sees: HTTP error, refused
            error = f"{type(exc).__name__}: {exc}"[:300]
        self.outcomes.append(Outcome(start, time.monotonic(), error))

    def _loop(self) -> None:
        i = 0
        while not self._stop.wait(self.interval if i else 0):
            t = threading.Thread(target=self._one, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
            i += 1

    @contextlib.contextmanager
    def running(self) -> Iterator[Traffic]:
        loop = threading.Thread(target=self._loop, daemon=True)
        loop.start()
        try:
            yield self
        finally:
            self._stop.set()
            loop.join()

    def join(self, timeout: float) -> list[threading.Thread]:
        """Wait for every request sent; return the threads still waiting."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t for t in self._threads if t.is_alive()]

    def sent(self) -> int:
        return len(self._threads)


# ---- command line -----------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vllm_mooncake.tools.cluster.rollout",
        description="Replace a local cluster's ranks one at a time: each "
        "prefill crashed (SIGKILL) and restarted, each decode drained and "
        "restarted, the router restarted after each.",
    )
    p.add_argument("--run", default="local", help="the cluster's run name")
    p.add_argument("ranks", nargs="*", help="rank names (default: every rank)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cluster = attach(args.run)
    names = args.ranks or every_rank(cluster)
    unknown = sorted(set(names) - {r.name for r in cluster.ranks})
    if unknown:
        known = ", ".join(r.name for r in cluster.ranks)
        print(f"unknown rank(s) {unknown}; run {args.run!r} has {known}")
        return 2
    try:
        steps = list(rolling(cluster, names))
    except (StartupError, TimeoutError, urllib.error.URLError) as exc:
        print(f"[rollout] failed: {exc}", file=sys.stderr)
        return 1
    for s in steps:
        print(f"[rollout] {s.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
