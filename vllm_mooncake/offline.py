"""Offline environment for driving vLLM without a hub, a GPU or model weights.

vLLM inspects the model class in a subprocess the first time a config is
built (about 12 s) and caches the answer under ``$VLLM_CACHE_ROOT``. We keep
that cache, and the tiny model config we write, in a project-local folder so
every later construction is sub-second.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TINY_LLAMA_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # The CPU attention kernel needs head_dim >= 32 (it fails only at the
    # first request otherwise), so it is set explicitly.
    "head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 65536,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
EOS_TOKEN_ID = 2
TINY_NUM_LAYERS = 2
TINY_NUM_KV_HEADS = 2
TINY_HEAD_DIM = 32


def cache_dir() -> Path:
    """Project-local cache folder (``$VLLM_MOONCAKE_CACHE`` or ``./.cache``)."""
    root = Path(os.environ.get("VLLM_MOONCAKE_CACHE", Path.cwd() / ".cache"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def prepare_offline_env() -> Path:
    """Point vLLM and the HF hub at local folders; call before importing vLLM."""
    root = cache_dir()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm"))
    os.environ.setdefault("XDG_CACHE_HOME", str(root / "xdg"))
    return root


def tiny_model_dir() -> Path:
    """Write (once) the config of a tiny Llama and return its folder.

    Only ``config.json`` is written: the scheduler never loads weights.
    """
    model = prepare_offline_env() / "tiny-llama-config"
    config_file = model / "config.json"
    wanted = json.dumps(TINY_LLAMA_CONFIG, indent=2, sort_keys=True)
    if not config_file.exists() or config_file.read_text() != wanted:
        model.mkdir(parents=True, exist_ok=True)
        config_file.write_text(wanted)
    return model
