"""Every socket the local cluster listens on is bound to loopback, or named.

Lists the listening sockets (TCP in LISTEN, UDP without a peer; IPv4 and
IPv6) of every process ``up`` started and of every process those started
(vLLM's engine core and workers), from ``/proc``, once per KV style (the
cluster fixture is shared with the other e2e modules). A request goes
through the router first, so the transports that open their listeners
lazily have done so.

A socket not bound to 127.0.0.1 / ::1 fails the test unless
:data:`UNBINDABLE` names its transport with the reason it cannot be told
where to bind (the runbook's "Exposure: what listens where" says the same).
Each entry must still be needed: if its transport ever binds to loopback
only (or is gone), the test fails and asks for the entry to be removed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from vllm_mooncake.tools.cluster.client import complete
from vllm_mooncake.tools.cluster.local import Cluster
from vllm_mooncake.tools.cluster.sockets import Listener, exposed, run_listeners

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Unbindable:
    """A transport that listens on the wildcard address whatever it is told."""

    transport: str
    reason: str
    matches: Callable[[Cluster, Listener], bool]


def _mooncake_engine(cluster: Cluster, s: Listener) -> bool:
    """A vLLM rank's socket in the cluster's Mooncake transfer-engine range."""
    first, last = cluster.spec.ports.mooncake_rpc
    ranks = {r.name for r in cluster.ranks}
    return s.proto == "tcp" and s.owner in ranks and first <= s.port <= last


UNBINDABLE: tuple[Unbindable, ...] = (
    Unbindable(
        transport="Mooncake transfer engine (P2P handshake + TCP data listener)",
        reason=(
            "mooncake-transfer-engine binds both listeners to INADDR_ANY / "
            "in6addr_any (its handshake socket and its TCP transport's acceptor); "
            "the hostname vLLM passes (VLLM_HOST_IP) is only advertised, and "
            "MC_TCP_BIND_ADDRESS is read only outside P2P-handshake mode. The "
            "launcher confines them to MC_MIN_RPC_PORT..MC_MAX_RPC_PORT "
            "(base + 600..699) so a host firewall can close them; see "
            "docs/runbook.md, 'Exposure: what listens where'."
        ),
        matches=_mooncake_engine,
    ),
)


def _expected_loopback(cluster: Cluster) -> dict[str, set[int]]:
    """Ports the launcher told each process to bind on 127.0.0.1."""
    ports = cluster.spec.ports
    out: dict[str, set[int]] = {"router": {ports.router, ports.router_metrics}}
    for r in cluster.ranks:
        out[r.name] = {r.port, r.nixl_port}
        if r.bootstrap_port is not None:
            out[f"bootstrap-{r.index}"] = {r.bootstrap_port}
    return out


@pytest.fixture(scope="session")
def listeners(cluster: Cluster) -> list[Listener]:
    """The cluster's listening sockets after one request went through it
    (scanned once per KV style)."""
    out = complete(cluster.router_url, "Which sockets are open?", 4)
    assert out.token_ids, out.raw
    found = run_listeners(cluster.run_dir)
    print(f"\n{len(found)} listening sockets ({cluster.spec.kv_style} style):")
    for s in found:
        print(f"  {'loopback' if s.loopback else 'EXPOSED '} {s}")
    return found


def test_the_scan_sees_every_process_and_its_configured_ports(
    cluster: Cluster, listeners: list[Listener]
) -> None:
    """The ports each component was told to use show up, bound on loopback:
    the scan reaches every process tree, including vLLM's engine core (which
    holds the NIXL side channel)."""
    seen: dict[str, set[int]] = {}
    for s in listeners:
        if s.loopback and s.proto == "tcp":
            seen.setdefault(s.owner, set()).add(s.port)
    for owner, ports in _expected_loopback(cluster).items():
        missing = ports - seen.get(owner, set())
        assert not missing, f"{owner}: no loopback listener on {sorted(missing)}"


def test_every_listener_is_loopback_or_a_named_unbindable_transport(
    cluster: Cluster, listeners: list[Listener]
) -> None:
    unexplained = [
        s
        for s in exposed(listeners)
        if not any(u.matches(cluster, s) for u in UNBINDABLE)
    ]
    assert not unexplained, (
        "listening beyond loopback, and no UNBINDABLE entry explains it "
        "(bind it to 127.0.0.1 in vllm_mooncake/tools/cluster/layout.py, or "
        "name the transport with its reason):\n"
        + "\n".join(f"  {s}" for s in unexplained)
    )


def test_each_unbindable_entry_is_still_needed(
    cluster: Cluster, listeners: list[Listener]
) -> None:
    """An entry that matches no exposed socket is stale: its transport now
    binds to loopback (or is gone), so the exception must go."""
    wide = exposed(listeners)
    for entry in UNBINDABLE:
        hits = [s for s in wide if entry.matches(cluster, s)]
        assert hits, (
            f"UNBINDABLE entry {entry.transport!r} matches no socket outside "
            "loopback any more: remove it here and from docs/runbook.md"
        )


def test_mooncake_listeners_stay_in_the_clusters_range(
    cluster: Cluster, listeners: list[Listener]
) -> None:
    """Every rank's transfer engine took its ports from the cluster's range
    (MC_MIN_RPC_PORT / MC_MAX_RPC_PORT), not Mooncake's default 15000-17000:
    the range the runbook tells operators to firewall is the real one."""
    in_range = {s.owner for s in listeners if _mooncake_engine(cluster, s)}
    assert in_range == {r.name for r in cluster.ranks}
