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
    READY_TOOL,
    api_key_problems,
    check_docs,
    config_map_problems,
    guard_config_problems,
    network_policy_problems,
    render,
    rollout_problems,
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
        for probe in ("startupProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] == "/health"
        # readiness: the guard's stuck gauge too (below)
        assert READY_TOOL in container["readinessProbe"]["exec"]["command"]


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


# ---- the deployment arrives closed: NetworkPolicies and the API key ------------
def _policy(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(
        d
        for d in docs
        if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == name
    )


def _kv_rule(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The rule of a rank's policy that admits the KV plane."""
    rules = _policy(docs, name)["spec"]["ingress"]
    return next(r for r in rules if any(p["port"] == "nixl" for p in r["ports"]))


def _env(container: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in container["env"] if e["name"] == name)


def _one(problems: list[str], *words: str) -> None:
    """Exactly the problems naming every word; at least one of them."""
    hits = [p for p in problems if all(w in p for w in words)]
    assert hits, f"no problem naming {words} in {problems}"


def test_every_pod_is_under_a_policy_and_the_key(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    assert network_policy_problems(docs) == []
    assert api_key_problems(docs) == []
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert {"vllm-pd-default-deny", "vllm-router", "vllm-prefill"} <= names
    assert {"vllm-decode", "mooncake-master"} <= names


def test_rank_environment_matches_the_policy_ports(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """The ranges the policies open are the ones UCX and Mooncake use."""
    _, docs = rendered
    rule = _kv_rule(docs, "vllm-decode")
    ranges = {(p["port"], p.get("endPort")) for p in rule["ports"]}
    for doc in docs:
        for _, tmpl in _templates(doc):
            for c in tmpl["spec"]["containers"]:
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                if "UCX_TLS" not in env:
                    continue
                ucx = tuple(int(x) for x in env["UCX_TCP_PORT_RANGE"].split("-"))
                mc = (int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"]))
                assert ucx in ranges and mc in ranges, (c["name"], ranges)


def _templates(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    from vllm_mooncake.tools.manifests import pod_templates

    return list(pod_templates(doc))


def test_missing_policy_is_caught(base_1p2d: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(base_1p2d)
    docs.remove(_policy(docs, "mooncake-master"))
    _one(network_policy_problems(docs), "Deployment/mooncake-master", "default deny")
    docs.remove(_policy(docs, "vllm-pd-default-deny"))
    problems = network_policy_problems(docs)
    _one(problems, "no default-deny NetworkPolicy")
    _one(problems, "Deployment/mooncake-master", "no NetworkPolicy selects it")


def test_kv_port_open_to_every_source_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    del _kv_rule(docs, "vllm-decode")["from"]
    _one(network_policy_problems(docs), "StatefulSet/vllm-decode", "every source")


def test_kv_port_open_to_the_namespace_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    _kv_rule(docs, "vllm-prefill")["from"] = [{"podSelector": {}}]
    _one(network_policy_problems(docs), "vllm-prefill", "any pod of the namespace")


def test_kv_port_open_to_the_router_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    router_rule = _policy(docs, "vllm-decode")["spec"]["ingress"][0]
    router_rule["ports"].append({"protocol": "TCP", "port": "nixl"})
    _one(network_policy_problems(docs), "KV port(s) 5600", "Deployment/vllm-router")


def test_http_port_open_to_other_ranks_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    _kv_rule(docs, "vllm-decode")["ports"].append({"protocol": "TCP", "port": "http"})
    _one(network_policy_problems(docs), "HTTP port is open to StatefulSet/vllm-prefill")


def test_store_open_beyond_the_ranks_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    rule = _policy(docs, "mooncake-master")["spec"]["ingress"][0]
    rule["from"].append({"namespaceSelector": {}})
    _one(network_policy_problems(docs), "mooncake-master", "namespaceSelector")
    docs = copy.deepcopy(base_1p2d)
    _policy(docs, "mooncake-master")["spec"]["ingress"].append(
        {
            "from": [
                {
                    "podSelector": {
                        "matchLabels": {
                            "app.kubernetes.io/part-of": "vllm-pd",
                            "app.kubernetes.io/name": "vllm-router",
                        }
                    }
                }
            ],
            "ports": [{"protocol": "TCP", "port": "metrics"}],
        }
    )
    _one(network_policy_problems(docs), "9003", "open to Deployment/vllm-router")


def test_rank_without_the_kv_plane_label_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    tmpl = _doc(docs, "StatefulSet", "vllm-prefill")["spec"]["template"]
    del tmpl["metadata"]["labels"]["vllm-mooncake/kv-plane"]
    _one(network_policy_problems(docs), "StatefulSet/vllm-prefill", "kv-plane")


def test_missing_secret_reference_is_caught(base_1p2d: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(base_1p2d)
    router = _doc(docs, "Deployment", "vllm-router")["spec"]["template"]["spec"]
    router["containers"][0]["env"] = []
    _one(api_key_problems(docs), "Deployment/vllm-router", "no OPENAI_API_KEY")
    docs = copy.deepcopy(base_1p2d)
    decode = _doc(docs, "StatefulSet", "vllm-decode")["spec"]["template"]["spec"]
    container = decode["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != "VLLM_API_KEY"]
    _one(api_key_problems(docs), "StatefulSet/vllm-decode", "no VLLM_API_KEY")


def test_api_key_not_from_the_secret_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    prefill = _doc(docs, "StatefulSet", "vllm-prefill")["spec"]["template"]["spec"]
    key = _env(prefill["containers"][0], "VLLM_API_KEY")
    key.pop("valueFrom")
    key["value"] = "hunter2"
    _one(api_key_problems(docs), "vllm-prefill", "not read from a Secret")

    docs = copy.deepcopy(base_1p2d)
    router = _doc(docs, "Deployment", "vllm-router")["spec"]["template"]["spec"]
    ref = _env(router["containers"][0], "OPENAI_API_KEY")["valueFrom"]
    ref["secretKeyRef"]["name"] = "another-key"
    _one(api_key_problems(docs), "different API keys")
    ref["secretKeyRef"]["name"] = "vllm-api-key"
    ref["secretKeyRef"]["optional"] = True
    _one(api_key_problems(docs), "vllm-router", "optional")

    docs = copy.deepcopy(base_1p2d)
    prefill = _doc(docs, "StatefulSet", "vllm-prefill")["spec"]["template"]["spec"]
    prefill["containers"][0]["args"][0] += " --api-key hunter2"
    _one(api_key_problems(docs), "vllm-prefill", "--api-key on the command line")


def test_shipped_secret_must_hold_the_key(base_1p2d: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(base_1p2d)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "vllm-api-key"},
        "stringData": {"api-key": "x"},
    }
    assert api_key_problems([*docs, secret]) == []
    secret["stringData"] = {"token": "x"}
    _one(api_key_problems([*docs, secret]), "Secret/vllm-api-key", "api-key")


def test_multinode_group_rule_stays_inside_the_group() -> None:
    """The LWS group rule opens every port, but only between the group's pods."""
    docs = render(K8S / "overlays" / "2p2d-multinode-tp")
    assert network_policy_problems(docs) == []
    del _policy(docs, "vllm-decode-group")["spec"]["ingress"][0]["from"]
    problems = network_policy_problems(docs)
    _one(problems, "LeaderWorkerSet/vllm-decode.leaderTemplate", "every source")
    _one(problems, "LeaderWorkerSet/vllm-decode.workerTemplate", "every source")


# ---- rollouts: readiness from the guard, drain, strategies, budgets ---------------
def _servers(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(where, container) of every container running vLLM's server."""
    return [
        (where, c)
        for d in docs
        for where, tmpl in _templates(d)
        for c in tmpl["spec"]["containers"]
        if "vllm serve" in " ".join(c.get("command", []) + c.get("args", []))
    ]


def _recv_deadline_s(docs: list[dict[str, Any]], key: str) -> float:
    from vllm_mooncake.guard.config import GuardConfig

    cm = _doc(docs, "ConfigMap", "vllm-mooncake-config")
    extra = json.loads(cm["data"][key])["kv_connector_extra_config"]
    return float(GuardConfig.from_extra_config(extra).recv_deadline_s)


def test_rollouts_are_clean(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    assert rollout_problems(docs) == []


def test_every_server_is_unready_within_twice_the_deadline(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """The probe runs the ready tool on the rank's own port; a stuck rank
    (the gauge is 1 after recv_deadline_s) fails it failureThreshold times,
    periodSeconds apart, the last taking up to timeoutSeconds."""
    name, docs = rendered
    servers = _servers(docs)
    assert len(servers) == 2  # prefill and decode templates
    for where, c in servers:
        probe = c["readinessProbe"]
        command = probe["exec"]["command"]
        assert command[:3] == ["python", "-m", READY_TOOL], where
        http = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
        assert command[command.index("--url") + 1] == f"http://127.0.0.1:{http}"
        key = "prefill" if "prefill" in c["args"][0] else "decode"
        deadline = _recv_deadline_s(docs, f"{key}.kv_transfer_config.json")
        worst = (
            deadline
            + probe["failureThreshold"] * probe["periodSeconds"]
            + probe["timeoutSeconds"]
        )
        assert worst <= 2 * deadline, (name, where, worst)
        # the tool's two requests fit in the probe's timeout
        assert (
            2 * float(command[command.index("--timeout") + 1]) < probe["timeoutSeconds"]
        )


def test_every_server_drains_before_sigterm_within_its_grace(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    for d in docs:
        for where, tmpl in _templates(d):
            for c in tmpl["spec"]["containers"]:
                if "vllm serve" not in " ".join(c.get("args", [])):
                    continue
                hook = c["lifecycle"]["preStop"]["exec"]["command"]
                assert hook[:3] == ["python", "-m", READY_TOOL], where
                drain = float(hook[hook.index("--drain") + 1])
                grace = tmpl["spec"]["terminationGracePeriodSeconds"]
                assert grace >= drain + 30, where


def test_ranks_roll_one_at_a_time_and_the_master_new_before_old(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    for d in docs:
        if d["kind"] == "StatefulSet":
            strategy = d["spec"]["updateStrategy"]
            assert strategy["type"] == "RollingUpdate"
            assert strategy["rollingUpdate"]["maxUnavailable"] == 1
        elif d["kind"] == "LeaderWorkerSet":
            strategy = d["spec"]["rolloutStrategy"]
            assert strategy["type"] == "RollingUpdate"
            assert strategy["rollingUpdateConfiguration"]["maxUnavailable"] == 1
    master = _doc(docs, "Deployment", "mooncake-master")["spec"]["strategy"]
    assert master == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


def test_disruption_budgets(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    budgets = {
        d["metadata"]["name"]: d["spec"]
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
    }
    decode = "vllm-decode-group" if name == "2p2d-multinode-tp" else "vllm-decode"
    assert set(budgets) == {"vllm-prefill", decode, "mooncake-master"}
    assert budgets["mooncake-master"]["maxUnavailable"] == 0
    assert budgets["vllm-prefill"]["maxUnavailable"] == 1
    assert budgets[decode]["maxUnavailable"] == 1


def _server_container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    container: dict[str, Any] = _doc(docs, "StatefulSet", name)["spec"]["template"][
        "spec"
    ]["containers"][0]
    return container


@pytest.mark.parametrize("rank", ["vllm-prefill", "vllm-decode"])
def test_readiness_without_the_guard_is_caught(
    base_1p2d: list[dict[str, Any]], rank: str
) -> None:
    docs = copy.deepcopy(base_1p2d)
    del _server_container(docs, rank)["readinessProbe"]
    _one(rollout_problems(docs), f"StatefulSet/{rank}", "readinessProbe does not run")
    docs = copy.deepcopy(base_1p2d)
    _server_container(docs, rank)["readinessProbe"] = {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": 5,
    }
    _one(rollout_problems(docs), f"StatefulSet/{rank}", "/health stays 200")


def test_readiness_on_another_port_is_caught(base_1p2d: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(base_1p2d)
    command = _server_container(docs, "vllm-decode")["readinessProbe"]["exec"][
        "command"
    ]
    command[command.index("--url") + 1] = "http://127.0.0.1:8080"
    _one(rollout_problems(docs), "vllm-decode", "not http://127.0.0.1:8000")


def test_readiness_too_slow_for_the_deadline_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    probe = _server_container(docs, "vllm-prefill")["readinessProbe"]
    probe["periodSeconds"] = 60  # 3 x 60 + 5 > 120
    _one(rollout_problems(docs), "vllm-prefill", "beyond 2 x recv_deadline_s = 240 s")
    # the bound follows the deadline in the ConfigMap the rank reads
    docs = copy.deepcopy(base_1p2d)
    cm = _doc(docs, "ConfigMap", "vllm-mooncake-config")
    cfg = json.loads(cm["data"]["decode.kv_transfer_config.json"])
    cfg["kv_connector_extra_config"]["wedge_guard"]["recv_deadline_s"] = 20
    cm["data"]["decode.kv_transfer_config.json"] = json.dumps(cfg)
    problems = rollout_problems(docs)
    _one(problems, "vllm-decode", "20 + 35 s", "2 x recv_deadline_s = 40 s")
    assert not [p for p in problems if "vllm-prefill" in p]


@pytest.mark.parametrize("probe", ["startupProbe", "livenessProbe"])
def test_losing_the_startup_or_liveness_probe_is_caught(
    base_1p2d: list[dict[str, Any]], probe: str
) -> None:
    docs = copy.deepcopy(base_1p2d)
    del _server_container(docs, "vllm-decode")[probe]
    _one(rollout_problems(docs), "vllm-decode", f"no {probe} on /health")


def test_missing_drain_or_short_grace_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    del _server_container(docs, "vllm-decode")["lifecycle"]
    _one(rollout_problems(docs), "vllm-decode", "no preStop hook")
    docs = copy.deepcopy(base_1p2d)
    spec = _doc(docs, "StatefulSet", "vllm-prefill")["spec"]["template"]["spec"]
    spec["terminationGracePeriodSeconds"] = 60  # drain 120 s
    _one(rollout_problems(docs), "vllm-prefill", "terminationGracePeriodSeconds 60")
    del spec["terminationGracePeriodSeconds"]  # Kubernetes' 30 s
    _one(rollout_problems(docs), "vllm-prefill", "terminationGracePeriodSeconds 30")


def test_rank_strategy_that_takes_more_than_one_down_is_caught(
    base_1p2d: list[dict[str, Any]],
) -> None:
    docs = copy.deepcopy(base_1p2d)
    decode = _doc(docs, "StatefulSet", "vllm-decode")["spec"]
    decode["updateStrategy"]["rollingUpdate"]["maxUnavailable"] = 2
    _one(rollout_problems(docs), "StatefulSet/vllm-decode", "one at a time")
    decode["updateStrategy"] = {"type": "OnDelete"}
    _one(rollout_problems(docs), "StatefulSet/vllm-decode", "OnDelete")


@pytest.mark.parametrize(
    "strategy",
    [
        {"type": "Recreate"},
        {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
        },
        {},
    ],
    ids=["recreate", "no-surge", "default"],
)
def test_master_strategy_that_stops_it_first_is_caught(
    base_1p2d: list[dict[str, Any]], strategy: dict[str, Any]
) -> None:
    docs = copy.deepcopy(base_1p2d)
    spec = _doc(docs, "Deployment", "mooncake-master")["spec"]
    if strategy:
        spec["strategy"] = strategy
    else:
        del spec["strategy"]
    _one(rollout_problems(docs), "Deployment/mooncake-master", "new-before-old")


def test_budget_problems_are_caught(base_1p2d: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(base_1p2d)
    docs.remove(_doc(docs, "PodDisruptionBudget", "vllm-prefill"))
    _one(rollout_problems(docs), "StatefulSet/vllm-prefill", "0 PodDisruptionBudgets")
    docs = copy.deepcopy(base_1p2d)
    _doc(docs, "PodDisruptionBudget", "mooncake-master")["spec"]["maxUnavailable"] = 1
    _one(rollout_problems(docs), "Deployment/mooncake-master", "allow no eviction")
    docs = copy.deepcopy(base_1p2d)
    _doc(docs, "PodDisruptionBudget", "vllm-decode")["spec"]["maxUnavailable"] = 2
    _one(rollout_problems(docs), "StatefulSet/vllm-decode", "one rank go at a time")
    docs = copy.deepcopy(base_1p2d)
    extra = copy.deepcopy(_doc(docs, "PodDisruptionBudget", "vllm-decode"))
    extra["metadata"]["name"] = "vllm-all"
    del extra["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
    docs.append(extra)
    problems = rollout_problems(docs)
    _one(problems, "StatefulSet/vllm-decode", "2 PodDisruptionBudgets")
    _one(problems, "StatefulSet/vllm-prefill", "2 PodDisruptionBudgets")


def test_multinode_group_keeps_readiness_drain_and_its_budget() -> None:
    docs = render(K8S / "overlays" / "2p2d-multinode-tp")
    lws = _doc(docs, "LeaderWorkerSet", "vllm-decode")
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    del leader["containers"][0]["readinessProbe"]
    del leader["containers"][0]["lifecycle"]
    problems = rollout_problems(docs)
    _one(problems, "LeaderWorkerSet/vllm-decode.leaderTemplate", "readinessProbe")
    _one(problems, "LeaderWorkerSet/vllm-decode.leaderTemplate", "no preStop hook")
    docs = render(K8S / "overlays" / "2p2d-multinode-tp")
    docs.remove(_doc(docs, "PodDisruptionBudget", "vllm-decode-group"))
    problems = rollout_problems(docs)
    _one(problems, "LeaderWorkerSet/vllm-decode.leaderTemplate", "0 PodDisruption")
    _one(problems, "LeaderWorkerSet/vllm-decode.workerTemplate", "0 PodDisruption")
    lws = _doc(docs, "LeaderWorkerSet", "vllm-decode")
    lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["maxUnavailable"] = 2
    _one(rollout_problems(docs), "LeaderWorkerSet/vllm-decode", "one at a time")
