"""Engine: add_request / abort / step / generate over the scheduler and the model runner.

One ``step()`` is one iteration of continuous batching::

    schedule()  ->  SchedulerOutput        which rows run now, their tokens and blocks (pure Python)
    execute()   ->  ModelRunnerOutput      one forward over the flat batch, one token per sampling row
    update()    ->  requests touched       tokens appended, token stops checked, finished blocks freed
    detokenize  ->  RequestDelta per row   new text, stop strings (which finish the request at once)

The clock is injectable so benchmarks can run under a unit clock. Not thread-safe: one thread drives it
(the server runs it in its own engine thread).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import (
    DEFAULT_BATCHED_TOKENS,
    SPECULATION_AUTO,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_kv_cache_dtype,
)
from tokenmill.core.sched_output import SampledToken, StepRecord
from tokenmill.core.scheduler import Scheduler
from tokenmill.detokenizer import IncrementalDetokenizer
from tokenmill.errors import CONSTRAINT_FAILED, BadRequestError
from tokenmill.lora_request import LoRARequest
from tokenmill.measure.cost_model import ModelShape
from tokenmill.measure.roofline import MachineLimits, StepRoofline, step_kind
from tokenmill.outputs import CompletionOutput, Logprob, RequestDelta, RequestMetrics, RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.stats import EngineStats
from tokenmill.worker.cpu_load import CpuLoad
from tokenmill.worker.thread_governor import ThreadGovernor

Prompt = str | Sequence[int]
Prompts = Prompt | Sequence[Prompt]  # one prompt or several
ParamsArg = SamplingParams | Sequence[SamplingParams] | None  # one for all prompts, one each, or the defaults
logger = logging.getLogger(__name__)
DEFAULT_CPU_KV_CACHE_MAX_BYTES = 2 << 30  # the CPU pool's default bound (kv_cache_memory_bytes overrides it)
STEP_FAILED = "the step failed:"  # how the message of a request whose step's forward raised begins


@dataclass
class StepResult:
    deltas: list[RequestDelta] = field(default_factory=list)  # one per request that got tokens or finished
    finished: list[RequestOutput] = field(default_factory=list)
    record: StepRecord = field(default_factory=StepRecord)
    error: Exception | None = None  # the forward raised: the step's requests ended with this error
    # with the machine's limits known (hardware_limits): the step's kind and its fraction of the limit
    roofline_kind: str | None = None
    roofline_fraction: float | None = None


def _load_kwargs(config: EngineConfig) -> dict[str, Any]:
    return {
        "model": config.model,
        "device": config.device,
        "dtype": config.dtype,
        "quantization": "fp32" if config.tensor_parallel_size > 1 else config.quantization,  # TP splits fp32
    }


@functools.cache
def _process_num_threads() -> int:
    """The forward's thread count unless ``num_threads`` says otherwise: torch's count when this process built its
    first engine. A thread governor lowers torch's process-wide count while it runs (a probe of one thread fewer, a
    busy neighbour), and a later engine must not take what it left as its ceiling."""
    import torch

    return torch.get_num_threads()


def _max_model_len(config: EngineConfig, model_max_len: int) -> int:
    if config.max_model_len is not None and config.max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) exceeds the model's context length ({model_max_len})"
        )
    return config.max_model_len or model_max_len


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        loaded: Any = None,
        **overrides: Any,
    ) -> None:
        """Load the model (``loaded`` reuses an already loaded ``LoadedModel``) and size the KV pool.

        Keyword ``overrides`` are ``EngineConfig`` fields, so ``Engine(num_kv_blocks=64)`` works.
        """
        import torch

        from tokenmill.model.loader import load_model

        config = replace(config or EngineConfig(), **overrides) if overrides else (config or EngineConfig())
        self.config = config
        self.clock = clock
        process_num_threads = _process_num_threads()  # read before any engine's num_threads is applied
        num_threads = config.num_threads or process_num_threads
        torch.set_num_threads(num_threads)
        # the count this engine's forwards run at on CPU (None: tensor parallelism sets its workers' own)
        self._num_threads = num_threads if config.tensor_parallel_size == 1 else None
        load_kwargs = _load_kwargs(config)
        if loaded is None:
            loaded = load_model(**load_kwargs)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        from tokenmill.generation_defaults import resolve

        self.generation_defaults = resolve(config.generation_config, loaded.source)
        self.model_name = _model_name(loaded.source)
        self.quantization = loaded.quantization
        self.arithmetic = loaded.describe_arithmetic()  # which arithmetic runs and why (model/arithmetic.py)
        self.max_model_len = _max_model_len(config, loaded.config.max_position_embeddings)
        # An embedding model (an encoder, model/encoder.py): prompts are pooled, not continued; no KV is kept.
        self.is_pooling = bool(getattr(loaded.model, "is_encoder", False))
        config = self.config = self._resolve_speculation(config)
        self.draft = self._load_draft()
        model_dtype = str(loaded.dtype).removeprefix("torch.")
        self.kv_dtype = getattr(
            torch, resolve_kv_cache_dtype(config.kv_cache_dtype, loaded.quantization, model_dtype)
        )
        self._size_kv_pool()
        self._build_scheduler()
        self.tp_group = self._build_tp_group(load_kwargs) if config.tensor_parallel_size > 1 else None
        self._requests: dict[str, Request] = {}  # every request not yet handed back as finished
        self.lora_manager = None if self.is_pooling else self._build_lora_manager()
        self.runner = self._build_runner()
        self.kv_disk = self._build_kv_disk_tier()
        self.stats = EngineStats()
        self.roofline = self._build_roofline()
        self.thread_governor, self._governor_roofline = self._build_thread_governor()
        self._pending_finished: list[Request] = []  # aborted between steps; reported by the next step
        self._announced: set[str] = set()  # requests that have had a delta (prompt logprobs go in the first)
        self._ids = itertools.count()
        self._structured_outputs: Any = None
        self._structured_lock = threading.Lock()

    def _resolve_speculation(self, config: EngineConfig) -> EngineConfig:
        """The default speculation (n-gram lookup; none for an embedding model) made explicit; ValueError for an
        embedding model asked to speculate or to split over processes."""
        if config.speculative_config == SPECULATION_AUTO:
            config = replace(config, speculative_config=None if self.is_pooling else SpeculativeConfig())
        if self.is_pooling and (config.speculative_config is not None or config.tensor_parallel_size > 1):
            raise ValueError("an embedding model runs without speculative_config and tensor parallelism")
        return config

    def _build_tp_group(self, load_kwargs: dict[str, Any]) -> Any:
        from tokenmill.worker.tensor_parallel import TensorParallelGroup

        c = self.config
        lora = (c.max_loras, c.max_lora_rank, c.max_cpu_loras) if c.enable_lora else None
        return TensorParallelGroup(
            self.loaded, load_kwargs, c.tensor_parallel_size, self.num_total_blocks, c.block_size,
            kv_dtype=self.kv_dtype, lora_options=lora,
        )  # fmt: skip

    def _build_runner(self) -> Any:
        """The pooling runner for an embedding model, else the model runner (with its draft and adapters)."""
        if self.is_pooling:
            from tokenmill.worker.pooling_runner import PoolingRunner

            return PoolingRunner(self.loaded)
        from tokenmill.worker.model_runner import ModelRunner

        c, spec = self.config, self.config.speculative_config
        return ModelRunner(
            self.loaded,
            self.num_total_blocks,
            c.block_size,
            self._requests,
            seed=c.seed,
            tp_group=self.tp_group,
            draft=self.draft,
            draft_p_min=spec.resolved_draft_p_min if isinstance(spec, SpeculativeConfig) else 0.0,
            kv_dtype=self.kv_dtype,
            lora_manager=self.lora_manager,
        )

    def _build_lora_manager(self) -> Any:
        if not self.config.enable_lora:
            return None
        from tokenmill.worker.lora_manager import LoRAManager
        from tokenmill.worker.tensor_parallel import lora_shard

        c = self.config
        shard = (
            None if c.tensor_parallel_size == 1 else lora_shard(self.loaded.config, 0, c.tensor_parallel_size)
        )
        return LoRAManager(
            self.loaded.config, c.max_loras, c.max_lora_rank, c.max_cpu_loras, self.loaded.device, shard
        )

    def add_lora(self, lora_request: LoRARequest) -> Any:
        """Load an adapter (vLLM's ``add_lora``); its ``LoRAAdapter``. BadRequestError (a ValueError) when LoRA is
        off or the adapter does not load onto this model."""
        if self.lora_manager is None:
            raise BadRequestError("LoRA adapters need enable_lora=True (--enable-lora)", param="lora_request")
        try:
            return self.lora_manager.add(lora_request)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="lora_request") from None

    def lora_requests(self) -> tuple[list[str], list[str]]:
        """The adapter names of the running and of the waiting requests (vLLM's ``vllm:lora_requests_info``)."""
        if self.lora_manager is None:
            return [], []
        names = {i: r.lora_name for i, r in self.lora_manager.requests.items()}
        running = {names.get(r.lora_id, "") for r in self.scheduler.running if r.lora_id}
        waiting = {names.get(r.lora_id, "") for r in self.scheduler.waiting if r.lora_id}
        return sorted(running), sorted(waiting)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False when unknown. BadRequestError while a request still runs with it."""
        if self.lora_manager is None:
            return False
        if any(r.lora_id == lora_int_id for r in self._requests.values()):
            raise BadRequestError(f"LoRA adapter {lora_int_id} still has requests running", param="lora_name")
        return bool(self.lora_manager.remove(lora_int_id))

    def _size_kv_pool(self) -> None:
        """The KV pool: ``num_kv_blocks``, else as many blocks as the memory budget holds (per rank under tensor
        parallelism: rank 0 holds the most KV heads)."""
        from tokenmill.model.loader import kv_bytes_per_block

        config, kv_config, tp = self.config, self.loaded.config, self.config.tensor_parallel_size
        if tp > 1:
            from tokenmill.worker.tensor_parallel import check_size, split

            check_size(kv_config.num_key_value_heads, tp)
            k0, k1 = split(kv_config.num_key_value_heads, tp, 0)
            kv_config = replace(
                kv_config,
                num_key_value_heads=k1 - k0,
                num_attention_heads=(k1 - k0) * kv_config.num_queries_per_kv,
            )
        if self.is_pooling:  # blocks without tensors: they only bound the tokens in flight
            self.num_total_blocks = config.num_kv_blocks or math.ceil(
                config.max_num_seqs * self.max_model_len / config.block_size
            )
            self.kv_cache_bytes = 0
            return
        bytes_per_block = kv_bytes_per_block(kv_config, config.block_size, self.kv_dtype)
        if self.draft is not None:  # the draft's KV: its own tensors, the same blocks
            bytes_per_block += kv_bytes_per_block(self.draft.config, config.block_size, self.draft.dtype)
        self.num_total_blocks = config.num_kv_blocks or self._blocks_from_budget(bytes_per_block)
        self.kv_cache_bytes = self.num_total_blocks * bytes_per_block
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens), %.1f MB, %s",
            self.num_total_blocks, config.block_size, self.num_total_blocks * config.block_size,
            self.kv_cache_bytes / 1e6, str(self.kv_dtype).removeprefix("torch."),
        )  # fmt: skip

    def _build_scheduler(self) -> None:
        config, loaded = self.config, self.loaded
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens
            or DEFAULT_BATCHED_TOKENS.get(getattr(loaded.device, "type", str(loaded.device)), 2048),
            max_model_len=self.max_model_len,
            reserve=config.reserve,
            max_num_preemptions=config.max_num_preemptions,
            enable_chunked_prefill=not self.is_pooling,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        self.cache_config = CacheConfig(block_size=config.block_size, num_blocks=self.num_total_blocks)
        model_config = loaded.config
        windows = [model_config.layer_window(i) for i in range(model_config.num_hidden_layers)]
        self.kv_manager = KVCacheManager(
            self.cache_config,
            config.reserve,
            enable_caching=config.enable_prefix_caching and not self.is_pooling,
            # blocks outside the window are released only when every layer has one (Qwen2's lower layers may not)
            sliding_window=windows[0] if None not in windows and len(set(windows)) == 1 else None,
        )
        proposer = None
        spec = config.speculative_config
        if isinstance(spec, SpeculativeConfig):
            from tokenmill.core.proposers import DraftSlots, NgramProposer

            proposer = NgramProposer(spec) if spec.method == "ngram" else DraftSlots(spec)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_manager, config.block_size, proposer)

    def _build_kv_disk_tier(self) -> Any:
        """The prefix cache's disk tier (worker/kv_offload.py), or None: off, or a setup it does not cover."""
        if not self.config.kv_cache_disk_bytes or not self.kv_manager.enable_caching:
            return None
        if self.is_pooling or self.tp_group is not None or self.draft is not None:
            logger.info("KV disk tier off: it keeps one model's blocks (no draft model, tensor parallelism)")
            return None
        from tokenmill.worker.kv_offload import build_offloader

        offloader = build_offloader(self.config, self.loaded, self.runner.kv_caches)
        self.kv_manager.record_newly_cached = True
        return offloader

    def _build_roofline(self) -> StepRoofline | None:
        """The machine's limits (config.hardware_limits: measured now, or given) for each step's roofline."""
        import torch

        spec = self.config.hardware_limits
        if spec in (None, "none") or self.is_pooling:
            return None
        shape = ModelShape.from_config(self.loaded.config)
        if spec in ("cached", "measure") and self.loaded.device.type == "cpu":
            from tokenmill.model.hardware_cache import machine_limits

            measured, source = machine_limits(refresh=spec == "measure")
            limits = MachineLimits(measured.peak_flops, measured.peak_read_bw, source, measured.peak_int_ops)
        elif spec in ("cached", "measure"):
            from tokenmill.model import hardware

            measured = hardware.measure_model(shape, self.loaded.device, torch.float32, quick=True)
            limits = MachineLimits(measured.peak_flops, measured.peak_read_bw, "measured at start")
        else:
            limits = MachineLimits.parse(spec)
        if self.loaded.quantization in ("gguf-q8", "gguf-q4"):
            limits = limits.for_integer_matmuls()
        weight_bytes = self.loaded.weight_bytes / (shape.matmul_params + shape.lm_head_params)
        kv_bytes = torch.empty((), dtype=self.loaded.dtype).element_size()
        logger.info("roofline: %s", limits.describe())
        return StepRoofline(shape, limits, weight_bytes, kv_bytes)

    def _build_thread_governor(self) -> tuple[ThreadGovernor | None, StepRoofline | None]:
        """On CPU with 2 threads or more (and no tensor parallelism): the governor of the forward's thread count,
        and the roofline it weighs steps with (the engine's, else one at nominal limits: it compares steps with
        each other, not with the machine)."""
        import torch

        max_threads = torch.get_num_threads()
        cpu_alone = self.loaded.device.type == "cpu" and self.config.tensor_parallel_size == 1
        if not (self.config.adaptive_threads and cpu_alone and max_threads >= 2) or self.is_pooling:
            return None, None
        shape = ModelShape.from_config(self.loaded.config)
        roofline = self.roofline or StepRoofline(
            shape,
            MachineLimits(100e9, 20e9, "nominal"),
            self.loaded.weight_bytes / (shape.matmul_params + shape.lm_head_params),
            torch.empty((), dtype=self.loaded.dtype).element_size(),
        )
        return ThreadGovernor(max_threads, torch.set_num_threads, load=CpuLoad.of_this_process()), roofline

    def _load_draft(self) -> Any:
        """Speculative decoding's draft model (method "draft_model"), refused unless its vocabulary is the target's."""
        import torch

        spec = self.config.speculative_config
        if not isinstance(spec, SpeculativeConfig) or spec.method != "draft_model":
            return None
        if self.config.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config: method 'draft_model' does not run with tensor_parallel_size > 1"
            )
        windows = {self.loaded.config.layer_window(i) for i in range(self.loaded.config.num_hidden_layers)}
        if windows != {None}:
            raise ValueError(
                "speculative_config: method 'draft_model' does not run on a sliding-window model"
            )
        from tokenmill.model.loader import load_model
        from tokenmill.model.registry import resolve
        from tokenmill.worker.drafter import check_same_vocabulary

        # A draft's arithmetic needs no exactness (the target verifies every token): a quantized GGUF on CPU takes
        # "gguf-q4", its projections 4-bit and 8-bit activations: a draft token reads the fewest bytes (the 0.5B
        # Qwen's Q5_0 / Q8_0 projections as 4-bit codes: ~526 -> ~422 MB read and 21 -> ~14 ms a
        # token on 2 Zen 4 cores).
        path = resolve(str(spec.model))
        load = functools.partial(load_model, path, device=self.config.device, dtype=self.config.dtype)
        on_cpu = self.loaded.device.type == "cpu" and self.loaded.dtype == torch.float32
        if spec.quantization is not None:  # asked for: loaded so, or refused by the loader naming it
            draft = load(quantization=spec.quantization)
        elif on_cpu and path.endswith(".gguf"):
            try:
                draft = load(quantization="gguf-q4")
            except ValueError:  # no C++ kernels, or nothing quantized in it: the default path
                draft = load()
        else:
            draft = load()
        check_same_vocabulary(self.loaded, draft)
        if draft.config.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"speculative_config.model {spec.model!r} holds {draft.config.max_position_embeddings} positions, "
                f"fewer than max_model_len ({self.max_model_len})"
            )
        return draft

    def _blocks_from_budget(self, bytes_per_block: int) -> int:
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            budget = int(_free_memory_bytes(self.loaded.device) * self.config.kv_cache_memory_fraction)
            if getattr(self.loaded.device, "type", str(self.loaded.device)) == "cpu":
                # A share of free memory alone gave a 24 GiB box a 2.4 GB pool, more than 2 cores fill: 2 GiB
                # holds 37k tokens of Qwen2.5-1.5B in fp32 (64 requests of 580), 45k of SmolLM2-135M.
                budget = min(budget, DEFAULT_CPU_KV_CACHE_MAX_BYTES)
        num_blocks = budget // bytes_per_block
        # More blocks than every row at full length can use would only hold memory.
        cap = math.ceil(self.config.max_num_seqs * self.max_model_len / self.config.block_size)
        num_blocks = min(num_blocks, cap)
        if num_blocks < 1:
            raise ValueError(f"KV-cache budget of {budget} bytes holds no block of {bytes_per_block} bytes")
        return num_blocks

    # --- requests ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they also exit with this process)."""
        if self.tp_group is not None:
            self.tp_group.close()
        if self.kv_disk is not None:
            self.kv_disk.close()

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams from the model's generation defaults (``generation_defaults``), ``overrides`` on top
        (a value of None leaves the default; a greedy temperature drops the defaults' sampling filters)."""
        from tokenmill.generation_defaults import for_request

        fields = for_request(self.generation_defaults.values, overrides.get("temperature"))
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**fields)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time_s: float | None = None,
        cache_salt: str | None = None,
        grammar: Any = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request; BadRequestError (a ValueError) naming the field for bad input (empty or
        out-of-vocabulary prompt, too long, duplicate id, a constraint that does not compile).

        ``params`` None: :meth:`default_sampling_params` (the model's generation defaults). ``grammar``: the
        request's constraint compiled already (:meth:`structured_outputs`), else it is compiled here.
        ``lora_request``: the LoRA adapter to run with (loaded now if it is not; needs ``enable_lora``)."""
        params = params or self.default_sampling_params()
        text, token_ids = self._prompt_tokens(prompt, params)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif request_id in self._requests:
            raise BadRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        for tok in params.stop_token_ids:
            self._check_vocab(tok, "stop_token_ids")
        for tok in params.logit_bias:
            self._check_vocab(tok, "logit_bias")
        adapter = None if lora_request is None else self.add_lora(lora_request)
        # a constraint not compiled yet is compiled now: a bad one is a ValueError before the request is queued
        if params.structured_outputs is not None and grammar is None:
            grammar = self.structured_outputs().compile(params.structured_outputs)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time_s=self.clock() if arrival_time_s is None else arrival_time_s,
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            prompt=text,
            cache_salt=cache_salt,
            lora_id=0 if lora_request is None else lora_request.lora_int_id,
            lora_key=None if adapter is None else adapter.digest,
            grammar=None if params.structured_outputs is None else grammar,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            ),
        )
        self.scheduler.add_request(request)  # raises ValueError when it could never fit
        self._requests[request_id] = request
        return request_id

    def _prompt_tokens(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its token ids; BadRequestError for an empty prompt, an
        id out of the vocabulary, or generation asked of an embedding model."""
        if self.is_pooling and params.max_tokens != 0:
            raise BadRequestError(
                f"{self.model_name} is an embedding model: it generates no tokens (use embed(), or max_tokens=0)",
                param="max_tokens",
            )
        if isinstance(prompt, str):
            if prompt == "":
                raise BadRequestError("prompt must not be empty", param="prompt")
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text = None
            token_ids = self.validate_token_ids(prompt)
        if not token_ids:
            raise BadRequestError("prompt must contain at least one token", param="prompt")
        return text, token_ids

    @property
    def built_structured_outputs(self) -> Any:
        """:meth:`structured_outputs` if a constrained request built it, else None (never builds it)."""
        return self._structured_outputs

    def structured_outputs(self) -> Any:
        """The engine's :class:`~tokenmill.structured_outputs.StructuredOutputs`, built at the first
        constrained request (~1 s: the tokenizer). Thread-safe: the server compiles constraints off the
        engine thread with it and hands the matchers to :meth:`add_request` as ``grammar``."""
        with self._structured_lock:
            if self._structured_outputs is None:
                from tokenmill.structured_outputs import StructuredOutputs

                self._structured_outputs = StructuredOutputs(
                    self.tokenizer.to_json(),
                    self.loaded.config.vocab_size,
                    sorted(self.tokenizer.eos_token_ids),
                )
        return self._structured_outputs

    def validate_token_ids(self, prompt: Sequence[int]) -> list[int]:
        token_ids = list(prompt)
        for tok in token_ids:
            self._check_vocab(tok, "prompt")
        return token_ids

    def _check_vocab(self, tok: object, name: str) -> None:
        vocab_size = self.tokenizer.vocab_size
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise BadRequestError(
                f"{name}: token id {tok!r} is out of vocabulary (valid ids are 0..{vocab_size - 1})",
                param=name,
            )

    def abort(self, request_id: str) -> bool:
        """End a request (waiting, running or preempted) as aborted; False when it is unknown or finished.

        Its blocks return to the pool at once; its final delta comes out of the next ``step()``.
        """
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED, now_s=self.clock())
        self._pending_finished.append(request)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_manager.usage

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # --- the loop -----------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One iteration. A forward that raises (any Exception: out of memory, a kernel bug) costs only the
        step's own requests: they end with ``finish_reason="error"`` and their blocks return to the pool, the
        exception is kept in ``StepResult.error``, and the next step serves everyone else."""
        start_s = time.perf_counter()  # the roofline's wall time (the engine's clock may be a unit clock)
        if self.kv_disk is not None:  # the disk's blocks of the prefixes of the requests admissible now
            room = self.scheduler_config.max_num_seqs - self.scheduler.num_running
            self.kv_disk.promote(self.kv_manager, self.scheduler.waiting, room)
        scheduler_output = self.scheduler.schedule(now_s=self.clock())
        kind = step_kind(scheduler_output.rows) if scheduler_output.rows else ""  # "": an idle step
        if self.thread_governor is not None and kind:
            self.thread_governor.begin_step(kind)
        if kind:
            self._claim_threads()
        result = StepResult(record=scheduler_output.record)
        try:
            runner_output = self.runner.execute(scheduler_output)
        except Exception as exc:
            result.error = exc
            self.stats.num_failed_steps += 1
            now_s = self.clock()
            message = f"{STEP_FAILED} {type(exc).__name__}: {exc}"
            return self._report(result, self.scheduler.fail_step(scheduler_output, message, now_s), now_s)
        now_s = self.clock()
        touched = self.scheduler.update_from_output(scheduler_output, runner_output, now_s)
        if self.kv_disk is not None:  # copied before the next step can overwrite a freed block
            self.kv_disk.offload(self.kv_manager.take_newly_cached())
        self._advance_grammars(touched, now_s)
        for request_id, entries in runner_output.prompt_logprobs.items():
            self._requests[request_id].add_prompt_logprobs(entries)
        for request_id, vector in runner_output.pooled.items():
            self._requests[request_id].set_embedding(vector)
        result = self._report(result, touched, now_s)
        if self.roofline is not None and kind:
            step_s = time.perf_counter() - start_s
            bound_s = self.roofline.bound_s(scheduler_output.rows)
            self.stats.add_roofline(kind, bound_s, step_s)
            result.roofline_kind, result.roofline_fraction = kind, bound_s / step_s
        if self.thread_governor is not None and self._governor_roofline is not None and kind:
            bound_s = self._governor_roofline.bound_s(scheduler_output.rows)
            self.thread_governor.observe(kind, bound_s, time.perf_counter() - start_s)
        if self.thread_governor is not None and not self._requests:
            self.thread_governor.idle()  # a probe's trial count must not outlast the work
        return result

    def _claim_threads(self) -> None:
        """torch's thread count is the process's: another engine in it (a benchmark's second engine)
        may have set its own since this engine's last step. Set this engine's again where it differs."""
        import torch

        want = self.thread_governor.applied if self.thread_governor is not None else self._num_threads
        if want is not None and torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def _advance_grammars(self, touched: list[Request], now_s: float) -> None:
        """Feed each constrained request's matcher its new tokens; a complete grammar ends it ("stop")."""
        from tokenmill.structured_outputs import advance

        for request in touched:
            if request.grammar is None or request.is_finished:
                continue
            outcome = advance(request.grammar, request.take_grammar_token_ids())
            if outcome == "stop":
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, now_s=now_s)
            elif outcome is not None:
                self.scheduler.finish_request(
                    request.request_id,
                    RequestStatus.FINISHED_ABORTED,
                    now_s=now_s,
                    error=(CONSTRAINT_FAILED, outcome),
                )

    def _report(self, result: StepResult, touched: list[Request], now_s: float) -> StepResult:
        """A delta for every request the step touched or that was aborted since the last one."""
        seen: set[str] = set()
        new_output: list[tuple[Request, list[int], str, int]] = []
        # `touched` includes requests the scheduler itself ended (preemption bound); aborts come from abort().
        for request in [*touched, *self._pending_finished]:
            if request.request_id in seen or request.request_id not in self._requests:
                continue
            seen.add(request.request_id)
            new_output.append(self._detokenize(request))
        self._pending_finished.clear()
        # every decision is taken (stop strings included): the deltas only read
        for request, new_ids, new_text, num_logprobs_before in new_output:
            result.deltas.append(self._make_delta(request, new_ids, new_text, num_logprobs_before))
            if request.is_finished:
                result.finished.append(self._finish(request))
        self.stats.add_step(result.record, sum(len(d.new_token_ids) for d in result.deltas))
        self.stats.num_prefix_evicted_blocks = self.kv_manager.pool.num_evicted_blocks
        if self.kv_disk is not None:
            self.kv_disk.count_into(self.stats, self.config.block_size)
        self.stats.num_finished += len(result.finished)
        return result

    def _detokenize(self, request: Request) -> tuple[Request, list[int], str, int]:
        """The request's new tokens and their text; a stop string in it ends the request (the scheduler's
        ``finish_request``). Returns what the delta reports: (request, new ids, new text, logprobs before)."""
        num_logprobs_before = request.num_returned_tokens
        new_ids = request.take_new_token_ids()
        detok: IncrementalDetokenizer = request.detokenizer
        num_new = len(new_ids)
        new_text, num_taken = detok.add_until_stop(new_ids)
        new_ids = new_ids[:num_taken]  # tokens after a stop string's end (several in one step) are dropped
        if detok.stop_string is not None and not request.is_finished:
            self.scheduler.finish_request(
                request.request_id,
                RequestStatus.FINISHED_STOPPED,
                stop_reason=detok.stop_string,
                num_output_tokens=num_logprobs_before + len(new_ids),
            )
        elif (
            detok.stop_string is not None
            and num_taken < num_new
            and request.finish_reason in ("stop", "length")
        ):
            # the step's last token ended it (EOS, a stop id, max_tokens), the string came first: the string wins
            request.restate_stop_string(detok.stop_string, num_logprobs_before + len(new_ids))
        if request.is_finished and detok.stop_string is None:
            new_text += detok.flush()
        request.set_output_text(detok.text)
        return request, new_ids, new_text, num_logprobs_before

    def _make_delta(
        self, request: Request, new_ids: list[int], new_text: str, num_logprobs_before: int
    ) -> RequestDelta:
        first_delta = request.request_id not in self._announced
        self._announced.add(request.request_id)
        new_logprobs = None
        if request.sampling_params.logprobs is not None:
            new_logprobs = [_to_logprob(t) for t in request.output_logprobs[num_logprobs_before:]]
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            error=request.error,
            error_kind=request.error_kind,
            new_logprobs=new_logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=request.prompt_logprobs if first_delta else None,
            embedding=request.embedding if request.is_finished else None,
            metrics=RequestMetrics.of(request) if request.is_finished else None,
        )

    def _finish(self, request: Request) -> RequestOutput:
        del self._requests[request.request_id]
        self._announced.discard(request.request_id)
        return self.to_output(request)

    def to_output(self, request: Request) -> RequestOutput:
        logprobs = None
        if request.sampling_params.logprobs is not None:
            logprobs = [_to_logprob(t) for t in request.output_logprobs]
        completion = CompletionOutput(
            index=0,
            text=request.output_text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            error=request.error,
            error_kind=request.error_kind,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[completion],
            finished=request.is_finished,
            metrics=RequestMetrics.of(request),
            prompt_logprobs=request.prompt_logprobs,
            embedding=request.embedding,
        )

    def embed(self, prompts: Prompts) -> list[list[float]]:
        """An embedding model's vector for each prompt (a string or token ids), in order."""
        if not self.is_pooling:
            raise BadRequestError(f"{self.model_name} is not an embedding model", param="model")
        outputs = self.generate(prompts, SamplingParams(max_tokens=0, temperature=0.0))
        for output in outputs:
            if output.embedding is None:
                raise RuntimeError(
                    f"request {output.request_id}: {output.outputs[0].error or 'no embedding'}"
                )
        return [output.embedding for output in outputs if output.embedding is not None]

    def generate(
        self,
        prompts: Prompts,
        params: ParamsArg = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one RequestOutput per prompt, in order. ``lora_request``: one adapter for
        every prompt, or one (or None) per prompt."""
        prompt_list = as_prompt_list(prompts)
        if isinstance(params, Sequence):
            if len(params) != len(prompt_list):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_list)} prompts")
            param_list = list(params)
        else:
            param_list = [params or self.default_sampling_params()] * len(prompt_list)
        if isinstance(lora_request, Sequence):
            if len(lora_request) != len(prompt_list):
                raise ValueError(f"got {len(lora_request)} LoRA requests for {len(prompt_list)} prompts")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(prompt_list)
        ids = [
            self.add_request(p, sp, lora_request=lora)
            for p, sp, lora in zip(prompt_list, param_list, loras, strict=True)
        ]
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        wanted = set(ids)
        while wanted - results.keys():
            for output in self.step().finished:
                if output.request_id in wanted:
                    results[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]


def as_prompt_list(prompts: Prompts) -> list[Prompt]:
    """One prompt (a string or a list of token ids) or several, as a non-empty list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if not items:
        raise ValueError("prompts must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _to_logprob(token: Any) -> Logprob:
    if isinstance(token, Logprob):
        return token
    if isinstance(token, SampledToken):
        return Logprob(token.token_id, float(token.logprob or 0.0), list(token.top_logprobs or []))
    raise TypeError(f"unexpected logprob record {token!r}")


def _model_name(source: str) -> str:
    """What clients call the model: the directory's name, or the GGUF file's without its quantization suffix
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``)."""
    import re
    from pathlib import Path

    name = Path(source).name
    if not name.endswith(".gguf"):
        return name
    return re.sub(r"[.-](Q\d\w*|IQ\d\w*|F16|F32|BF16)$", "", name[: -len(".gguf")], flags=re.IGNORECASE)


def _free_memory_bytes(device: Any) -> int:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
