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
(:func:`api_key_problems`); and that rollouts lose nothing: readiness from
the guard, a drain before every stop, one rank at a time, the master never
down, disruption budgets (:func:`rollout_problems`). Exit code 0 when
clean, 1 with one line per problem.
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


# ---- rollouts: readiness, drain, strategies, disruption budgets -----------------
READY_TOOL = "vllm_mooncake.tools.ready"
# Seconds a drained vLLM server needs after SIGTERM to shut down, on top of
# the preStop drain, in each rank's terminationGracePeriodSeconds.
SHUTDOWN_MARGIN_S = 30
# Kubernetes' defaults for a probe's fields and a pod's grace period.
PROBE_DEFAULTS = {"periodSeconds": 10, "timeoutSeconds": 1, "failureThreshold": 3}
DEFAULT_GRACE_S = 30


def _serves_vllm(container: Doc) -> bool:
    """A container running vLLM's server (not a Ray worker of its group)."""
    return "vllm serve" in _container_text(container)


def _flag(command: list[str], flag: str) -> str | None:
    """The value after ``flag`` in an argv list (``--flag value`` or
    ``--flag=value``)."""
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _recv_deadline_s(tmpl: Doc, container: Doc, maps: dict[str, Doc]) -> float | None:
    """The ``recv_deadline_s`` in force for the kv_transfer_config file the
    container reads from a ConfigMap mount (the guard's default when the
    file leaves it out); None when there is no such file or it is invalid
    (:func:`guard_config_problems` reports that)."""
    from vllm_mooncake.guard.config import GuardConfig

    volumes = {v["name"]: v for v in tmpl["spec"].get("volumes", [])}
    text = _container_text(container)
    for mount in container.get("volumeMounts", []):
        ref = volumes.get(mount["name"], {}).get("configMap", {}).get("name")
        data = maps.get(ref, {}).get("data", {}) if ref else {}
        prefix = mount["mountPath"].rstrip("/") + "/"
        for key in re.findall(re.escape(prefix) + r"([\w.\-]+)", text):
            if key.endswith("kv_transfer_config.json") and key in data:
                try:
                    extra = json.loads(data[key]).get("kv_connector_extra_config")
                    return float(GuardConfig.from_extra_config(extra).recv_deadline_s)
                except (ValueError, AttributeError):
                    return None
    return None


def _probe_bound_s(probe: Doc) -> int:
    """Seconds from the first failing check to unready, at worst: the wait
    for the next probe, failureThreshold failures in a row, the last one's
    timeout (failureThreshold x periodSeconds + timeoutSeconds)."""
    field = {k: int(probe.get(k, v)) for k, v in PROBE_DEFAULTS.items()}
    return field["failureThreshold"] * field["periodSeconds"] + field["timeoutSeconds"]


def _readiness_problems(
    where: str, container: Doc, deadline: float | None
) -> list[str]:
    """The readinessProbe runs the ready tool on the container's own HTTP
    port, and fails within 2 x recv_deadline_s of the rank going stuck."""
    probe = container.get("readinessProbe")
    command = list((probe or {}).get("exec", {}).get("command", []))
    if probe is None or READY_TOOL not in command or "--drain" in command:
        return [
            f"{where}: readinessProbe does not run `python -m {READY_TOOL}` (vLLM's "
            "/health stays 200 while the rank is stuck)"
        ]
    http = next(
        (
            p["containerPort"]
            for p in container.get("ports", [])
            if p.get("name") == HTTP_PORT
        ),
        None,
    )
    url = _flag(command, "--url")
    if url != f"http://127.0.0.1:{http}":
        return [f"{where}: readinessProbe asks {url!r}, not http://127.0.0.1:{http}"]
    if deadline is None:
        return []
    bound = _probe_bound_s(probe)
    if deadline + bound > 2 * deadline:
        return [
            f"{where}: readinessProbe turns a stuck rank unready after up to "
            f"{deadline:g} + {bound} s (recv_deadline_s + failureThreshold x "
            f"periodSeconds + timeoutSeconds), beyond 2 x recv_deadline_s = "
            f"{2 * deadline:g} s"
        ]
    return []


def _lifecycle_problems(where: str, tmpl: Doc, container: Doc) -> list[str]:
    """The startup and liveness probes stay; a preStop hook drains within
    the grace period."""
    problems = [
        f"{where}: no {probe} on /health"
        for probe in ("startupProbe", "livenessProbe")
        if container.get(probe, {}).get("httpGet", {}).get("path") != "/health"
    ]
    command = list(
        container.get("lifecycle", {})
        .get("preStop", {})
        .get("exec", {})
        .get("command", [])
    )
    drain = _flag(command, "--drain")
    if READY_TOOL not in command or drain is None:
        return problems + [
            f"{where}: no preStop hook draining the rank (`python -m {READY_TOOL} "
            "--drain SECONDS`): SIGTERM would cut its requests off"
        ]
    grace = int(tmpl["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))
    if grace < float(drain) + SHUTDOWN_MARGIN_S:
        problems.append(
            f"{where}: terminationGracePeriodSeconds {grace} < the preStop drain "
            f"({drain} s) + {SHUTDOWN_MARGIN_S} s for vLLM's shutdown: the kubelet "
            "would kill the rank mid-drain"
        )
    return problems


def _rank_strategy_problems(doc: Doc) -> list[str]:
    """Ranks roll one at a time: the router lists each by name, so there is
    no surge to roll into (StatefulSets have none; an LWS surge group would
    get a name the router does not list)."""
    spec = doc["spec"]
    if doc["kind"] == "LeaderWorkerSet":
        strategy = spec.get("rolloutStrategy", {})
        rolling = strategy.get("rollingUpdateConfiguration", {})
    else:
        strategy = spec.get("updateStrategy", {})
        rolling = strategy.get("rollingUpdate", {})
    if strategy.get("type") != "RollingUpdate" or rolling.get(
        "maxUnavailable", 1
    ) not in (1, "1"):
        return [
            f"{_name(doc)}: ranks must roll one at a time (RollingUpdate, "
            f"maxUnavailable 1), not {strategy or 'an implicit strategy'}"
        ]
    return []


def _master_strategy_problems(doc: Doc) -> list[str]:
    """The master is replaced new-before-old: a Deployment rolling with a
    surge and nothing unavailable (Recreate stops the old one first)."""
    strategy = doc["spec"].get("strategy", {})
    rolling = strategy.get("rollingUpdate", {})
    if (
        strategy.get("type") != "RollingUpdate"
        or rolling.get("maxUnavailable") not in (0, "0%")
        or rolling.get("maxSurge") in (None, 0, "0%")
    ):
        return [
            f"{_name(doc)}: the master must be replaced new-before-old "
            "(RollingUpdate, maxSurge 1, maxUnavailable 0): "
            f"{strategy or 'no strategy (25% / 25%)'} can leave the ranks "
            "without a master"
        ]
    return []


def _budget_problems(
    where: str, labels: dict[str, str], budgets: list[Doc], is_master: bool
) -> list[str]:
    """Exactly one PodDisruptionBudget: at most one rank down at a time,
    the master never."""
    mine = [b for b in budgets if selects(b["spec"].get("selector") or {}, labels)]
    if len(mine) != 1:
        names = [b["metadata"]["name"] for b in mine]
        return [
            f"{where}: {len(mine)} PodDisruptionBudgets select it {names}; it needs "
            "exactly one (under two, the eviction API refuses the pod)"
        ]
    spec = mine[0]["spec"]
    allowed = spec.get("maxUnavailable")
    if is_master and not (allowed in (0, "0%") and "minAvailable" not in spec):
        return [
            f"{where}: PodDisruptionBudget/{mine[0]['metadata']['name']} must allow "
            "no eviction (maxUnavailable 0): a new master starts empty"
        ]
    if not is_master and (allowed not in (1, "1") or "minAvailable" in spec):
        return [
            f"{where}: PodDisruptionBudget/{mine[0]['metadata']['name']} must let "
            "one rank go at a time (maxUnavailable 1)"
        ]
    return []


def rollout_problems(docs: list[Doc]) -> list[str]:
    """Rollouts lose nothing: every vLLM server's readinessProbe runs the
    ready tool and turns a stuck rank unready within 2 x recv_deadline_s, its
    startup and liveness probes stay, a preStop hook drains it within the
    grace period; ranks roll one at a time, the Mooncake master new before
    old; each rank pod and the master sit under one PodDisruptionBudget."""
    maps = _config_maps(docs)
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    problems = []
    for doc in docs:
        templates = list(pod_templates(doc))
        servers = [(w, t, c) for w, t in templates for c in _containers(t)]
        servers = [(w, t, c) for w, t, c in servers if _serves_vllm(c)]
        is_master = any(
            _role_of(c) == "master" for _, t in templates for c in _containers(t)
        )
        for where, tmpl, c in servers:
            deadline = _recv_deadline_s(tmpl, c, maps)
            problems += _readiness_problems(where, c, deadline)
            problems += _lifecycle_problems(where, tmpl, c)
        if servers and doc["kind"] in ("StatefulSet", "LeaderWorkerSet"):
            problems += _rank_strategy_problems(doc)
        if is_master and doc["kind"] == "Deployment":
            problems += _master_strategy_problems(doc)
        for where, tmpl in templates:
            if servers or is_master or _serves_ray_group(tmpl):
                labels = dict(tmpl.get("metadata", {}).get("labels", {}))
                problems += _budget_problems(where, labels, budgets, is_master)
    return problems


def _serves_ray_group(tmpl: Doc) -> bool:
    """A worker pod of a multi-node rank (its Ray worker)."""
    return any("ray start" in _container_text(c) for c in _containers(tmpl))


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
        + rollout_problems(docs)
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
