"""The local cluster's Mooncake bootstrap server lets a restarted prefill in.

vLLM's own server (run here too, side by side) refuses a second engine for a
data-parallel rank with HTTP 400 while the first one's entry stands -- also
when that engine has died and restarted under a new id. The project's
server replaces an entry whose workers no longer answer, and still refuses
one whose workers do. Real HTTP on 127.0.0.1; the "workers" are plain
listening sockets standing in for the prefill's side channel.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
    MooncakeBootstrapServer,
)

from vllm_mooncake.tools.cluster.mooncake_bootstrap import ReplacingBootstrapServer


def _post(port: int, payload: dict[str, Any]) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/register",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def _query(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/query", timeout=10) as r:
        result: dict[str, Any] = json.loads(r.read())
        return result


def _worker() -> tuple[socket.socket, str]:
    """A listening socket standing in for a prefill worker's side channel."""
    sock = socket.create_server(("127.0.0.1", 0))
    return sock, f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def _payload(engine_id: str, addr: str) -> dict[str, Any]:
    return {
        "engine_id": engine_id,
        "dp_rank": 0,
        "tp_rank": 0,
        "pp_rank": 0,
        "addr": addr,
    }


@pytest.fixture(params=[MooncakeBootstrapServer, ReplacingBootstrapServer])
def server(request: pytest.FixtureRequest) -> Iterator[Any]:
    srv = request.param("127.0.0.1", 0)
    srv.start()
    try:
        yield srv
    finally:
        srv.shutdown()


def test_a_restarted_prefill_registers_again(server: Any) -> None:
    first, first_addr = _worker()
    assert _post(server.port, _payload("engine-1", first_addr)) == 200
    # The same registration again (a client retry) is fine for both.
    assert _post(server.port, _payload("engine-1", first_addr)) == 200
    first.close()  # the prefill dies; it restarts with a new engine id
    second, second_addr = _worker()
    try:
        status = _post(server.port, _payload("engine-2", second_addr))
        entry = _query(server.port)["0"]
    finally:
        second.close()
    if type(server) is MooncakeBootstrapServer:
        assert status == 400  # stock: refused while the dead entry stands
        assert entry["engine_id"] == "engine-1"
    else:
        assert status == 200
        assert entry == {
            "engine_id": "engine-2",
            "worker_addr": {"0": {"0": second_addr}},
        }


def test_a_live_engine_is_not_replaced() -> None:
    server = ReplacingBootstrapServer("127.0.0.1", 0)
    server.start()
    live, live_addr = _worker()
    other, other_addr = _worker()
    try:
        assert _post(server.port, _payload("engine-1", live_addr)) == 200
        assert _post(server.port, _payload("engine-2", other_addr)) == 400
        assert _query(server.port)["0"]["engine_id"] == "engine-1"
    finally:
        live.close()
        other.close()
        server.shutdown()
