"""vLLM's Mooncake bootstrap server, on an address you choose, that lets a
restarted prefill register again.

A Mooncake prefill rank registers its transfer-engine address here and the
decode ranks (or the router) look it up (``GET /query``). vLLM 0.32 starts
one inside the prefill's rank-0 worker, hard-coded to ``0.0.0.0``
(``MooncakeConnectorWorker.__init__``). Naming an address in the Mooncake
child's ``kv_connector_extra_config.bootstrap_server_address`` stops the
prefill from starting its own; this module runs vLLM's server class on that
address instead (``127.0.0.1`` for the local cluster)::

    python -m vllm_mooncake.tools.cluster.mooncake_bootstrap \
        --host 127.0.0.1 --port 8998

vLLM's server keys entries by data-parallel rank and refuses (HTTP 400) a
second engine for the same rank: a prefill that restarts (a new engine id)
is refused while its dead predecessor's entry stands, and the bootstrap
server had to be restarted with it. :class:`ReplacingBootstrapServer`
replaces an entry whose workers no longer answer on their side channel, and
still refuses one whose workers do (two live prefills on one rank is a
configuration error).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
from urllib.parse import urlsplit

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
    EngineEntry,
    MooncakeBootstrapServer,
    RegisterWorkerPayload,
)

logger = logging.getLogger("vllm.vllm_mooncake.tools.cluster.mooncake_bootstrap")

PROBE_TIMEOUT_S = 1.0


async def answers(addr: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a worker's side channel (``tcp://host:port``) accepts a
    connection."""
    parts = urlsplit(addr)
    if parts.hostname is None or parts.port is None:
        return False
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, parts.port), timeout
        )
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


async def any_worker_answers(entry: EngineEntry) -> bool:
    addrs = [a for by_pp in entry.worker_addr.values() for a in by_pp.values()]
    return any(await asyncio.gather(*(answers(a) for a in addrs)))


class ReplacingBootstrapServer(MooncakeBootstrapServer):  # type: ignore[misc]
    """vLLM's bootstrap server; a registration that conflicts with a dead
    engine's entry replaces it."""

    async def register_worker(self, payload: RegisterWorkerPayload) -> dict[str, str]:
        entry = self.workers.get(payload.dp_rank)
        if entry is not None and await self._is_stale(entry, payload):
            logger.warning(
                "Mooncake bootstrap: engine %s replaces the registration of "
                "engine %s for dp_rank=%d (its workers no longer answer)",
                payload.engine_id,
                entry.engine_id,
                payload.dp_rank,
            )
            del self.workers[payload.dp_rank]
        result: dict[str, str] = await super().register_worker(payload)
        return result

    @staticmethod
    async def _is_stale(entry: EngineEntry, payload: RegisterWorkerPayload) -> bool:
        """A conflicting entry (another engine, or this rank at another
        address) whose workers all stopped answering."""
        existing = entry.worker_addr.get(payload.tp_rank, {}).get(payload.pp_rank)
        conflict = entry.engine_id != payload.engine_id or (
            existing is not None and existing != payload.addr
        )
        return conflict and not await any_worker_answers(entry)


def serve(host: str, port: int) -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = ReplacingBootstrapServer(host, port)
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
