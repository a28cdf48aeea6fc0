"""A small stdlib HTTP client for the local cluster: completions and /metrics.

Used by ``python -m vllm_mooncake.tools.cluster.local`` (the smoke request after
``up``) and by the end-to-end tests. No third-party dependency, so it works
in any environment that can reach the servers.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm_mooncake.tools.cluster.layout import SERVED_MODEL_NAME


class RequestFailed(RuntimeError):
    """A server answered with an HTTP error; the message carries its body."""


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    kv_transfer_params: dict[str, Any] | None
    raw: dict[str, Any]


def post_json(
    url: str,
    body: dict[str, Any],
    timeout: float = 300.0,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            result: dict[str, Any] = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise RequestFailed(f"POST {url}: HTTP {exc.code}: {detail}") from exc
    return result


def complete(
    base_url: str,
    prompt: str | list[int],
    max_tokens: int = 16,
    model: str = SERVED_MODEL_NAME,
    timeout: float = 300.0,
    **extra: Any,
) -> Completion:
    """Greedy completion (temperature 0, EOS ignored) with its token ids."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    out = post_json(f"{base_url}/v1/completions", body, timeout=timeout)
    choice = out["choices"][0]
    return Completion(
        text=choice["text"],
        token_ids=list(choice.get("token_ids") or []),
        finish_reason=choice.get("finish_reason") or "",
        kv_transfer_params=out.get("kv_transfer_params"),
        raw=out,
    )


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    """Prometheus text format -> samples (comments and HELP/TYPE skipped)."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        samples.append(Sample(m.group(1), labels, value))
    return samples


def metric_total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """Sum of ``name`` over samples whose labels include ``labels``."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def metric_names(samples: Iterable[Sample]) -> set[str]:
    return {s.name for s in samples}


def scrape(base_url: str) -> list[Sample]:
    """A vLLM server's ``/metrics``."""
    return scrape_url(f"{base_url}/metrics")


def scrape_url(url: str) -> list[Sample]:
    """Samples of any Prometheus endpoint (mooncake_master's, the router's)."""
    return parse_metrics(get_text(url))


# What a NIXL-style PD proxy sends the prefill leg (vLLM's toy proxy, and
# vllm-router --kv-connector nixl): hold the KV for a remote decode.
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def pd_complete_nixl(
    prefill_url: str,
    decode_url: str,
    prompt: str | list[int],
    max_tokens: int = 16,
    timeout: float = 300.0,
) -> Completion:
    """One request routed NIXL-style by hand: prefill (1 token), then decode
    with the ``kv_transfer_params`` the prefill returned."""
    first = complete(
        prefill_url,
        prompt,
        1,
        timeout=timeout,
        kv_transfer_params=dict(NIXL_PREFILL_PARAMS),
    )
    if not first.kv_transfer_params:
        raise RequestFailed(f"{prefill_url} returned no kv_transfer_params")
    return complete(
        decode_url,
        prompt,
        max_tokens,
        timeout=timeout,
        kv_transfer_params=first.kv_transfer_params,
    )


def prefill_engine_id(bootstrap_url: str) -> str:
    """The engine id the prefill (data-parallel rank 0) registered on its
    Mooncake bootstrap server, read now."""
    engines = json.loads(get_text(f"{bootstrap_url}/query"))
    return str(engines["0"]["engine_id"])


def mooncake_legs(bootstrap_url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``kv_transfer_params`` of a Mooncake-style PD request's two legs,
    as vllm-router sends them: (prefill leg, decode leg), one transfer id.
    The prefill's engine id is read from its bootstrap server now."""
    import uuid

    engine_id = prefill_engine_id(bootstrap_url)
    transfer_id = f"xfer-{uuid.uuid4()}"
    prefill = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    decode = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_bootstrap_addr": bootstrap_url,
        "remote_engine_id": engine_id,
        "transfer_id": transfer_id,
    }
    return prefill, decode


def pd_complete_mooncake(
    prefill_url: str,
    decode_url: str,
    bootstrap_url: str,
    prompt: str | list[int],
    max_tokens: int = 16,
    timeout: float = 300.0,
) -> Completion:
    """One request routed Mooncake-style by hand: both legs at once (the
    prefill pushes the KV to the decode), like vLLM's Mooncake proxy."""
    from concurrent.futures import ThreadPoolExecutor

    prefill_params, decode_params = mooncake_legs(bootstrap_url)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            complete,
            prefill_url,
            prompt,
            1,
            timeout=timeout,
            kv_transfer_params=prefill_params,
        )
        out = complete(
            decode_url,
            prompt,
            max_tokens,
            timeout=timeout,
            kv_transfer_params=decode_params,
        )
        first.result()
    return out
