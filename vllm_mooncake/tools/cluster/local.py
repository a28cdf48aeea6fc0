"""A 1P2D (or 2P2D) vLLM cluster on 127.0.0.1 running the wedge guard.

::

    python -m vllm_mooncake.tools.cluster.local up [--shape 1p2d|2p2d|1p1d] [...]
    python -m vllm_mooncake.tools.cluster.local status
    python -m vllm_mooncake.tools.cluster.local down

``up`` starts, in order, and waits for each to be healthy:

0. in store mode (``--store``), the Mooncake store: ``mooncake_master`` and
   its segment owner ``mooncake_client`` (:func:`start_store`);
1. one Mooncake bootstrap server per prefill rank, on 127.0.0.1
   (:mod:`~vllm_mooncake.tools.cluster.mooncake_bootstrap`);
2. the prefill and decode vLLM servers, in parallel, each with
   ``WedgeGuardConnector`` over [MooncakeConnector, NixlConnector]
   (:func:`~vllm_mooncake.tools.cluster.layout.kv_transfer_config`), pinned to
   their CPUs;
3. the router (``vllm-router --vllm-pd-disaggregation``);

then sends one request through the router. Logs go to
``<cache>/deploy/<run>/logs/<name>.log``; ``state.json`` next to them records
what was started, and ``down`` stops exactly that
(:mod:`~vllm_mooncake.tools.cluster.procs`). A failed ``up`` stops what it started.

The model is ``--model`` / ``$MODEL``, else the generated tiny Llama. On a
host without accelerator the CPU settings apply (float32, eager, 1 GiB KV
cache per rank, OpenMP pinning, Mooncake over TCP); with GPUs each rank gets
one GPU (``CUDA_VISIBLE_DEVICES``) and Mooncake uses RDMA.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from vllm_mooncake.offline import cache_dir, prepare_offline_env
from vllm_mooncake.tools.cluster import layout
from vllm_mooncake.tools.cluster.layout import HOST, ClusterSpec, Rank
from vllm_mooncake.tools.cluster.procs import (
    Proc,
    Run,
    StartupError,
    port_in_use,
    tail,
)

T = TypeVar("T")  # what a reference server's caller asks it for

DEFAULT_RUN = "local"
BASE_PORT_ENV = "VLLM_MOONCAKE_BASE_PORT"


def run_dir(run: str = DEFAULT_RUN) -> Path:
    return cache_dir() / "deploy" / run


@dataclass(frozen=True)
class Cluster:
    """What ``up`` started: URLs for clients and the run to stop."""

    spec: ClusterSpec
    ranks: tuple[Rank, ...]
    run_dir: Path
    model: str
    cpu: bool
    timings: dict[str, float]

    @property
    def router_url(self) -> str:
        return f"http://{HOST}:{self.spec.ports.router}"

    @property
    def prefill_urls(self) -> list[str]:
        return [r.url for r in self.ranks if r.role == "prefill"]

    @property
    def decode_urls(self) -> list[str]:
        return [r.url for r in self.ranks if r.role == "decode"]

    @property
    def bootstrap_urls(self) -> list[str]:
        return [
            f"http://{HOST}:{r.bootstrap_port}"
            for r in self.ranks
            if r.bootstrap_port is not None
        ]

    def log(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def stop(self, timeout: float = 30.0) -> list[str]:
        return Run(self.run_dir).stop(timeout)


def resolve_model(spec: ClusterSpec) -> str:
    if spec.model:
        return spec.model
    from vllm_mooncake.tools.cluster.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


def host_is_cpu(spec: ClusterSpec) -> bool:
    if spec.cpu is not None:
        return spec.cpu
    from vllm_mooncake.compat.cpu import has_accelerator

    return not has_accelerator()


STORE_CONFIG_FILE = "mooncake_store.json"
STORE_MASTER = "store-master"
STORE_SEGMENT = "store-segment"
STORE_METRIC_CAPACITY = "master_total_capacity_bytes"


def all_ports(spec: ClusterSpec) -> list[int]:
    ports = spec.ports
    out = [ports.router, ports.router_metrics]
    if spec.store:
        out += [
            ports.store_master,
            ports.store_metadata,
            ports.store_master_metrics,
            ports.store_segment,
        ]
    for i in range(spec.num_prefill):
        out += [ports.prefill(i), ports.bootstrap(i), ports.nixl_prefill(i)]
    for j in range(spec.num_decode):
        out += [ports.decode(j), ports.nixl_decode(j)]
    return out


def free_base_port(spec: ClusterSpec, first: int = 18600, last: int = 30000) -> int:
    """The first base port from ``first`` (in steps of 1000) where every port
    of ``spec``'s cluster and its reference server is free."""
    from dataclasses import replace

    for base in range(first, last, 1000):
        moved = replace(spec, base_port=base)
        if not any(port_in_use(p) for p in [*all_ports(moved), moved.ports.reference]):
            return base
    raise StartupError(f"no free port range for a cluster in {first}..{last}")


def base_env() -> dict[str, str]:
    """The caller's environment, offline, minus our own ``VLLM_MOONCAKE_*``
    settings (vLLM warns about every unknown ``VLLM_`` variable)."""
    prepare_offline_env()
    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MOONCAKE_")}


def up(
    spec: ClusterSpec,
    run: str = DEFAULT_RUN,
    timeout: float = 600.0,
    say: Any = print,
) -> Cluster:
    """Start the cluster; on any failure stop what was started and raise."""
    rd = run_dir(run)
    state = Run(rd)
    if state.live():
        raise StartupError(
            f"run {run!r} is already up ({rd / 'state.json'}); stop it first: "
            f"python -m vllm_mooncake.tools.cluster.local down --run {run}"
        )
    busy = [p for p in all_ports(spec) if port_in_use(p, HOST)]
    if busy:
        raise StartupError(
            f"port(s) {busy} on {HOST} are in use; pick another --base-port "
            f"(now {spec.base_port}) or stop what holds them"
        )
    _clear_logs(rd)
    state = Run(rd)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    try:
        model = resolve_model(spec)
        cpu = host_is_cpu(spec)
        timings["model"] = time.monotonic() - t0
        cpus = sorted(os.sched_getaffinity(0)) if cpu else None
        rank_list = layout.ranks(spec, cpus)
        env = base_env()
        state.info = {
            "spec": {k: v for k, v in asdict(spec).items() if k != "python"},
            "model": model,
            "cpu": cpu,
            "router_url": f"http://{HOST}:{spec.ports.router}",
            "ranks": [asdict(r) for r in rank_list],
        }
        state.save()

        say(f"[up] run dir {rd}; model {model}; {'CPU' if cpu else 'GPU'} host")
        store_path = None
        if spec.store:
            store_path = start_store(state, spec, cpu, env)
            timings["store"] = time.monotonic() - t0 - timings["model"]
            say(f"[up] Mooncake store ready ({store_path})")
        boots = [
            state.start(
                f"bootstrap-{r.index}",
                layout.bootstrap_argv(spec, r.bootstrap_port),
                env,
                f"http://{HOST}:{r.bootstrap_port}/query",
            )
            for r in rank_list
            if r.bootstrap_port is not None and spec.external_bootstrap
        ]
        # The servers start at once, beside the bootstrap servers: a server
        # needs its bootstrap only when its Mooncake worker registers, a
        # minute into its start, and vLLM retries that registration.
        servers_started = time.monotonic()
        servers = []
        for r in rank_list:
            renv = rank_env(spec, r, cpu, env, store_path)
            pin = f" on CPUs {r.cpus}" if r.cpus else ""
            say(f"[up] starting {r.name} at {r.url}{pin}")
            servers.append(
                state.start(
                    r.name,
                    layout.server_argv(spec, r, model, cpu),
                    renv,
                    f"{r.url}/health",
                )
            )
        timings["bootstrap"] = state.wait_healthy(boots, timeout=120)
        say(f"[up] Mooncake bootstrap server(s) ready in {timings['bootstrap']:.1f} s")
        state.wait_healthy(servers, timeout=timeout, poll=2.0)
        timings["servers"] = time.monotonic() - servers_started
        say(f"[up] {len(servers)} vLLM servers healthy in {timings['servers']:.1f} s")

        router_url = f"http://{HOST}:{spec.ports.router}"
        router = state.start(
            "router",
            layout.router_argv(spec, rank_list),
            {**env, "RUST_LOG": env.get("RUST_LOG", "info")},
            f"{router_url}/health",
        )
        timings["router"] = state.wait_healthy([router], timeout=120)
        say(f"[up] vllm-router ready at {router_url} in {timings['router']:.1f} s")
    except BaseException:
        say("[up] failed; stopping what was started")
        for line in state.stop():
            say(f"[down] {line}")
        raise
    timings["total"] = time.monotonic() - t0
    state.info["timings"] = timings
    state.save()
    return Cluster(spec, tuple(rank_list), rd, model, cpu, timings)


def rank_env(
    spec: ClusterSpec,
    rank: Rank,
    cpu: bool,
    env: dict[str, str],
    store_path: Path | None,
) -> dict[str, str]:
    """The whole environment ``rank``'s server starts with."""
    extra = layout.server_env(rank, cpu, cache_dir(), spec.ports, store_path)
    return {**env, **extra, **layout.release_env(spec, rank)}


def restart_rank(cluster: Cluster, name: str, timeout: float = 600.0) -> float:
    """Stop rank ``name`` (SIGTERM) and start it again (:func:`start_rank`);
    return the seconds until it is healthy again."""
    Run(cluster.run_dir).stop_one(name)
    return start_rank(cluster, name, timeout)


def start_rank(cluster: Cluster, name: str, timeout: float = 600.0) -> float:
    """Start stopped rank ``name`` with its first command and environment (a
    crashed or redeployed server); return the seconds until it is healthy.
    A prefill comes back with a new engine id and registers it on its
    (still running) Mooncake bootstrap server."""
    rank = next(r for r in cluster.ranks if r.name == name)
    state = Run(cluster.run_dir)
    store_path = cluster.run_dir / STORE_CONFIG_FILE if cluster.spec.store else None
    env = rank_env(cluster.spec, rank, cluster.cpu, base_env(), store_path)
    argv = layout.server_argv(cluster.spec, rank, cluster.model, cluster.cpu)
    proc = state.start(name, argv, env, f"{rank.url}/health")
    return state.wait_healthy([proc], timeout=timeout, poll=2.0)


def start_store(
    state: Run, spec: ClusterSpec, cpu: bool, env: dict[str, str], timeout: float = 60
) -> Path:
    """Start ``mooncake_master`` and its segment owner; return the config path.

    Healthy means the master answers ``/health`` and reports the segment
    owner's memory mounted (``master_total_capacity_bytes`` > 0).
    """
    import json

    ports = spec.ports
    path = state.dir / STORE_CONFIG_FILE
    path.write_text(json.dumps(layout.store_config(spec, cpu), indent=2))
    metrics = f"http://{HOST}:{ports.store_master_metrics}"
    master = state.start(
        STORE_MASTER, layout.store_master_argv(spec), env, f"{metrics}/health"
    )
    state.wait_healthy([master], timeout=timeout)
    start_store_segment(state, spec, cpu, env, timeout)
    return path


def start_store_segment(
    state: Run, spec: ClusterSpec, cpu: bool, env: dict[str, str], timeout: float = 60
) -> Proc:
    """Start the store's segment owner and wait until its memory is mounted."""
    from vllm_mooncake.tools.cluster.client import metric_total, scrape_url

    metrics = f"http://{HOST}:{spec.ports.store_master_metrics}/metrics"
    seg = state.start(STORE_SEGMENT, layout.store_segment_argv(spec, cpu), env, metrics)
    deadline = time.monotonic() + timeout
    while True:
        if metric_total(scrape_url(metrics), STORE_METRIC_CAPACITY) > 0:
            return seg
        if not seg.leader_alive() or time.monotonic() > deadline:
            raise StartupError(
                f"{STORE_SEGMENT} mounted no memory on the store master; "
                f"log {seg.log}:\n{tail(seg.log)}"
            )
        time.sleep(0.5)


def stop_store_segment(cluster: Cluster, timeout: float = 30.0) -> list[str]:
    """Stop the store's segment owner: every block the store held is lost,
    while mooncake_master still lists their keys until its ``client_ttl``
    runs out (so store lookups still hit, and the loads fail)."""
    return Run(cluster.run_dir).stop_one(STORE_SEGMENT, timeout)


def paused_store_segment(
    cluster: Cluster,
) -> contextlib.AbstractContextManager[list[int]]:
    """Freeze the store's segment owner for a ``with`` block: a store load
    started meanwhile cannot complete until the block ends (the KV it reads
    lives in that process), and nothing the store holds is lost."""
    return Run(cluster.run_dir).paused(STORE_SEGMENT)


@contextlib.contextmanager
def running(
    spec: ClusterSpec,
    run: str,
    timeout: float = 600.0,
    settle: Sequence[Future[Any]] = (),
) -> Iterator[Cluster]:
    """``up``, yield the cluster, stop it; raise if any process it started
    (vLLM's engine cores and workers included) outlived the stop.

    ``settle``: work started beside the cluster (:func:`reference_beside`)
    that must be over before the cluster is yielded, so none of it runs
    while the caller measures; its result or error stays in its future."""
    started = up(spec, run=run, timeout=timeout)
    recorded = Run(started.run_dir).procs
    try:
        wait(settle, timeout=timeout)
        yield started
    finally:
        started.stop()
        left = {p.name: p.members() for p in recorded if p.members()}
        if left:
            raise RuntimeError(f"processes left after stop: {left}")


@contextlib.contextmanager
def reference_server(
    spec: ClusterSpec, run: str = "reference", timeout: float = 600.0
) -> Iterator[str]:
    """A plain vLLM server with the cluster's model and no KV transfer.

    Yields its URL (port ``spec.ports.reference``) once healthy and stops it
    on exit. The end-to-end tests take their greedy reference outputs from it
    before the cluster starts, so the two never compete for the cores.
    """
    port = spec.ports.reference
    if port_in_use(port, HOST):
        raise StartupError(f"port {port} on {HOST} is in use (reference server)")
    state = Run(run_dir(run))
    if state.live():
        state.stop()
    _clear_logs(state.dir)
    state = Run(state.dir)
    try:
        cpu = host_is_cpu(spec)
        model = resolve_model(spec)
        env = {**base_env(), **layout.reference_env(cpu, cache_dir())}
        url = f"http://{HOST}:{port}"
        proc = state.start(
            "reference",
            layout.reference_argv(spec, model, port, cpu),
            env,
            f"{url}/health",
        )
        state.wait_healthy([proc], timeout=timeout, poll=2.0)
        yield url
    finally:
        state.stop()


def reference_beside(
    spec: ClusterSpec,
    run: str,
    ask: Callable[[str], T],
    timeout: float = 600.0,
) -> Future[T]:
    """Start :func:`reference_server` now, in a thread, so that its start
    overlaps whatever the caller starts next (a cluster): starting a vLLM
    server here is mostly importing it, three processes one after another,
    and two such chains share the cores better than they run in turn.

    Once the server is healthy, ``ask(url)`` computes what the caller needs
    (greedy outputs) and the server stops; the future holds ``ask``'s
    result or its error. Pass the future to :func:`running` (``settle``) so
    that nothing of the reference runs while the cluster is measured.
    """
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=run)
    try:
        return pool.submit(_ask_reference, spec, run, ask, timeout)
    finally:
        pool.shutdown(wait=False)


def _ask_reference(
    spec: ClusterSpec, run: str, ask: Callable[[str], T], timeout: float
) -> T:
    with reference_server(spec, run=run, timeout=timeout) as url:
        return ask(url)


def attach(run: str = DEFAULT_RUN) -> Cluster:
    """The cluster a previous ``up`` started (for clients and tests)."""
    state = Run(run_dir(run))
    if not state.info:
        raise StartupError(f"run {run!r} is not up")
    spec_fields = dict(state.info["spec"])
    spec_fields["server_args"] = tuple(spec_fields.get("server_args", ()))
    spec_fields["unrouted"] = tuple(spec_fields.get("unrouted", ()))
    spec = ClusterSpec(**spec_fields)
    rank_list = tuple(Rank(**r) for r in state.info["ranks"])
    return Cluster(
        spec,
        rank_list,
        state.dir,
        state.info["model"],
        state.info["cpu"],
        state.info.get("timings", {}),
    )


def down(run: str = DEFAULT_RUN, timeout: float = 30.0) -> list[str]:
    return Run(run_dir(run)).stop(timeout)


def down_live(
    prefix: str, timeout: float = 30.0, spare: Sequence[str] = ()
) -> list[str]:
    """Stop every run named ``prefix...`` that still has live processes (a
    killed test session's leftovers hold the ports and the cores), except
    the runs named in ``spare`` (a reference server started beside the
    next cluster); return the runs stopped."""
    root = run_dir(prefix).parent
    stopped = []
    for rd in sorted(root.glob(f"{prefix}*")):
        if not rd.is_dir() or rd.name in spare:
            continue
        run = Run(rd)
        if run.live():
            run.stop(timeout)
            stopped.append(rd.name)
    return stopped


def _clear_logs(rd: Path) -> None:
    logs = rd / "logs"
    if logs.is_dir():
        for f in logs.glob("*.log"):
            f.unlink()


# ---- CLI ------------------------------------------------------------------------
def smoke(cluster: Cluster, say: Any = print) -> None:
    from vllm_mooncake.tools.cluster.client import complete

    t = time.monotonic()
    out = complete(cluster.router_url, "Hello from the local PD cluster:", 12)
    say(
        f"[up] request through the router: {len(out.token_ids)} tokens in "
        f"{time.monotonic() - t:.2f} s, finish_reason={out.finish_reason}, "
        f"token_ids={out.token_ids}"
    )


def _spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    guard_extra: dict[str, Any] = {}
    if args.stall_alarm_steps is not None:
        guard_extra["stall_alarm_steps"] = args.stall_alarm_steps
    if args.stall_alarm_s is not None:
        guard_extra["stall_alarm_s"] = args.stall_alarm_s
    return ClusterSpec(
        store=args.store,
        store_client_ttl_s=args.store_client_ttl,
        connector=args.connector,
        rank_connectors=_rank_connectors(args.rank_connector or ()),
        kv_load_failure_policy=args.kv_load_failure_policy,
        shape=args.shape,
        base_port=args.base_port,
        model=args.model or "",
        kv_style=args.kv_style,
        policy=args.policy,
        guard_extra=guard_extra,
        decode_blocks=args.decode_blocks,
        prefill_blocks=args.prefill_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        server_args=tuple(args.server_arg or ()),
        python=args.python or sys.executable,
        vllm_version=args.vllm_version,
    )


def _rank_connectors(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, connector = pair.partition("=")
        if not sep or not name or not connector:
            raise SystemExit(
                f"--rank-connector {pair!r}: write RANK=CONNECTOR, e.g. "
                "decode-0=stock or decode-1=reserve"
            )
        out[name] = connector
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vllm_mooncake.tools.cluster.local",
        description="A local prefill/decode vLLM cluster with the wedge guard.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start the cluster and wait until it serves")
    u.add_argument("--shape", default="1p2d", choices=sorted(layout.SHAPES))
    u.add_argument("--run", default=DEFAULT_RUN, help="run name (folder, state)")
    u.add_argument(
        "--base-port",
        type=int,
        default=int(os.environ.get(BASE_PORT_ENV, layout.DEFAULT_BASE_PORT)),
        help=f"router port; ranks at +100.., see layout.py (${BASE_PORT_ENV})",
    )
    u.add_argument("--model", default=os.environ.get("MODEL", ""))
    u.add_argument("--kv-style", default="mooncake", choices=layout.KV_STYLES)
    u.add_argument(
        "--store",
        action="store_true",
        help="a Mooncake store child next to the P->D child (mooncake_master "
        "and a segment owner on 127.0.0.1)",
    )
    u.add_argument(
        "--connector",
        default="guard",
        choices=layout.CONNECTORS,
        help="stock: vLLM's MultiConnector over the same children, no guard",
    )
    u.add_argument(
        "--rank-connector",
        action="append",
        metavar="RANK=CONNECTOR",
        help="one rank's connector: stock or a guard policy (repeat), "
        "e.g. decode-0=stock",
    )
    u.add_argument(
        "--kv-load-failure-policy",
        default="",
        choices=layout.LOAD_FAILURE_POLICIES,
        help="kv_transfer_config.kv_load_failure_policy (default: vLLM's)",
    )
    u.add_argument(
        "--store-client-ttl",
        type=int,
        default=layout.STORE_CLIENT_TTL_S,
        help="seconds mooncake_master keeps a silent client's segments",
    )
    u.add_argument("--policy", default="reserve+lateral")
    u.add_argument("--stall-alarm-steps", type=int, default=None)
    u.add_argument("--stall-alarm-s", type=float, default=None)
    u.add_argument("--decode-blocks", type=int, default=None)
    u.add_argument("--prefill-blocks", type=int, default=None)
    u.add_argument("--max-model-len", type=int, default=512)
    u.add_argument("--max-num-seqs", type=int, default=8)
    u.add_argument(
        "--server-arg",
        action="append",
        help="extra vLLM argument for every rank (repeat; e.g. --server-arg=-O0)",
    )
    u.add_argument(
        "--python",
        default="",
        help="the Python whose vLLM the servers run (default: this one); e.g. "
        "a release environment of scripts/real_release_env.sh",
    )
    u.add_argument(
        "--vllm-version",
        default="",
        help="the vLLM release --python runs (default: the one installed here)",
    )
    u.add_argument("--timeout", type=float, default=600.0)
    u.add_argument("--no-smoke", action="store_true", help="skip the test request")
    for name in ("down", "status"):
        s = sub.add_parser(name)
        s.add_argument("--run", default=DEFAULT_RUN)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "down":
        for line in down(args.run):
            print(f"[down] {line}")
        return 0
    if args.cmd == "status":
        return _status(args.run)
    try:
        cluster = up(_spec_from_args(args), args.run, args.timeout)
        if not args.no_smoke:
            smoke(cluster)
    except StartupError as exc:
        print(f"[up] {exc}", file=sys.stderr)
        return 1
    _print_summary(cluster)
    return 0


def _status(run: str) -> int:
    from vllm_mooncake.tools.cluster.procs import http_ok

    state = Run(run_dir(run))
    if not state.procs:
        print(f"run {run!r}: nothing recorded")
        return 1
    for p in state.procs:
        members = p.members()
        health = "healthy" if members and http_ok(p.health_url) else "-"
        print(
            f"{p.name:12} pid {p.pid:<7} processes {len(members):<3} {health:8} "
            f"{p.health_url}  log {p.log}"
        )
    return 0


def _print_summary(cluster: Cluster) -> None:
    print(f"\nrouter   {cluster.router_url}  (OpenAI API: /v1/completions)")
    for r in cluster.ranks:
        print(f"{r.name:9} {r.url}  /metrics  log {cluster.log(r.name)}")
    print(f"logs     {cluster.run_dir / 'logs'}")
    run = cluster.run_dir.name
    opt = "" if run == DEFAULT_RUN else f" --run {run}"
    print(
        f"stop     deploy/local/down.sh{opt}  "
        f"(python -m vllm_mooncake.tools.cluster.local down{opt})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
