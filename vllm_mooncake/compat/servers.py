"""What a real server of each vLLM release needs around the guard.

Facts the local cluster (``tools/cluster``) and the deployment files act on,
by release series; each is checked against the release's own source by
``tests/test_release_server_layout.py``, and on real servers by the
real-release tier (``tests/real_releases``). No vLLM import: the launcher
runs servers of another release than the one installed next to it.

- ``shared_hash_seed``: prefix-block hashes agree across processes without
  ``PYTHONHASHSEED`` (0.29+: the default sha256 gets a fixed seed). Before,
  each process draws a random seed, so a Mooncake store shared by several
  ranks never matches a key another rank saved: every rank needs the same
  ``PYTHONHASHSEED``.
- ``mooncake_store``: vLLM has MooncakeStoreConnector (0.21+), the
  store child of a store-mode rank; before, a Mooncake store cannot sit
  next to the P->D connector.
- ``bootstrap_server_address``: MooncakeConnector registers a prefill on an
  external bootstrap server named in ``kv_connector_extra_config`` (0.32+).
  Before, each prefill starts its own bootstrap server inside the engine, on
  ``VLLM_MOONCAKE_BOOTSTRAP_PORT``, bound to 0.0.0.0 (not configurable).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mooncake.compat.versions import SUPPORTED_VLLM, series

__all__ = ["PREFIX_HASH_SEED", "ServerFacts", "server_facts"]

PREFIX_HASH_SEED = "0"
"""The ``PYTHONHASHSEED`` the local cluster gives every rank of a store-mode
cluster on releases without ``shared_hash_seed`` (any fixed value works, as
long as every rank has the same; with sha256 the seed is not a secret)."""


@dataclass(frozen=True)
class ServerFacts:
    shared_hash_seed: bool
    mooncake_store: bool
    bootstrap_server_address: bool


def server_facts(version: str) -> ServerFacts:
    """The facts of ``version``'s series (``0.22.1``, ``0.22``, ``0.32.0+cpu``)."""
    minor = series(version)
    if minor not in SUPPORTED_VLLM:
        raise ValueError(
            f"vLLM {version}: series {minor} is not supported; "
            f"supported: {', '.join(SUPPORTED_VLLM)}"
        )
    number = int(minor.split(".")[1])
    return ServerFacts(
        shared_hash_seed=number >= 29,
        mooncake_store=number >= 21,
        bootstrap_server_address=number >= 32,
    )
