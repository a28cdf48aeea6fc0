"""Every config and manifest under deploy/ is checked, and a broken one fails.

Offline: ``kubectl kustomize`` renders the overlays (kubectl ships with this
machine image), ``kubernetes-validate`` holds the schemas.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from vllm_mooncake.tools.check_config import check_kv_transfer_config
from vllm_mooncake.tools.manifests import (
    check_docs,
    config_map_problems,
    guard_config_problems,
    render,
    router_problems,
    schema_problems,
    service_problems,
)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "deploy" / "configs"
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
SHAPES = {"1p2d": (1, 2), "2p2d": (2, 2), "2p2d-multinode-tp": (2, 2)}


@pytest.mark.parametrize(
    "path", sorted(CONFIGS.glob("*.kv_transfer_config.json")), ids=lambda p: p.name
)
def test_kv_transfer_configs_validate(path: Path) -> None:
    cfg = json.loads(path.read_text())
    assert check_kv_transfer_config(cfg) is None
    assert cfg["kv_connector"] == "WedgeGuardConnector"
    children = [
        c["kv_connector"] for c in cfg["kv_connector_extra_config"]["connectors"]
    ]
    assert "NixlConnector" in children
    role = "kv_producer" if path.name.startswith("prefill") else "kv_consumer"
    nixl = next(
        c
        for c in cfg["kv_connector_extra_config"]["connectors"]
        if c["kv_connector"] == "NixlConnector"
    )
    assert nixl["kv_role"] == role


def test_mooncake_store_config_parses_with_vllms_own_loader() -> None:
    from vllm.distributed.mooncake_store import MooncakeStoreConfig

    store = MooncakeStoreConfig.from_file(str(CONFIGS / "mooncake-store.json"))
    assert store.master_server_address == "mooncake-master:50051"
    assert store.global_segment_size > 0


def test_k8s_config_copies_match_deploy_configs() -> None:
    for copy_ in (K8S / "base" / "kv-transfer").glob("*.json"):
        assert copy_.read_text() == (CONFIGS / copy_.name).read_text(), copy_.name


@pytest.fixture(scope="module", params=OVERLAYS, ids=lambda p: p.name)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param.name, render(request.param)


def test_overlay_is_clean(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    assert check_docs(docs) == []


def test_overlay_has_the_shape_it_names(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    name, docs = rendered
    replicas = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["replicas"]
        for d in docs
        if d["kind"] in ("StatefulSet", "LeaderWorkerSet")
    }
    assert (replicas["prefill"], replicas["decode"]) == SHAPES[name]


def test_ranks_get_their_pd_environment(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    for doc in docs:
        if doc["kind"] not in ("StatefulSet",):
            continue
        container = doc["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert (
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
            == "status.podIP"
        )
        nixl_port = next(p for p in container["ports"] if p["name"] == "nixl")
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == str(
            nixl_port["containerPort"]
        )
        assert "UCX_TLS" in env and "MOONCAKE_CONFIG_PATH" in env
        assert "--kv-transfer-config" in container["args"][0]
        assert container["image"].startswith("ghcr.io/vllm-mooncake/vllm-mooncake:")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] == "/health"


def test_image_installs_the_plugin() -> None:
    dockerfile = (K8S / "Dockerfile").read_text()
    assert "vllm/vllm-openai:v0.32.0" in dockerfile
    assert "/opt/vllm-mooncake" in dockerfile and "vllm-router" in dockerfile


# ---- a broken manifest fails ---------------------------------------------------
def _doc(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(
        d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)
    )


@pytest.fixture(scope="module")
def base_1p2d() -> list[dict[str, Any]]:
    return render(K8S / "overlays" / "1p2d")


def test_selector_typo_is_caught(base_1p2d: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(base_1p2d)
    _doc(docs, "Service", "vllm-decode")["spec"]["selector"][
        "app.kubernetes.io/component"
    ] = "decoder"
    assert any("matches no pod template" in p for p in service_problems(docs))


def test_wrong_target_port_is_caught(base_1p2d: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(base_1p2d)
    _doc(docs, "Service", "mooncake-master")["spec"]["ports"][0]["targetPort"] = "grpc"
    assert any("targetPort 'grpc'" in p for p in service_problems(docs))


def test_missing_config_map_and_key_are_caught(base_1p2d: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(base_1p2d)
    cm = _doc(docs, "ConfigMap", "vllm-mooncake-config")
    del cm["data"]["decode.kv_transfer_config.json"]
    assert any("not a key of" in p for p in config_map_problems(docs))
    cm["metadata"]["name"] = "renamed"
    assert any("missing ConfigMap" in p for p in config_map_problems(docs))


def test_router_member_list_is_checked_against_replicas(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    _doc(docs, "StatefulSet", "vllm-decode")["spec"]["replicas"] = 3
    assert any("--decode lists" in p for p in router_problems(docs))


def test_wrong_connector_in_config_map_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    cm = _doc(docs, "ConfigMap", "vllm-mooncake-config")
    cfg = json.loads(cm["data"]["prefill.kv_transfer_config.json"])
    cfg["kv_connector_extra_config"]["wedge_guard"]["policy"] = "sometimes"
    cm["data"]["prefill.kv_transfer_config.json"] = json.dumps(cfg)
    assert any("policy" in p for p in guard_config_problems(docs))


def test_wrong_mooncake_master_address_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    cm = _doc(docs, "ConfigMap", "vllm-mooncake-config")
    store = json.loads(cm["data"]["mooncake-store.json"])
    store["master_server_address"] = "mooncake-master:50052"
    cm["data"]["mooncake-store.json"] = json.dumps(store)
    assert any("master_server_address" in p for p in guard_config_problems(docs))


def test_schema_violation_is_caught(base_1p2d: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(base_1p2d)
    _doc(docs, "StatefulSet", "vllm-prefill")["spec"]["replicas"] = "one"
    assert any("schema" in p for p in schema_problems(docs))
