"""vLLM's real NixlConnector and MooncakeConnector as the guard's children,
and the ``kv_transfer_params`` a P/D proxy sends a decode rank for each.

Only the connectors' scheduler side is built by the tests that use this (no
NIXL agent, no Mooncake transfer engine, no transfer). NIXL gets
``kv_buffer_device="cpu"`` and Mooncake ``mooncake_protocol="tcp"``: the
settings both need on a host without a GPU or RDMA.
"""

from __future__ import annotations

from typing import Any

PROMPT = 64  # 4 blocks of 16 tokens
PEER = "prefill-engine-0"

# What a Mooncake-style P/D proxy sends a decode rank.
MOONCAKE_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_bootstrap_addr": "http://127.0.0.1:8998",
    "remote_engine_id": PEER,
    "transfer_id": "xfer-1",
}
# What a NIXL prefill rank's request_finished returns, forwarded by the
# proxy to the decode rank.
NIXL_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": ([1, 2, 3, 4],),
    "remote_engine_id": PEER,
    "remote_request_id": "prefill-req-1",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "remote_num_tokens": PROMPT,
    "transfer_mode": "pull",
}


def real_children(role: str) -> list[dict[str, Any]]:
    """[NixlConnector, MooncakeConnector], in that order, for ``role``."""
    return [
        {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"},
        {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        },
    ]


def real_children_config(kv_connector: str, role: str) -> dict[str, Any]:
    """A ``kv_transfer_config``: ``kv_connector`` (stock ``MultiConnector`` or
    ``WedgeGuardConnector``, strict) over :func:`real_children`."""
    extra: dict[str, Any] = {"connectors": real_children(role)}
    if kv_connector == "WedgeGuardConnector":
        extra["wedge_guard"] = {"policy": "reserve+lateral", "strict": True}
    return {
        "kv_connector": kv_connector,
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }
