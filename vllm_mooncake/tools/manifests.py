"""Offline checks of the Kubernetes manifests: schemas and cross-references.

``python -m vllm_mooncake.tools.manifests OVERLAY_DIR [...]`` renders each
overlay with ``kubectl kustomize``, validates every built-in object against
the Kubernetes schemas (``kubernetes-validate``, no cluster needed; a
LeaderWorkerSet's pod templates are validated as PodTemplates), then checks
what a schema cannot: Service selectors match pods, target ports exist,
referenced ConfigMaps and keys exist, the router lists exactly the prefill
and decode pods, the Mooncake store config points at the master Service, and
every kv_transfer_config in a ConfigMap names the guard connector and passes
its validation; and that the deployment arrives closed: NetworkPolicies
(:func:`network_policy_problems`) and the API key from a Secret
(:func:`api_key_problems`). Exit code 0 when clean, 1 with one line per
problem.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

K8S_VERSION = "1.32.0"
Doc = dict[str, Any]
POD_OWNERS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def render(overlay: Path) -> list[Doc]:
    """``kubectl kustomize OVERLAY`` as a list of objects."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl is needed to render kustomize overlays")
    out = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"kubectl kustomize {overlay} failed: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _name(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def pod_templates(doc: Doc) -> Iterator[tuple[str, Doc]]:
    """(where, pod template) for every pod a workload would create."""
    if doc["kind"] in POD_OWNERS:
        yield _name(doc), doc["spec"]["template"]
    elif doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        for part in ("leaderTemplate", "workerTemplate"):
            if part in lwt:
                yield f"{_name(doc)}.{part}", lwt[part]


# ---- schemas ----------------------------------------------------------------
def schema_problems(docs: Iterable[Doc], version: str = K8S_VERSION) -> list[str]:
    import kubernetes_validate

    problems = []
    for doc in docs:
        if doc["kind"] == "LeaderWorkerSet":
            targets = [
                (
                    where,
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": "t"},
                        "template": tmpl,
                    },
                )
                for where, tmpl in pod_templates(doc)
            ]
        else:
            targets = [(_name(doc), doc)]
        for where, obj in targets:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = "/".join(str(p) for p in exc.path)
                problems.append(f"{where}: schema: {exc.message} (at {path})")
    return problems


# ---- cross-references -------------------------------------------------------
def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _containers(tmpl: Doc) -> list[Doc]:
    spec = tmpl.get("spec", {})
    return list(spec.get("containers", [])) + list(spec.get("initContainers", []))


def service_problems(docs: list[Doc]) -> list[str]:
    problems = []
    templates = [t for d in docs for t in pod_templates(d)]
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"].get("selector") or {}
        pods = [
            (w, t)
            for w, t in templates
            if _matches(selector, t.get("metadata", {}).get("labels", {}))
        ]
        if not pods:
            problems.append(
                f"{_name(svc)}: selector {selector} matches no pod template"
            )
            continue
        port_names = {
            p.get("name")
            for _, t in pods
            for c in _containers(t)
            for p in c.get("ports", [])
        }
        port_numbers = {
            p.get("containerPort")
            for _, t in pods
            for c in _containers(t)
            for p in c.get("ports", [])
        }
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port.get("port"))
            if target not in port_names | port_numbers:
                problems.append(
                    f"{_name(svc)}: targetPort {target!r} is not a container port "
                    f"of {[w for w, _ in pods]}"
                )
    return problems


def _config_maps(docs: list[Doc]) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}


def config_map_problems(docs: list[Doc]) -> list[str]:
    problems = []
    maps = _config_maps(docs)
    for doc in docs:
        for where, tmpl in pod_templates(doc):
            volumes = {v["name"]: v for v in tmpl["spec"].get("volumes", [])}
            for vol in volumes.values():
                ref = vol.get("configMap", {}).get("name")
                if ref and ref not in maps:
                    problems.append(
                        f"{where}: volume {vol['name']} uses missing ConfigMap {ref}"
                    )
            for c in _containers(tmpl):
                for src in c.get("envFrom", []):
                    ref = src.get("configMapRef", {}).get("name")
                    if ref and ref not in maps:
                        problems.append(
                            f"{where}: envFrom uses missing ConfigMap {ref}"
                        )
                problems += _mounted_file_problems(where, c, volumes, maps)
    return problems


def _mounted_file_problems(
    where: str, container: Doc, volumes: dict[str, Doc], maps: dict[str, Doc]
) -> list[str]:
    """Files a container reads (args, env) from a ConfigMap mount must exist."""
    problems = []
    text = " ".join(container.get("args", []) + container.get("command", []))
    text += " " + " ".join(str(e.get("value", "")) for e in container.get("env", []))
    for mount in container.get("volumeMounts", []):
        ref = volumes.get(mount["name"], {}).get("configMap", {}).get("name")
        if ref not in maps:
            continue
        keys = set(maps[ref].get("data", {}))
        prefix = mount["mountPath"].rstrip("/") + "/"
        for used in re.findall(re.escape(prefix) + r"([\w.\-]+)", text):
            if used not in keys:
                problems.append(f"{where}: reads {prefix}{used}, not a key of {ref}")
    return problems


def router_problems(docs: list[Doc]) -> list[str]:
    """The router's --prefill/--decode lists must be exactly the rank pods."""
    problems = []
    ranks = {
        d["metadata"]["labels"].get("app.kubernetes.io/component"): d
        for d in docs
        if d["kind"] in ("StatefulSet", "LeaderWorkerSet")
    }
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for doc in docs:
        if doc["kind"] != "Deployment" or "router" not in doc["metadata"]["name"]:
            continue
        args = doc["spec"]["template"]["spec"]["containers"][0].get("args", [])
        for role in ("prefill", "decode"):
            listed = sorted(
                a.split("=", 1)[1] for a in args if a.startswith(f"--{role}=")
            )
            rank = ranks.get(role)
            if rank is None:
                problems.append(f"{_name(doc)}: no {role} workload to route to")
                continue
            name = rank["metadata"]["name"]
            service = rank["spec"].get("serviceName", name)
            if service not in services:
                problems.append(f"{_name(rank)}: headless Service {service} is missing")
            port = _http_port(services.get(service))
            expected = sorted(
                f"http://{name}-{i}.{service}:{port}"
                for i in range(int(rank["spec"].get("replicas", 1)))
            )
            if listed != expected:
                problems.append(
                    f"{_name(doc)}: --{role} lists {listed}, pods are {expected}"
                )
    return problems


def _http_port(service: Doc | None) -> int | None:
    if service is None:
        return None
    for port in service["spec"].get("ports", []):
        if port.get("name") == "http":
            return int(port["port"])
    return None


def guard_config_problems(docs: list[Doc]) -> list[str]:
    """kv_transfer_config files name the guard connector and validate."""
    from vllm_mooncake.tools.check_config import check_kv_transfer_config

    problems = []
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for name, cm in _config_maps(docs).items():
        for key, text in cm.get("data", {}).items():
            if key.endswith("kv_transfer_config.json"):
                error = check_kv_transfer_config(json.loads(text))
                if error:
                    problems.append(f"ConfigMap/{name}[{key}]: {error}")
            elif key == "mooncake-store.json":
                problems += _mooncake_store_problems(
                    name, key, json.loads(text), services
                )
    return problems


def _mooncake_store_problems(
    cm: str, key: str, store: Doc, services: dict[str, Doc]
) -> list[str]:
    host, _, port = str(store.get("master_server_address", "")).partition(":")
    svc = services.get(host)
    ports = {p["port"] for p in svc["spec"]["ports"]} if svc else set()
    if svc is None or not port.isdigit() or int(port) not in ports:
        return [
            f"ConfigMap/{cm}[{key}]: master_server_address "
            f"{store.get('master_server_address')!r} is no Service port"
        ]
    return []


# ---- exposure: NetworkPolicies and the API key ----------------------------------
PART_OF = "app.kubernetes.io/part-of"
KV_PLANE_LABEL = "vllm-mooncake/kv-plane"
HTTP_PORT = "http"
# Which containers play which part, by what they run.
ROLE_MARKERS = (
    ("router", ("vllm-router",)),
    ("vllm", ("vllm serve", "ray start")),
    ("master", ("mooncake_master",)),
)
# The env var each serving container reads the API key from: vLLM's server
# (VLLM_API_KEY, like --api-key) and vllm-router, which sends
# `Authorization: Bearer $OPENAI_API_KEY` on every request it relays in PD mode.
API_KEY_ENV = {"vllm": "VLLM_API_KEY", "router": "OPENAI_API_KEY"}
PortRange = tuple[int, int]
ALL_PORTS: PortRange = (1, 65535)


@dataclass(frozen=True)
class _Pod:
    """One pod template, with what the exposure checks need of it."""

    where: str  # "StatefulSet/vllm-decode", "LeaderWorkerSet/x.workerTemplate"
    owner: str  # the workload: "LeaderWorkerSet/x" for both of its templates
    role: str  # "router" | "vllm" | "master" | "other"
    labels: dict[str, str]
    port_names: dict[str, int]
    template: Doc


def _container_text(container: Doc) -> str:
    """The container's command line, as one string."""
    return " ".join(
        str(a) for a in container.get("command", []) + container.get("args", [])
    )


def _role_of(container: Doc) -> str:
    """router / vllm / master / other, by what the container runs."""
    text = _container_text(container)
    for role, markers in ROLE_MARKERS:
        if any(m in text for m in markers):
            return role
    return "other"


def _pods(docs: list[Doc]) -> list[_Pod]:
    """Every pod template of the render, with its role, labels and ports."""
    pods = []
    for doc in docs:
        for where, tmpl in pod_templates(doc):
            containers = _containers(tmpl)
            roles = [_role_of(c) for c in containers]
            role = next((r for r, _ in ROLE_MARKERS if r in roles), "other")
            names = {
                str(p["name"]): int(p["containerPort"])
                for c in containers
                for p in c.get("ports", [])
                if "name" in p
            }
            labels = dict(tmpl.get("metadata", {}).get("labels", {}))
            pods.append(_Pod(where, _name(doc), role, labels, names, tmpl))
    return pods


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions) matches."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and present and labels[key] in values)
            or (op == "Exists" and not present)
            or (op == "DoesNotExist" and present)
        ):
            return False
    return True


def _policies_for(pod: _Pod, policies: list[Doc]) -> list[Doc]:
    """The NetworkPolicies that restrict ``pod``'s ingress."""
    return [
        np
        for np in policies
        if "Ingress" in np["spec"].get("policyTypes", ["Ingress"])
        and selects(np["spec"].get("podSelector") or {}, pod.labels)
    ]


def _rule_ports(rule: Doc, pod: _Pod) -> list[PortRange]:
    """The port ranges an ingress rule opens on ``pod`` (no list: all)."""
    if not rule.get("ports"):
        return [ALL_PORTS]
    out = []
    for entry in rule["ports"]:
        port = entry.get("port")
        if port is None:
            out.append(ALL_PORTS)
        elif isinstance(port, str):
            if port in pod.port_names:  # a name the pod lacks opens nothing
                number = pod.port_names[port]
                out.append((number, number))
        else:
            out.append((int(port), int(entry.get("endPort", port))))
    return out


def _show(ranges: list[PortRange]) -> str:
    if ALL_PORTS in ranges:
        return "every port"
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _peer(peer: Doc, pods: list[_Pod]) -> tuple[list[_Pod] | None, str]:
    """The deployment's pods a ``from`` entry admits, with its description;
    None when it admits anything beyond the deployment's pods."""
    if "ipBlock" in peer:
        return None, f"ipBlock {peer['ipBlock'].get('cidr')}"
    if "namespaceSelector" in peer:
        return None, "a namespaceSelector (pods of other namespaces)"
    selector = peer.get("podSelector") or {}
    match = selector.get("matchLabels") or {}
    if PART_OF not in match:
        return None, (
            f"podSelector {match or '{}'} (any pod of the namespace: pin it to "
            f"the deployment with {PART_OF})"
        )
    return [p for p in pods if selects(selector, p.labels)], f"podSelector {match}"


def _pod_http_port(pod: _Pod) -> int | None:
    """The number of the pod's container port named ``http``, if any."""
    return pod.port_names.get(HTTP_PORT)


def _covers(ranges: list[PortRange], port: int | None) -> bool:
    return port is not None and any(a <= port <= b for a, b in ranges)


def _only(ranges: list[PortRange], port: int | None) -> bool:
    return port is not None and all(a == b == port for a, b in ranges)


def _admission_problems(pod: _Pod, policy: Doc, pods: list[_Pod]) -> list[str]:
    """What one policy lets reach ``pod`` that it should not."""
    problems = []
    http = _pod_http_port(pod)
    for rule in policy["spec"].get("ingress") or []:
        ranges = _rule_ports(rule, pod)
        if not ranges:
            continue
        shown = f"port(s) {_show(ranges)} of {pod.where} (NetworkPolicy/"
        shown += f"{policy['metadata']['name']})"
        for peer in rule.get("from") or [{"ipBlock": {"cidr": "every source"}}]:
            admitted, desc = _peer(peer, pods)
            if admitted is None:
                if pod.role == "router" and _only(ranges, http):
                    continue  # the API entry point: open to its clients
                problems.append(f"{shown} open to {desc}")
                continue
            for other in admitted:
                problems += _peer_problems(pod, other, ranges, shown, http)
    return problems


def _peer_problems(
    pod: _Pod, other: _Pod, ranges: list[PortRange], shown: str, http: int | None
) -> list[str]:
    """Whether ``other`` (a pod of the deployment) may reach those ports."""
    if pod.role == "vllm":
        kv = [r for r in ranges if not (r[0] == r[1] == http)]
        if _covers(ranges, http) and not (
            other.role == "router" or other.owner == pod.owner
        ):
            return [
                f"{shown}: the vLLM HTTP port is open to {other.where}; "
                "only the router may reach it"
            ]
        if kv and other.role != "vllm":
            return [
                f"{shown}: KV port(s) {_show(kv)} open to {other.where}; "
                "only the deployment's vLLM pods may reach them"
            ]
    elif pod.role == "master" and other.role != "vllm":
        return [f"{shown} open to {other.where}; only vLLM pods may reach it"]
    return []


def network_policy_problems(docs: list[Doc]) -> list[str]:
    """The deployment arrives closed: every pod is under a NetworkPolicy, a
    default deny covers them all, vLLM's HTTP port admits only the router,
    the KV ports and mooncake_master only the deployment's vLLM pods."""
    pods = _pods(docs)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    problems = []
    if not any(
        not np["spec"].get("ingress")
        and all(np in _policies_for(p, policies) for p in pods)
        for np in policies
    ):
        problems.append(
            "no default-deny NetworkPolicy (Ingress, no rules) selects every pod "
            f"of the deployment (select them by {PART_OF})"
        )
    for pod in pods:
        mine = _policies_for(pod, policies)
        if not mine:
            problems.append(
                f"{pod.where}: no NetworkPolicy selects it; every pod of the "
                "cluster can reach every port of it"
            )
            continue
        if pod.role != "other" and not any(np["spec"].get("ingress") for np in mine):
            problems.append(
                f"{pod.where}: no NetworkPolicy of its own opens what its "
                "clients need (only a default deny selects it)"
            )
        if pod.role == "vllm" and pod.labels.get(KV_PLANE_LABEL) != "true":
            problems.append(
                f"{pod.where}: runs vLLM without the label {KV_PLANE_LABEL}: "
                '"true", so the other ranks cannot reach its KV ports'
            )
        for np in mine:
            problems += _admission_problems(pod, np, pods)
    return problems


def api_key_problems(docs: list[Doc]) -> list[str]:
    """The router and every vLLM server read one API key from one Secret."""
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    problems = []
    refs: dict[str, tuple[str, str]] = {}
    for pod in _pods(docs):
        for c in _containers(pod.template):
            role = _role_of(c)
            if role not in API_KEY_ENV or "ray start" in _container_text(c):
                continue  # a Ray worker serves no API
            where = f"{pod.where} container {c.get('name')}"
            var = API_KEY_ENV[role]
            if "--api-key" in _container_text(c):
                problems.append(
                    f"{where}: --api-key on the command line is readable in the "
                    f"pod spec; read {var} from the Secret instead"
                )
            env = {e["name"]: e for e in c.get("env", [])}
            if var not in env:
                problems.append(
                    f"{where}: no {var} from a Secret (valueFrom.secretKeyRef): "
                    "its API takes requests without a key"
                )
                continue
            ref = env[var].get("valueFrom", {}).get("secretKeyRef")
            if ref is None:
                problems.append(f"{where}: {var} is not read from a Secret")
            elif ref.get("optional"):
                problems.append(
                    f"{where}: {var} is optional: the container would start "
                    "without a key; drop `optional: true`"
                )
            else:
                refs[where] = (str(ref.get("name")), str(ref.get("key")))
    if len(set(refs.values())) > 1:
        problems.append(
            "the router and the ranks read different API keys "
            f"({sorted(set(refs.values()))}): the ranks would refuse the router"
        )
    for name, key in sorted(set(refs.values())):
        secret = secrets.get(name)
        data = {
            **(secret or {}).get("data", {}),
            **(secret or {}).get("stringData", {}),
        }
        if secret is not None and key not in data:
            problems.append(f"Secret/{name} has no key {key!r}")
    return problems


def check_docs(docs: list[Doc]) -> list[str]:
    """Every check, one line per problem."""
    return (
        schema_problems(docs)
        + service_problems(docs)
        + config_map_problems(docs)
        + router_problems(docs)
        + guard_config_problems(docs)
        + network_policy_problems(docs)
        + api_key_problems(docs)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overlays", nargs="+", type=Path)
    args = parser.parse_args(argv)
    failed = False
    for overlay in args.overlays:
        problems = check_docs(render(overlay))
        for p in problems:
            print(f"{overlay}: {p}")
        if not problems:
            print(f"{overlay}: OK")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
