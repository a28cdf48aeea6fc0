"""The local cluster's layout rules (``vllm_mooncake/tools/cluster/layout.py``).

Pure data, no servers: ports, CPU pinning, each rank's command line,
environment and ``kv_transfer_config``, and the router's member list.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllm_mooncake.tools.check_config import check_kv_transfer_config
from vllm_mooncake.tools.cluster import layout
from vllm_mooncake.tools.cluster.layout import ClusterSpec, Rank
from vllm_mooncake.tools.cluster.local import all_ports


def _arg(argv: list[str], flag: str) -> str:
    """The value after ``flag`` (which must occur exactly once)."""
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def _ktc(argv: list[str]) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads(_arg(argv, "--kv-transfer-config"))
    return cfg


def _by_name(spec: ClusterSpec, cpus: list[int] | None = None) -> dict[str, Rank]:
    return {r.name: r for r in layout.ranks(spec, cpus)}


@pytest.mark.parametrize("shape", sorted(layout.SHAPES))
def test_every_port_of_a_cluster_is_distinct(shape: str) -> None:
    ports = all_ports(ClusterSpec(shape=shape, base_port=21000))
    assert len(ports) == len(set(ports))
    assert all(21000 <= p < 21600 for p in ports)


def test_ports_are_offsets_from_the_base() -> None:
    ranks = _by_name(ClusterSpec(shape="2p2d", base_port=21000))
    assert [ranks[f"prefill-{i}"].port for i in (0, 1)] == [21100, 21101]
    assert [ranks[f"decode-{j}"].port for j in (0, 1)] == [21200, 21201]
    assert [ranks[f"prefill-{i}"].bootstrap_port for i in (0, 1)] == [21300, 21301]
    assert ranks["decode-0"].bootstrap_port is None
    assert ranks["prefill-1"].nixl_port == 21401
    assert ranks["decode-1"].nixl_port == 21451
    assert ranks["decode-1"].url == "http://127.0.0.1:21201"


@pytest.mark.parametrize(
    ("shape", "n_prefill", "n_decode"),
    [("1p1d", 1, 1), ("1p2d", 1, 2), ("1p3d", 1, 3), ("2p2d", 2, 2)],
)
def test_shapes_give_their_rank_counts(
    shape: str, n_prefill: int, n_decode: int
) -> None:
    roles = [r.role for r in layout.ranks(ClusterSpec(shape=shape), None)]
    assert roles == ["prefill"] * n_prefill + ["decode"] * n_decode


@pytest.mark.parametrize(
    "bad",
    [
        {"shape": "3p1d"},
        {"kv_style": "tcp"},
        {"base_port": 80},
        {"base_port": 65500},
        {"connector": "MultiConnector"},
        {"kv_load_failure_policy": "retry"},
    ],
)
def test_bad_spec_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ClusterSpec(**bad)


def test_two_cores_pin_prefill_and_decodes_apart() -> None:
    assert layout.split_cpus([0, 1], 1, 2) == ["0", "1", "1"]
    assert layout.split_cpus([1, 0], 2, 2) == ["0", "0", "1", "1"]


def test_enough_cores_give_disjoint_slices() -> None:
    binds = layout.split_cpus(list(range(8)), 2, 2)
    assert binds == ["0,1", "2,3", "4,5", "6,7"]
    cores = [c for b in binds for c in b.split(",")]
    assert len(cores) == len(set(cores))


def test_one_core_is_shared_and_no_core_is_an_error() -> None:
    assert layout.split_cpus([3], 1, 2) == ["3", "3", "3"]
    with pytest.raises(ValueError, match="no CPUs"):
        layout.split_cpus([], 1, 2)


def test_no_cpu_list_means_no_pinning() -> None:
    assert {r.cpus for r in layout.ranks(ClusterSpec(), None)} == {""}


@pytest.mark.parametrize("name", ["prefill-0", "decode-1"])
@pytest.mark.parametrize("cpu", [True, False])
def test_each_rank_config_is_the_guard_over_mooncake_and_nixl(
    name: str, cpu: bool
) -> None:
    spec = ClusterSpec(policy="lateral", guard_extra={"stall_alarm_steps": 50})
    rank = _by_name(spec)[name]
    cfg = layout.kv_transfer_config(spec, rank, cpu)
    assert check_kv_transfer_config(cfg) is None  # the plugin's own validator
    assert cfg["kv_connector"] == "WedgeGuardConnector"
    extra = cfg["kv_connector_extra_config"]
    assert extra["wedge_guard"] == {"policy": "lateral", "stall_alarm_steps": 50}
    mooncake, nixl = extra["connectors"]
    assert [mooncake["kv_connector"], nixl["kv_connector"]] == [
        "MooncakeConnector",
        "NixlConnector",
    ]
    # producer / consumer, never kv_both: a kv_both decode registers on the
    # Mooncake bootstrap server and is refused.
    role = "kv_producer" if rank.role == "prefill" else "kv_consumer"
    assert {cfg["kv_role"], mooncake["kv_role"], nixl["kv_role"]} == {role}
    mc_extra = mooncake["kv_connector_extra_config"]
    assert mc_extra["mooncake_protocol"] == ("tcp" if cpu else "rdma")
    assert ("kv_buffer_device" in nixl) is cpu


def test_only_prefills_name_their_loopback_bootstrap_server() -> None:
    spec = ClusterSpec(shape="2p2d", base_port=21000)
    ranks = _by_name(spec)

    def bootstrap(name: str) -> str | None:
        cfg = layout.kv_transfer_config(spec, ranks[name], True)
        mc = cfg["kv_connector_extra_config"]["connectors"][0]
        addr: str | None = mc["kv_connector_extra_config"].get(
            "bootstrap_server_address"
        )
        return addr

    assert bootstrap("prefill-1") == "127.0.0.1:21301"
    assert bootstrap("decode-0") is None


@pytest.mark.parametrize("version", ["0.19.1", "0.22.1", "0.28.0", "0.31.0"])
def test_before_032_each_prefill_serves_its_own_bootstrap_on_the_same_port(
    version: str,
) -> None:
    """vLLM before 0.32 has no ``bootstrap_server_address``: the launcher
    starts no bootstrap of its own, the prefill's engine serves it on the
    port the router is told, and decodes get no such variable."""
    spec = ClusterSpec(shape="2p2d", base_port=21000, vllm_version=version)
    ranks = _by_name(spec)
    assert not spec.external_bootstrap
    for name in ("prefill-0", "prefill-1"):
        cfg = layout.kv_transfer_config(spec, ranks[name], True)
        mc = cfg["kv_connector_extra_config"]["connectors"][0]
        assert "bootstrap_server_address" not in mc["kv_connector_extra_config"]
    env = layout.release_env(spec, ranks["prefill-1"])
    assert env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "21301"
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in layout.release_env(
        spec, ranks["decode-0"]
    )
    router = layout.router_argv(spec, list(ranks.values()))
    assert router[router.index("http://127.0.0.1:21101") + 1] == "21301"
    on_032 = ClusterSpec(shape="2p2d", base_port=21000, vllm_version="0.32.0")
    assert on_032.external_bootstrap
    assert layout.release_env(on_032, ranks["prefill-1"]) == {}


@pytest.mark.parametrize(
    ("version", "store", "seeded"),
    [
        ("0.22.1", True, True),
        ("0.28.0", True, True),
        ("0.29.0", True, False),  # sha256 gets a fixed seed from 0.29
        ("0.32.0", True, False),
        ("0.22.1", False, False),  # no store: nothing to share
    ],
)
def test_store_mode_shares_one_prefix_hash_seed_where_the_release_needs_it(
    version: str, store: bool, seeded: bool
) -> None:
    spec = ClusterSpec(shape="1p2d", store=store, vllm_version=version)
    envs = [layout.release_env(spec, r) for r in layout.ranks(spec, None)]
    seeds = {env.get("PYTHONHASHSEED") for env in envs}
    assert seeds == ({"0"} if seeded else {None})


def test_cpu_server_command_is_the_api_module_on_loopback() -> None:
    spec = ClusterSpec(decode_blocks=5, server_args=("--seed", "1"))
    ranks = _by_name(spec)
    argv = layout.server_argv(spec, ranks["decode-0"], "/m", cpu=True)
    # not the `vllm` CLI: it needs package metadata named "vllm"
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert _arg(argv, "--host") == "127.0.0.1"
    assert _arg(argv, "--port") == str(ranks["decode-0"].port)
    assert _arg(argv, "--model") == "/m"
    assert _arg(argv, "--dtype") == "float32"
    assert "--enforce-eager" in argv
    assert _arg(argv, "--num-gpu-blocks-override") == "5"
    assert argv[-2:] == ["--seed", "1"]  # user arguments last: they win
    assert _ktc(argv)["kv_role"] == "kv_consumer"
    prefill = layout.server_argv(spec, ranks["prefill-0"], "/m", cpu=True)
    assert "--num-gpu-blocks-override" not in prefill  # only decodes are small


def test_gpu_server_command_keeps_vllms_defaults() -> None:
    spec = ClusterSpec()
    argv = layout.server_argv(spec, _by_name(spec)["prefill-0"], "org/m", cpu=False)
    assert "--dtype" not in argv
    assert "--enforce-eager" not in argv


def test_reference_server_has_no_kv_transfer() -> None:
    spec = ClusterSpec()
    argv = layout.reference_argv(spec, "/m", port=21600, cpu=True)
    assert "--kv-transfer-config" not in argv
    assert _arg(argv, "--port") == "21600"
    rank_argv = layout.server_argv(spec, _by_name(spec)["decode-0"], "/m", cpu=True)
    # the same model settings as the ranks, so outputs can be compared
    for flag in ("--model", "--max-model-len", "--dtype", "--served-model-name"):
        assert _arg(argv, flag) == _arg(rank_argv, flag)


def test_cpu_environment_pins_and_stays_on_loopback(tmp_path: Any) -> None:
    spec = ClusterSpec(base_port=21000)
    rank = _by_name(spec, [0, 1])["decode-1"]
    env = layout.server_env(rank, cpu=True, cache=tmp_path)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "21451"
    assert env["VLLM_HOST_IP"] == env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["UCX_NET_DEVICES"] == "lo"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_gpu_environment_gives_each_rank_its_gpu(tmp_path: Any) -> None:
    spec = ClusterSpec(shape="2p2d")
    gpus = [
        layout.server_env(r, cpu=False, cache=tmp_path)["CUDA_VISIBLE_DEVICES"]
        for r in layout.ranks(spec, None)
    ]
    assert gpus == ["0", "1", "2", "3"]


@pytest.mark.parametrize("kv_style", layout.KV_STYLES)
def test_router_lists_every_rank_with_bootstrap_ports(kv_style: str) -> None:
    spec = ClusterSpec(shape="2p2d", base_port=21000, kv_style=kv_style)
    argv = layout.router_argv(spec, layout.ranks(spec, None))
    assert argv[0].endswith("vllm-router")
    assert "--vllm-pd-disaggregation" in argv
    assert _arg(argv, "--kv-connector") == kv_style
    assert _arg(argv, "--port") == "21000"
    assert _arg(argv, "--host") == "127.0.0.1"
    text = " ".join(argv)
    assert "--prefill http://127.0.0.1:21100 21300" in text
    assert "--prefill http://127.0.0.1:21101 21301" in text
    assert text.count("--decode ") == 2
    assert "--decode http://127.0.0.1:21201" in text


def test_transport_port_ranges_are_the_clusters_own(tmp_path: Any) -> None:
    """Mooncake's and UCX's listeners pick ports from ranges above the base
    (the e2e exposure test and the runbook's firewall advice rely on them)."""
    spec = ClusterSpec(base_port=21000)
    rank = _by_name(spec, [0, 1])["prefill-0"]
    env = layout.server_env(rank, cpu=True, cache=tmp_path, ports=spec.ports)
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"]) == ("21600", "21699")
    assert env["UCX_TCP_PORT_RANGE"] == "21700-21999"
    used = set(all_ports(ClusterSpec(shape="2p2d", base_port=21000)))
    assert not used & set(range(21600, 22000))
    assert ClusterSpec(base_port=65535 - layout.PORT_SPAN).ports.ucx_tcp[1] <= 65535


# ---- the listening-socket scanner (tools/cluster/sockets.py) --------------------
def test_proc_net_addresses_decode() -> None:
    import ipaddress

    from vllm_mooncake.tools.cluster.sockets import Listener, decode_address

    assert decode_address("0100007F") == "127.0.0.1"
    assert decode_address("00000000") == "0.0.0.0"
    assert decode_address("00000000000000000000000001000000") == "::1"
    mapped = decode_address("0000000000000000FFFF00000100007F")
    assert ipaddress.ip_address(mapped) == ipaddress.ip_address("::ffff:127.0.0.1")
    assert Listener("tcp", mapped, 1, 1, "p", "o").loopback
    with pytest.raises(ValueError, match="expected 8 or 32 hex digits"):
        decode_address("0100")


def test_scanner_finds_a_processes_listeners_and_tells_loopback() -> None:
    """Real sockets of this process: TCP and UDP, loopback and wildcard."""
    import os
    import socket

    from vllm_mooncake.tools.cluster.sockets import exposed, listening

    socks = []
    try:
        for family, kind, host in [
            (socket.AF_INET, socket.SOCK_STREAM, "127.0.0.1"),
            (socket.AF_INET, socket.SOCK_STREAM, "0.0.0.0"),
            (socket.AF_INET, socket.SOCK_DGRAM, "0.0.0.0"),
            (socket.AF_INET6, socket.SOCK_STREAM, "::1"),
        ]:
            s = socket.socket(family, kind)
            s.bind((host, 0))
            if kind == socket.SOCK_STREAM:
                s.listen()
            socks.append(s)
        connected = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        connected.connect(socks[0].getsockname())  # not a listener
        socks.append(connected)
        mine = {s.getsockname()[1] for s in socks[:4]}
        found = [s for s in listening({"me": [os.getpid()]}) if s.port in mine]
        got = {(s.proto, s.address, s.loopback) for s in found}
        assert got == {
            ("tcp", "127.0.0.1", True),
            ("tcp", "0.0.0.0", False),
            ("udp", "0.0.0.0", False),
            ("tcp", "::1", True),
        }
        assert {s.address for s in exposed(found)} == {"0.0.0.0"}
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("kv_style", layout.KV_STYLES)
def test_store_mode_puts_the_store_first_next_to_one_p2d_child(kv_style: str) -> None:
    spec = ClusterSpec(
        store=True, kv_style=kv_style, kv_load_failure_policy="recompute"
    )
    ranks = _by_name(spec)
    lookup_ports = set()
    for rank in ranks.values():
        cfg = layout.kv_transfer_config(spec, rank, cpu=True)
        assert check_kv_transfer_config(cfg) is None
        assert cfg["kv_load_failure_policy"] == "recompute"
        store, p2d = cfg["kv_connector_extra_config"]["connectors"]
        assert store["kv_connector"] == "MooncakeStoreConnector"
        assert store["kv_role"] == cfg["kv_role"]
        want = "MooncakeConnector" if kv_style == "mooncake" else "NixlConnector"
        assert p2d["kv_connector"] == want
        lookup_ports.add(store["kv_connector_extra_config"]["lookup_rpc_port"])
    # each rank's scheduler finds its own worker's lookup socket
    assert len(lookup_ports) == len(ranks)


@pytest.mark.parametrize(
    ("kv_style", "first", "want"),
    [
        ("nixl", False, ["MooncakeConnector", "NixlConnector"]),
        ("nixl", True, ["NixlConnector", "MooncakeConnector"]),
        ("mooncake", True, ["MooncakeConnector", "NixlConnector"]),
    ],
)
def test_style_child_first_orders_the_p2d_children(
    kv_style: str, first: bool, want: list[str]
) -> None:
    spec = ClusterSpec(kv_style=kv_style, style_child_first=first)
    for rank in _by_name(spec).values():
        cfg = layout.kv_transfer_config(spec, rank, cpu=True)
        children = cfg["kv_connector_extra_config"]["connectors"]
        assert [c["kv_connector"] for c in children] == want


def test_stock_ranks_run_vllms_multiconnector_over_the_same_children() -> None:
    spec = ClusterSpec(
        shape="1p3d",
        store=True,
        policy="reserve+lateral",
        guard_extra={"stall_alarm_s": 2.0},
        rank_connectors={"decode-0": "stock", "decode-2": "reserve"},
    )
    ranks = _by_name(spec)
    cfgs = {n: layout.kv_transfer_config(spec, r, cpu=True) for n, r in ranks.items()}
    assert cfgs["decode-0"]["kv_connector"] == "MultiConnector"
    assert "wedge_guard" not in cfgs["decode-0"]["kv_connector_extra_config"]
    policies = {
        n: c["kv_connector_extra_config"]["wedge_guard"]["policy"]
        for n, c in cfgs.items()
        if n != "decode-0"
    }
    assert policies == {
        "prefill-0": "reserve+lateral",
        "decode-1": "reserve+lateral",
        "decode-2": "reserve",
    }
    # the same children on every decode, stock or guarded (only the lookup
    # socket differs, one per rank)
    kinds = {
        n: [
            (c["kv_connector"], c["kv_role"])
            for c in cfg["kv_connector_extra_config"]["connectors"]
        ]
        for n, cfg in cfgs.items()
        if n.startswith("decode")
    }
    assert len({tuple(k) for k in kinds.values()}) == 1
    everything_stock = ClusterSpec(connector="stock")
    for rank in layout.ranks(everything_stock, None):
        cfg = layout.kv_transfer_config(everything_stock, rank, cpu=True)
        assert cfg["kv_connector"] == "MultiConnector"


def test_store_is_local_and_its_config_names_the_master(tmp_path: Any) -> None:
    spec = ClusterSpec(store=True, base_port=21000, store_client_ttl_s=300)
    cfg = layout.store_config(spec, cpu=True)
    assert cfg["master_server_address"] == "127.0.0.1:21320"
    assert cfg["metadata_server"] == "http://127.0.0.1:21321/metadata"
    assert (cfg["mode"], cfg["global_segment_size"]) == ("standalone-store", 0)
    master = layout.store_master_argv(spec)
    assert "-rpc_address=127.0.0.1" in master
    assert "-http_metadata_server_host=127.0.0.1" in master
    assert "-metrics_host=127.0.0.1" in master
    assert "-client_ttl=300" in master
    segment = layout.store_segment_argv(spec, cpu=True)
    assert "-host=127.0.0.1" in segment
    assert "-master_server_address=127.0.0.1:21320" in segment
    rank = _by_name(spec)["decode-0"]
    path = tmp_path / "store.json"
    env = layout.server_env(rank, True, tmp_path, spec.ports, path)
    assert env["MOONCAKE_CONFIG_PATH"] == str(path)
    assert "MOONCAKE_CONFIG_PATH" not in layout.server_env(rank, True, tmp_path)


def test_unrouted_ranks_stay_out_of_the_router() -> None:
    spec = ClusterSpec(shape="1p2d", base_port=21000, unrouted=("decode-0",))
    argv = layout.router_argv(spec, layout.ranks(spec, None))
    assert "http://127.0.0.1:21200" not in argv
    assert argv[argv.index("http://127.0.0.1:21201") - 1] == "--decode"
