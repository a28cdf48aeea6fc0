"""A rolling restart under load: the guard against stock MultiConnector.

Each side gets a fresh local 2P2D (Mooncake-style P->D over Mooncake's TCP
transfer engine, vllm-router in front): every rank on ``WedgeGuardConnector``
(``recv_deadline_s`` 60, ``sender_probe_s`` 2), or every rank on vLLM's
stock ``MultiConnector`` over the same children. The two are never up at
once. On each, ``vllm_mooncake.tools.cluster.rollout_load.under_load``
drives ``vllm bench serve`` rounds and a probe client through the router,
then replaces the given ranks (a prefill SIGKILLed and restarted, a decode
drained and restarted, the router restarted after each). Printed per side:
requests served and failed, the longest request, the decodes' tokens per
second before and after, how long after the last router restart every
request was served again, and which ranks still answer ``/health`` (stock's
API server can die on its Prometheus ``observe`` assert when Mooncake fails
a pull). A rollout that stops (a replaced rank not healthy within
``--start-timeout``) keeps the figures of the load so far and says why.
Each side's figures are saved as JSON under ``--out``. ::

    python bench/rolling_restart.py                       # guard, then stock
    python bench/rolling_restart.py --connectors stock    # one side only
    python bench/rolling_restart.py --ranks prefill-0,prefill-1,decode-0,decode-1

A benchmark, not a test: nothing here fails on a threshold. A side takes
20-40 minutes on 2 shared cores (a replaced rank starts in 2-9 minutes there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _util import machine, table

from vllm_mooncake.offline import cache_dir
from vllm_mooncake.tools.cluster import layout, local
from vllm_mooncake.tools.cluster.procs import http_ok
from vllm_mooncake.tools.cluster.rollout import START_TIMEOUT_S
from vllm_mooncake.tools.cluster.rollout_load import under_load

SIDES = ("guard", "stock")
PROMPT = [1] + [3 + (i * 37) % 420 for i in range(149)]
GUARD_EXTRA = {"recv_deadline_s": 60.0, "sender_probe_s": 2.0}
# (summary key, row label); a row per figure, a column per side.
ROWS = (
    ("probe_sent", "probe requests"),
    ("probe_failed", "probe failed"),
    ("probe_longest_s", "probe longest (s)"),
    ("bench_completed", "bench served"),
    ("bench_failed", "bench failed"),
    ("bench_longest_s", "bench longest (s)"),
    ("baseline_tok_s", "decode tok/s before"),
    ("tail_tok_s", "decode tok/s after"),
    ("recovered_s", "all served again after (s)"),
    ("rollout_s", "rollout (s)"),
    ("healthy_after", "ranks healthy after"),
)


def side_spec(side: str, base_port: int | None) -> layout.ClusterSpec:
    spec = layout.ClusterSpec(
        shape="2p2d",
        kv_style="mooncake",
        connector=side,
        guard_extra=dict(GUARD_EXTRA) if side == "guard" else {},
    )
    port = base_port if base_port is not None else local.free_base_port(spec)
    return dataclasses.replace(spec, base_port=port)


def run_side(
    side: str,
    ranks: Sequence[str],
    out: Path,
    base_port: int | None,
    start_timeout: float,
) -> dict[str, Any]:
    """One side: a fresh cluster, the rollout under load, its figures."""
    spec = side_spec(side, base_port)
    run = f"bench-rolling-{side}"
    local.down_live(run)
    figures: dict[str, Any] = {"side": side}
    with local.running(spec, run, timeout=1200) as cluster:
        try:
            load = under_load(
                cluster,
                ranks,
                out / side,
                prompt=PROMPT,
                tail_s=60.0,
                start_timeout=start_timeout,
            )
            figures.update(load.summary())
        except Exception as exc:  # a side that breaks is a result too
            figures["error"] = f"{type(exc).__name__}: {exc}"[:500]
        healthy = [r.name for r in cluster.ranks if http_ok(f"{r.url}/health")]
        figures["healthy_after"] = f"{len(healthy)}/{len(cluster.ranks)}"
    (out / f"{side}.json").write_text(json.dumps(figures, indent=2))
    return figures


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connectors", default=",".join(SIDES), help="sides, in order")
    p.add_argument(
        "--ranks", default="prefill-0,decode-0", help="ranks to replace, in order"
    )
    p.add_argument("--out", type=Path, default=cache_dir() / "bench" / "rolling")
    p.add_argument("--base-port", type=int, default=None)
    p.add_argument(
        "--start-timeout",
        type=float,
        default=START_TIMEOUT_S,
        help="seconds a replaced rank may take to answer /health (default "
        f"{START_TIMEOUT_S:.0f}; a loaded 2-core host has needed 2-10 minutes)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sides = [s for s in args.connectors.split(",") if s]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        print(f"--connectors: unknown side(s) {unknown}; use {','.join(SIDES)}")
        return 2
    ranks = [r for r in args.ranks.split(",") if r]
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine())
    results = []
    for side in sides:
        t0 = time.monotonic()
        print(f"[bench] {side}: 2P2D, replacing {', '.join(ranks)}")
        results.append(
            run_side(side, ranks, args.out, args.base_port, args.start_timeout)
        )
        print(f"[bench] {side}: done in {time.monotonic() - t0:.0f} s")
    rows = [[label, *(r.get(key, "-") for r in results)] for key, label in ROWS]
    print(table(["", *sides], rows))
    for r in results:
        if "error" in r:
            print(f"[bench] {r['side']}: {r['error']}")
        for line in r.get("steps", []):
            print(f"[bench] {r['side']}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
