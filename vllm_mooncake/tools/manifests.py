"""Offline checks of the Kubernetes manifests: schemas and cross-references.

``python -m vllm_mooncake.tools.manifests OVERLAY_DIR [...]`` renders each
overlay with ``kubectl kustomize``, validates every built-in object against
the Kubernetes schemas (``kubernetes-validate``, no cluster needed; a
LeaderWorkerSet's pod templates are validated as PodTemplates), then checks
what a schema cannot: Service selectors match pods, target ports exist,
referenced ConfigMaps and keys exist, the router lists exactly the prefill
and decode pods, the Mooncake store config points at the master Service, and
every kv_transfer_config in a ConfigMap names the guard connector and passes
its validation. Exit code 0 when clean, 1 with one line per problem.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
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


def check_docs(docs: list[Doc]) -> list[str]:
    return (
        schema_problems(docs)
        + service_problems(docs)
        + config_map_problems(docs)
        + router_problems(docs)
        + guard_config_problems(docs)
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
