"""The GPU-day check: W1 and W2 on real GPU servers of vLLM 0.33/0.34.

vLLM 0.33 and 0.34 have no CPU build, so this project proves them on their
own scheduler code only (``make releases``). On a machine with NVIDIA GPUs
(one per rank: 1 prefill + 2 decodes) and that vLLM installed next to this
package and the transport extras, one command runs the check the real-release
tier runs on CPU releases:

    python -m vllm_mooncake.tools.cluster.gpu_day --vllm-version 0.34.0

It starts the store-mode 1P2D of :mod:`~vllm_mooncake.tools.cluster.local`
(mooncake_master and a segment owner on 127.0.0.1, each rank's connector over
[MooncakeStoreConnector, MooncakeConnector] over RDMA, or ``--protocol
tcp``), with ``decode-0`` on vLLM's own MultiConnector and ``decode-1`` on
the guard, both with W1's settings (priority scheduling, no full-prompt
admission check, ``kv_load_failure_policy=recompute``, a small pool); forms
W1 on each decode, then W2 (the store's segment owner stopped after the
prefixes were saved), and prints stock and guard side by side. ``--dry-run``
prints the plan (every command line and environment) without starting
anything: that part runs anywhere, and the unit tests check it.

Exit code 0 when, for both wedges, stock stayed wedged and the guard
finished both requests; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_mooncake.tools.cluster import layout
from vllm_mooncake.tools.cluster.layout import ClusterSpec
from vllm_mooncake.tools.cluster.real_wedges import (
    W1_DECODE_BLOCKS,
    W1_SERVER_ARGS,
    W1Prompts,
    W2Prompts,
    WedgeRun,
    form_w1,
    form_w2,
    report,
    seed_store,
)

__all__ = ["Verdict", "build_spec", "main", "plan", "verdict"]

STOCK, GUARD = 0, 1  # decode indices
RUN = "gpu-day"
GPUS_NEEDED = 3  # one per rank: prefill-0, decode-0, decode-1
CLIENT_TTL_S = 600  # W2: the master keeps the lost keys listed this long


def build_spec(args: argparse.Namespace) -> ClusterSpec:
    """The store-mode 1P2D with W1's settings, stock on decode-0."""
    return ClusterSpec(
        shape="1p2d",
        base_port=args.base_port,
        model=args.model,
        store=True,
        store_client_ttl_s=CLIENT_TTL_S,
        decode_blocks=args.decode_blocks,
        server_args=W1_SERVER_ARGS,
        kv_load_failure_policy="recompute",
        rank_connectors={"decode-0": "stock"},
        unrouted=("decode-0",),
        cpu=False,
        mooncake_protocol=args.protocol,
        vllm_version=args.vllm_version,
    )


def plan(spec: ClusterSpec) -> list[str]:
    """Every rank's command line and environment, one JSON line each."""
    cache = Path(".cache")
    lines = []
    for rank in layout.ranks(spec, None):
        env = {
            **layout.server_env(rank, False, cache, spec.ports),
            **layout.release_env(spec, rank),
        }
        argv = layout.server_argv(spec, rank, spec.model or "<model>", False)
        lines.append(json.dumps({"rank": rank.name, "env": env, "argv": argv}))
    return lines


@dataclass(frozen=True)
class Verdict:
    wedge: str
    stock_wedged: bool
    guard_finished: bool

    @property
    def ok(self) -> bool:
        return self.stock_wedged and self.guard_finished


def verdict(wedge: str, stock: WedgeRun, guard: WedgeRun) -> Verdict:
    """Stock wedged: nothing finished and no token generated while held."""
    wedged = not stock.finished and stock.settled.generated == stock.formed.generated
    return Verdict(wedge, wedged, guard.finished)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vllm_mooncake.tools.cluster.gpu_day")
    ap.add_argument("--vllm-version", default="", help="default: the installed one")
    ap.add_argument("--model", default="", help="default: the tiny local model")
    ap.add_argument("--base-port", type=int, default=layout.DEFAULT_BASE_PORT)
    ap.add_argument("--protocol", default="rdma", choices=("rdma", "tcp"))
    ap.add_argument("--decode-blocks", type=int, default=W1_DECODE_BLOCKS)
    ap.add_argument("--hold", type=float, default=15.0, help="seconds to watch")
    ap.add_argument("--dry-run", action="store_true", help="print the plan only")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spec = build_spec(args)
    if args.dry_run:
        print("\n".join(plan(spec)))
        return 0
    return _run(spec, args.hold)


def _run(spec: ClusterSpec, hold: float) -> int:  # pragma: no cover - needs GPUs
    from vllm_mooncake.compat.cpu import has_accelerator
    from vllm_mooncake.tools.cluster.local import running, stop_store_segment

    if not has_accelerator():
        print("gpu_day: no usable GPU here (use --dry-run to see the plan)")
        return 2
    verdicts = []
    with running(spec, RUN, timeout=1200) as cluster:
        p, boot = cluster.prefill_urls[0], cluster.bootstrap_urls[0]
        metrics = f"http://{layout.HOST}:{spec.ports.store_master_metrics}/metrics"
        runs = {}
        for j in (STOCK, GUARD):
            d = cluster.decode_urls[j]
            prompts = W1Prompts.make(j)
            runs[j] = form_w1(p, d, boot, metrics, prompts, hold, hold + 20)
        verdicts.append(_show("W1", runs[STOCK], runs[GUARD]))
        w2 = {j: W2Prompts.make(j) for j in (STOCK, GUARD)}
        for prompts2 in w2.values():
            seed_store(p, prompts2.seed, metrics)
        stop_store_segment(cluster)
        for j in (STOCK, GUARD):
            runs[j] = form_w2(p, cluster.decode_urls[j], boot, w2[j], hold, hold + 20)
        verdicts.append(_show("W2", runs[STOCK], runs[GUARD]))
    return 0 if all(v.ok for v in verdicts) else 1


def _show(name: str, stock: WedgeRun, guard: WedgeRun) -> Verdict:
    result = verdict(name, stock, guard)
    print(
        f"== {name}: stock {'wedged' if result.stock_wedged else 'NOT wedged'}, "
        f"guard {'finished' if result.guard_finished else 'NOT finished'}"
    )
    print("  stock: " + "\n  ".join(report(stock)))
    print("  guard: " + "\n  ".join(report(guard)))
    sys.stdout.flush()
    return result


if __name__ == "__main__":
    raise SystemExit(main())
