"""Drive vLLM's real v1 Scheduler and KVCacheManager offline, step by step.

One :meth:`SchedulerDriver.step` is one engine step:

(a) ``scheduler.schedule()`` -- vLLM's real admission and running loops;
(b) the fake worker answers: a token for every request that finished its
    prefill chunk, and a ``KVConnectorOutput`` with the receives that
    completed, failed or lost blocks (scripted loads, plus anything the test
    injects);
(c) ``scheduler.update_from_output()`` -- vLLM's real bookkeeping.

Only the GPU is fake: no forward pass runs and the KV cache has no tensors
(``KVCacheConfig(kv_cache_tensors=[])``), exactly like vLLM's own CPU unit
tests in ``tests/v1/kv_connector/unit``.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

from vllm_mooncake.offline import (
    EOS_TOKEN_ID,
    TINY_HEAD_DIM,
    TINY_NUM_KV_HEADS,
    TINY_NUM_LAYERS,
    prepare_offline_env,
    tiny_model_dir,
)

prepare_offline_env()

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from vllm_mooncake.compat.releases import (  # noqa: E402
    kv_output_has_failed_recving,
)
from vllm_mooncake.testing.outputs import model_runner_output  # noqa: E402
from vllm_mooncake.testing.scripted_connector import (  # noqa: E402
    ScriptedTransferWorker,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutputs

SAMPLED_TOKEN_ID = 7  # any id that is not EOS


class WorkerProtocolError(RuntimeError):
    """The scheduler sent the worker something a real model runner rejects."""


@dataclass(frozen=True)
class EngineShape:
    """The vLLM knobs of one rank that matter to the scheduler."""

    num_blocks: int = 64
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 16384
    policy: Literal["fcfs", "priority"] = "fcfs"
    reserve_full_isl: bool = True
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    # vLLM 0.34+: cap on async KV loads in flight (None: vLLM's default, off).
    max_num_inflight_kv_loads: int | None = None


@cache
def _model_config(max_model_len: int) -> ModelConfig:
    model = str(tiny_model_dir())
    return ModelConfig(
        model=model,
        tokenizer=model,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
    )


def make_vllm_config(
    shape: EngineShape = EngineShape(),
    kv_transfer_config: dict[str, Any] | KVTransferConfig | None = None,
    scheduler_cls: str | type | None = None,
) -> VllmConfig:
    """A real ``VllmConfig`` for the tiny local model (built offline)."""
    model_config = _model_config(shape.max_model_len)
    extra: dict[str, Any] = {}
    if shape.max_num_inflight_kv_loads is not None:
        extra["max_num_inflight_kv_loads"] = shape.max_num_inflight_kv_loads
    scheduler_config = SchedulerConfig(
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_model_len=shape.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=model_config.is_encoder_decoder,
        policy=shape.policy,
        scheduler_reserve_full_isl=shape.reserve_full_isl,
        async_scheduling=shape.async_scheduling,
        scheduler_cls=scheduler_cls,
        **extra,
    )
    cache_config = CacheConfig(
        block_size=shape.block_size,
        enable_prefix_caching=shape.enable_prefix_caching,
    )
    cache_config.num_gpu_blocks = shape.num_blocks
    ktc = (
        KVTransferConfig(**kv_transfer_config)
        if isinstance(kv_transfer_config, dict)
        else kv_transfer_config
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=ktc,
    )
    # vLLM's CPU platform turns async scheduling off; a GPU rank runs it on by
    # default. Restore the asked-for value so AsyncScheduler paths are driven.
    vllm_config.scheduler_config.async_scheduling = shape.async_scheduling
    if scheduler_cls is None:
        # Re-run the plugin's choice now that async scheduling is settled.
        from vllm_mooncake.plugin import configure_for_guard

        configure_for_guard(vllm_config)
    return vllm_config


def make_kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    """A KV cache of ``num_blocks`` blocks with no tensors behind it."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(TINY_NUM_LAYERS)]
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=TINY_NUM_KV_HEADS,
        head_size=TINY_HEAD_DIM,
        dtype=torch.float32,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def make_scheduler(
    vllm_config: VllmConfig, scheduler_cls: type[Scheduler] | None = None
) -> Scheduler:
    """Build the scheduler class vLLM would pick (or ``scheduler_cls``)."""
    cls = scheduler_cls or vllm_config.scheduler_config.get_scheduler_cls()
    block_size = vllm_config.cache_config.block_size
    num_blocks = vllm_config.cache_config.num_gpu_blocks
    return cls(  # type: ignore[no-any-return]
        vllm_config=vllm_config,
        kv_cache_config=make_kv_cache_config(num_blocks, block_size),
        structured_output_manager=StructuredOutputManager(vllm_config),
        include_finished_set=False,
        log_stats=True,
        block_size=block_size,
    )


def _random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` token ids in [3, vocab), fast enough for simulated long prompts."""
    span = vocab - 3
    return [3 + x % span for x in array("I", rng.randbytes(4 * n))]


@dataclass
class RequestFactory:
    """Builds real ``vllm.v1.request.Request`` objects with distinct prompts."""

    block_size: int
    vocab: int = 1000
    _hasher: Callable[[Request], list[Any]] | None = None

    def __post_init__(self) -> None:
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(self.block_size, sha256)

    def make(
        self,
        req_id: str,
        prompt_len: int,
        max_tokens: int = 8,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
        prefix: Sequence[int] = (),
        arrival_time: float | None = None,
    ) -> Request:
        rng = random.Random(req_id)
        body = _random_tokens(rng, prompt_len - len(prefix), self.vocab)
        extra_args = (
            {"kv_transfer_params": dict(kv_transfer_params)}
            if kv_transfer_params
            else None
        )
        params = SamplingParams(max_tokens=max_tokens, extra_args=extra_args)
        params.update_from_generation_config({}, eos_token_id=EOS_TOKEN_ID)
        return Request(
            request_id=req_id,
            prompt_token_ids=list(prefix) + body,
            sampling_params=params,
            pooling_params=None,
            priority=priority,
            arrival_time=arrival_time,
            block_hasher=self._hasher,
        )


@dataclass
class StepResult:
    """What one engine step did."""

    index: int
    scheduler_output: SchedulerOutput
    kv_connector_output: KVConnectorOutput
    engine_outputs: dict[int, EngineCoreOutputs]
    finished: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return int(self.scheduler_output.total_num_scheduled_tokens)


class SchedulerDriver:
    """Steps a real vLLM scheduler; plays the model runner and KV workers."""

    def __init__(self, scheduler: Scheduler, keep_steps: bool = True) -> None:
        self.scheduler = scheduler
        self.worker = ScriptedTransferWorker()
        self.requests = RequestFactory(scheduler.block_size)
        # Every StepResult, when keep_steps (tests); long simulations turn it
        # off and count steps only.
        self.keep_steps = keep_steps
        self.steps: list[StepResult] = []
        self.num_steps = 0
        # Called between (a) and (b) with the step's SchedulerOutput: the
        # simulator prices the step there and sets the worker's clock.
        self.on_scheduled: Callable[[SchedulerOutput], None] | None = None
        # Requests the fake model runner holds state for (sent to it as new).
        self._worker_requests: set[str] = set()
        self.finished: dict[str, str] = {}  # req_id -> finish reason

    @classmethod
    def build(
        cls,
        shape: EngineShape = EngineShape(),
        kv_transfer_config: dict[str, Any] | None = None,
        scheduler_cls: type[Scheduler] | None = None,
    ) -> SchedulerDriver:
        vllm_config = make_vllm_config(shape, kv_transfer_config)
        return cls(make_scheduler(vllm_config, scheduler_cls))

    # ---- requests ----------------------------------------------------------
    def add(self, req_id: str, prompt_len: int, **kwargs: Any) -> Request:
        """Build a request (see :meth:`RequestFactory.make`) and add it."""
        request = self.requests.make(req_id, prompt_len, **kwargs)
        self.scheduler.add_request(request)
        return request

    def abort(self, *req_ids: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        for req_id in req_ids:
            self.finished.setdefault(req_id, "abort")

    # ---- stepping ----------------------------------------------------------
    def step(
        self,
        finished_recving: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
        finished_sending: Iterable[str] = (),
    ) -> StepResult:
        """(a) schedule, (b) fake the worker's output, (c) update from it.

        ``finished_sending``: producer-side sends to report done this step
        (their held blocks are freed by vLLM's update).
        """
        scheduler_output = self.scheduler.schedule()
        if self.on_scheduled is not None:
            self.on_scheduled(scheduler_output)
        runner_output = self._model_runner_output(
            scheduler_output,
            finished_recving,
            failed_recving,
            invalid_block_ids,
            finished_sending,
        )
        engine_outputs = self.scheduler.update_from_output(
            scheduler_output, runner_output
        )
        result = StepResult(
            index=self.num_steps,
            scheduler_output=scheduler_output,
            kv_connector_output=runner_output.kv_connector_output,
            engine_outputs=engine_outputs,
        )
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    result.finished.append(out.request_id)
                    self.finished[out.request_id] = str(out.finish_reason)
                    self._worker_requests.discard(out.request_id)
        self.num_steps += 1
        if self.keep_steps:
            self.steps.append(result)
        return result

    def run(
        self, max_steps: int, until: Callable[[SchedulerDriver], bool] | None = None
    ) -> list[StepResult]:
        """Step until ``until(self)`` (default: no request left) or max_steps."""
        done = until or (lambda d: not d.scheduler.has_requests())
        out: list[StepResult] = []
        for _ in range(max_steps):
            if done(self):
                break
            out.append(self.step())
        return out

    def _model_runner_output(
        self,
        so: SchedulerOutput,
        finished_recving: Iterable[str],
        failed_recving: Iterable[str],
        invalid_block_ids: Iterable[int],
        finished_sending: Iterable[str] = (),
    ) -> ModelRunnerOutput:
        self._check_worker_protocol(so)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            # A partial prefill chunk samples nothing; anything else samples one.
            sampled.append([] if request.is_prefill_chunk else [SAMPLED_TOKEN_ID])
        failed_recving = set(failed_recving)
        if failed_recving and not kv_output_has_failed_recving():
            # Before 0.30 an injected failure is reported by its blocks.
            invalid_block_ids = set(invalid_block_ids)
            for req_id in failed_recving:
                if req_id in self.scheduler.requests:
                    block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
                    invalid_block_ids.update(block_ids[0] if block_ids else ())
        kv_output = self.worker.advance(
            so, finished_recving, failed_recving, invalid_block_ids, finished_sending
        )
        return model_runner_output(req_ids, sampled, kv_output)

    def _check_worker_protocol(self, so: SchedulerOutput) -> None:
        """Reject what vLLM's model runner would reject (KeyError there)."""
        for new in so.scheduled_new_reqs:
            self._worker_requests.add(new.req_id)
        cached = so.scheduled_cached_reqs
        # 0.34 has no resumed_req_ids: it re-sends a preempted request as new.
        resumed = getattr(cached, "resumed_req_ids", ())
        for req_id in cached.req_ids:
            if req_id not in self._worker_requests:
                kind = "resumed" if req_id in resumed else "cached"
                raise WorkerProtocolError(
                    f"{req_id} was sent to the worker as {kind} but the worker "
                    "never saw it as new (the GPU model runner raises KeyError)"
                )
        for req_id in so.finished_req_ids:
            self._worker_requests.discard(req_id)

    # ---- observations --------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    @property
    def num_usable_blocks(self) -> int:
        """Pool size less the null block."""
        return int(self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks) - 1

    def status(self, req_id: str) -> str:
        return str(self.scheduler.requests[req_id].status.name)

    def zero_token_streak(self) -> int:
        """Consecutive trailing steps that scheduled no token (keep_steps)."""
        streak = 0
        for result in reversed(self.steps):
            if result.num_scheduled_tokens:
                break
            streak += 1
        return streak
