"""The block arithmetic behind the real-server wedges (tools/cluster/real_wedges.py).

The end-to-end tier forms W1/W2 on real servers; these checks keep the
prompt and pool sizes it relies on honest without starting any server: on a
decode pool of ``W1_DECODE_BLOCKS`` (one is vLLM's null block) of 128-token
CPU blocks, the holder's prompt and the urgent request's stored prefix fill
the pool exactly, and the urgent request's remaining blocks do not fit.
"""

from __future__ import annotations

import math

import pytest

from vllm_mooncake.tools.cluster import local
from vllm_mooncake.tools.cluster.real_wedges import (
    MAX_TOKENS,
    W1_DECODE_BLOCKS,
    W1_SERVER_ARGS,
    W1Prompts,
    W2Prompts,
)

CPU_BLOCK = 128  # vLLM's block size on the CPU backend
MAX_MODEL_LEN = 512  # the local cluster's default


def _blocks(tokens: int) -> int:
    return math.ceil(tokens / CPU_BLOCK)


@pytest.mark.parametrize("make", [W1Prompts.make, W2Prompts.make])
def test_holder_and_stored_prefix_fill_the_pool_and_the_rest_cannot_fit(
    make: object,
) -> None:
    prompts = make(0)  # type: ignore[operator]
    first = getattr(prompts, "urgent", None) or prompts.failing
    usable = W1_DECODE_BLOCKS - 1
    stored = len(prompts.seed) // CPU_BLOCK  # the store keeps full blocks
    holder = _blocks(len(prompts.holder) + 1)
    assert first[: len(prompts.seed)] == prompts.seed
    assert holder + stored == usable
    assert _blocks(len(first)) - stored > 0  # needs more than is free
    for prompt in (first, prompts.holder):
        assert len(prompt) + MAX_TOKENS <= MAX_MODEL_LEN
    # the pool still holds the longest request alone (vLLM checks at start)
    assert usable * CPU_BLOCK >= MAX_MODEL_LEN


def test_prompts_differ_per_seed_so_no_decode_sees_anothers_prefix() -> None:
    a, b = W1Prompts.make(1), W1Prompts.make(2)
    assert a.urgent[1:20] != b.urgent[1:20] and a.holder[1:20] != b.holder[1:20]
    assert W2Prompts.make(1).failing[1:20] != a.urgent[1:20]


def test_w1_needs_priority_without_the_full_prompt_check() -> None:
    args = " ".join(W1_SERVER_ARGS)
    assert "--scheduling-policy priority" in args
    assert "--no-scheduler-reserve-full-isl" in args


def test_rank_connector_flag_names_its_format() -> None:
    assert local._rank_connectors(["decode-0=stock"]) == {"decode-0": "stock"}
    with pytest.raises(SystemExit, match="RANK=CONNECTOR"):
        local._rank_connectors(["decode-0"])
