"""Stand-ins for the hub models vLLM's scheduler tests name, for an offline host.

The tests only build a ``ModelConfig`` (and, through the structured-output
manager, a tokenizer); no weights are loaded. Each stand-in is the model's
real ``config.json`` plus the project's offline-built byte-level tokenizer,
written into a Hugging Face hub cache layout, so ``facebook/opt-125m`` resolves
with ``HF_HUB_OFFLINE=1`` exactly as it would from a warm cache. Tests that
need a model not listed here are skipped by name (``skips.toml``): the
multimodal ones, for instance, because vLLM's multimodal model classes import
torchvision, which this project's CPU environment does not install.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REVISION = "0" * 39 + "1"  # a fixed fake commit hash for the snapshot
RECIPE = 1  # bump when a stand-in's files change
GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

_OPT_COMMON: dict[str, Any] = {
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 50272,
}

STAND_INS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {
        **_OPT_COMMON,
        "ffn_dim": 3072,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "word_embed_proj_dim": 768,
    },
    "facebook/opt-350m": {
        **_OPT_COMMON,
        "do_layer_norm_before": False,
        "ffn_dim": 4096,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "word_embed_proj_dim": 512,
    },
}


def _snapshot(hub: Path, repo_id: str) -> Path:
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def _write_stand_in(hub: Path, repo_id: str, config: dict[str, Any]) -> None:
    from vllm_mooncake.tools.cluster.tiny_model import build_tokenizer

    snapshot = _snapshot(hub, repo_id)
    build_tokenizer(snapshot)
    (snapshot / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in GENERATION_KEYS if k in config}
    (snapshot / "generation_config.json").write_text(json.dumps(generation))


def ensure_hub_cache(hub: Path) -> Path:
    """Write every stand-in under ``hub`` (an ``HF_HUB_CACHE``) once."""
    stamp = hub / ".conformance-stand-ins"
    wanted = json.dumps({"recipe": RECIPE, "models": sorted(STAND_INS)})
    if stamp.exists() and stamp.read_text() == wanted:
        return hub
    for repo_id, config in STAND_INS.items():
        _write_stand_in(hub, repo_id, config)
    stamp.write_text(wanted)
    return hub
