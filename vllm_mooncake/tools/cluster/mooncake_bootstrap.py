"""vLLM's Mooncake bootstrap server, on an address you choose.

A Mooncake prefill rank registers its transfer-engine address here and the
decode ranks (or the router) look it up (``GET /query``). vLLM 0.32 starts
one inside the prefill's rank-0 worker, hard-coded to ``0.0.0.0``
(``MooncakeConnectorWorker.__init__``). Naming an address in the Mooncake
child's ``kv_connector_extra_config.bootstrap_server_address`` stops the
prefill from starting its own; this module runs vLLM's server class on that
address instead (``127.0.0.1`` for the local cluster)::

    python -m vllm_mooncake.tools.cluster.mooncake_bootstrap \
        --host 127.0.0.1 --port 8998

One bootstrap server per prefill instance: it keys entries by data-parallel
rank and rejects a second engine for the same rank, so restart it whenever
its prefill restarts.
"""

from __future__ import annotations

import argparse
import signal
import threading


def serve(host: str, port: int) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
        MooncakeBootstrapServer,
    )

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = MooncakeBootstrapServer(host, port)
    server.start()
    print(f"mooncake bootstrap server listening on {host}:{server.port}", flush=True)
    try:
        stop.wait()
    finally:
        server.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Mooncake bootstrap server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8998)
    args = parser.parse_args(argv)
    serve(args.host, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
