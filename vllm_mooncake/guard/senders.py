"""Senders of P->D receives: who writes a receive's blocks, and whether it lives.

A decode's P->D receive is written by one prefill. When that prefill dies
mid-transfer, vLLM does not notice: a NIXL read is polled with no bound, a
Mooncake pull fails only after its 480 s timeout. The guard's receive watch
(``receive_watch.py``) asks this module, per receive, for evidence that the
sender is gone, and fails the receive early when it is.

Where the evidence comes from, per child (read from the request's
``kv_transfer_params``, which the router copies from the prefill's reply):

==================  ==========================================================
child               evidence
==================  ==========================================================
NixlConnector       ``remote_host``/``remote_port``: the prefill's NIXL
                    side-channel listener (its handshake socket). A refused
                    TCP connect means the prefill process is gone.
MooncakeConnector   ``remote_bootstrap_addr`` + ``remote_engine_id``: the
                    bootstrap server's ``/query`` lists every registered
                    prefill worker by engine id. An engine id the bootstrap
                    no longer lists (replaced by a restarted prefill), or a
                    refused connect to the listed worker address, means the
                    sender is gone. A bootstrap that does not answer proves
                    nothing (before vLLM 0.32 each prefill runs its own, but
                    from 0.32 it may be a separate server).
others (the store)  none: store loads are bounded by the deadline only.
==================  ==========================================================

A refused connect is evidence; an accepted one is not proof of life: a
SIGKILLed process can linger in the kernel with its sockets open, and a
stopped one still completes handshakes. Those are left to the deadline.
Probes run on one background thread (:class:`SenderProbes`) so the
scheduler never waits on the network; two refusals in a row, one probe
interval apart, make a sender dead (one refusal may be a restart's gap).

No vLLM import: the probes use the standard library only.
"""

from __future__ import annotations

import enum
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from vllm_mooncake import logger_for

logger = logger_for(__name__)

PROBE_TIMEOUT_S = 1.0
DEAD_AFTER_REFUSALS = 2


class Liveness(enum.Enum):
    ALIVE = "alive"  # answered (not proof: see the module docstring)
    DEAD = "dead"  # refused, or no longer registered
    UNKNOWN = "unknown"  # timed out, or nothing to ask


@dataclass(frozen=True)
class Sender:
    """Where a receive's writer can be asked whether it lives."""

    kind: str  # "nixl" | "mooncake"
    address: str  # host:port (nixl), the bootstrap URL (mooncake)
    engine_id: str | None = None

    def __str__(self) -> str:
        if self.engine_id is None:
            return self.address
        return f"{self.address} engine {self.engine_id}"


def sender_of(params: Mapping[str, Any] | None) -> Sender | None:
    """The sender named by a request's ``kv_transfer_params``, if any
    (read after the load started: the child may have turned its
    ``do_remote_prefill`` off by then)."""
    if not params:
        return None
    bootstrap = params.get("remote_bootstrap_addr")
    if isinstance(bootstrap, str) and bootstrap:
        engine = params.get("remote_engine_id")
        return Sender("mooncake", bootstrap, None if engine is None else str(engine))
    host, port = params.get("remote_host"), params.get("remote_port")
    if isinstance(host, str) and host and isinstance(port, int) and port > 0:
        return Sender("nixl", f"{host}:{port}")
    return None


def _host_port(address: str) -> tuple[str, int] | None:
    """``host:port``, ``tcp://host:port`` or ``http://host:port`` split."""
    if "://" not in address:
        address = "tcp://" + address
    parts = urlsplit(address)
    if parts.hostname is None or parts.port is None:
        return None
    return parts.hostname, parts.port


def connect(address: str, timeout: float = PROBE_TIMEOUT_S) -> Liveness:
    """A TCP connect to ``address``: refused is DEAD, accepted ALIVE."""
    target = _host_port(address)
    if target is None:
        return Liveness.UNKNOWN
    try:
        with socket.create_connection(target, timeout=timeout):
            return Liveness.ALIVE
    except ConnectionRefusedError:
        return Liveness.DEAD
    except OSError:
        return Liveness.UNKNOWN  # a timeout or an unreachable network


def _mooncake_worker(sender: Sender, timeout: float) -> tuple[Liveness, str | None]:
    """Ask the bootstrap for the sender's worker address."""
    url = sender.address.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    try:
        with urllib.request.urlopen(url + "/query", timeout=timeout) as reply:
            engines = json.load(reply)
    except (OSError, ValueError, urllib.error.URLError):
        return Liveness.UNKNOWN, None  # the bootstrap itself proves nothing
    if not isinstance(engines, Mapping):
        return Liveness.UNKNOWN, None
    for entry in engines.values():
        if not isinstance(entry, Mapping):
            continue
        if str(entry.get("engine_id")) != sender.engine_id:
            continue
        for by_pp in (entry.get("worker_addr") or {}).values():
            for addr in (by_pp or {}).values():
                return Liveness.ALIVE, str(addr)
    return Liveness.DEAD, None  # no longer registered: replaced or gone


def probe(sender: Sender, timeout: float = PROBE_TIMEOUT_S) -> Liveness:
    """Whether ``sender`` can still write (see the module docstring)."""
    if sender.kind == "nixl":
        return connect(sender.address, timeout)
    if sender.kind == "mooncake" and sender.engine_id is not None:
        listed, worker = _mooncake_worker(sender, timeout)
        if worker is None:
            return listed
        return connect(worker, timeout)
    return Liveness.UNKNOWN


Probe = Callable[[Sender], Liveness]


class SenderProbes:
    """Probes on one background thread; verdicts read without waiting.

    :meth:`ask` starts a probe of ``sender`` unless one is running;
    :meth:`is_dead` says whether its last ``DEAD_AFTER_REFUSALS`` answers
    were all refusals. A sender that answers again is alive again.
    """

    def __init__(self, probe_fn: Probe = probe) -> None:
        self._probe = probe_fn
        self._pool: ThreadPoolExecutor | None = None
        self._running: dict[Sender, Future[Liveness]] = {}
        self._refusals: dict[Sender, int] = {}

    def ask(self, sender: Sender) -> None:
        self._collect(sender)
        if sender in self._running:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-guard-probe")
        self._running[sender] = self._pool.submit(self._probe, sender)

    def is_dead(self, sender: Sender) -> bool:
        self._collect(sender)
        return self._refusals.get(sender, 0) >= DEAD_AFTER_REFUSALS

    def refused(self, sender: Sender) -> bool:
        """Whether the last answer was a refusal (a suspect sender)."""
        self._collect(sender)
        return self._refusals.get(sender, 0) > 0

    def _collect(self, sender: Sender) -> None:
        future = self._running.get(sender)
        if future is None or not future.done():
            return
        del self._running[sender]
        try:
            answer = future.result()
        except Exception:  # a probe must never reach the scheduler
            logger.debug("probe of %s raised", sender, exc_info=True)
            answer = Liveness.UNKNOWN
        if answer is Liveness.DEAD:
            self._refusals[sender] = self._refusals.get(sender, 0) + 1
        elif answer is Liveness.ALIVE:
            self._refusals.pop(sender, None)

    def wait(self, timeout: float = 5.0) -> None:
        """Let running probes finish (tests and the simulator)."""
        for future in list(self._running.values()):
            future.result(timeout=timeout)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = [
    "DEAD_AFTER_REFUSALS",
    "Liveness",
    "Probe",
    "Sender",
    "SenderProbes",
    "connect",
    "probe",
    "sender_of",
]
