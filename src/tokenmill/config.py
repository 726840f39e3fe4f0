"""Frozen, validated configuration. Pure Python: bad values raise ValueError naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Reserve = Literal["none", "worst_case"]
# The token budget of a step when none is given, per device type (EngineConfig.max_num_batched_tokens): a
# server's, where a long prompt's chunks must leave room for other requests' decode rows and aborts.
DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}
# ... and offline (LLM), where only throughput counts, as vLLM gives its LLM class a larger budget than its
# server. Case (b) of the suite on 2 AVX2 cores: 20.4 s at 512, 19.3 s at 1,024 and 2,048, 20.2 s at 4,096.
OFFLINE_BATCHED_TOKENS = 2048
# EngineConfig.quantization (model/loader.py applies it). None: for a quantized GGUF on CPU in fp32 with the C++
# kernels, the arithmetic model/arithmetic.py chooses for that file ("gguf-q8" where measured quality allows, and
# for files not measured; "gguf" where not), else the weights in the dtype; "gguf": GGUF blocks kept quantized
# (model/gguf_blocks.py), the exact path: fp32 arithmetic on their exact values; "gguf-q8": the same blocks times
# activations rounded to 8 bits (per 256 for K-quants, else per 32) with integer dot products (llama.cpp's arithmetic, faster); "gguf-q4": as gguf-q8 with the projections' blocks rounded to 4 bits
# with a min per 32 at load (approximate weights, the fewest bytes a token: a speculative draft's default);
# "fp32": a GGUF dequantized at load (a no-op for a directory); "int8": weight-only int8 made from the
# dequantized weights (model/quant.py).
QUANTIZATIONS = ("gguf", "gguf-q8", "gguf-q4", "fp32", "int8")
_RESERVE_CHOICES = ("none", "worst_case")
HARDWARE_LIMIT_MODES = (None, "none", "cached", "measure")  # or "GFLOPS,GBS"


@dataclass(frozen=True)
class CacheConfig:
    """The KV block pool: ``num_blocks`` blocks of ``block_size`` tokens each."""

    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_blocks", self.num_blocks)


SPECULATIVE_METHODS = ("ngram", "draft_model")
# EngineConfig.speculative_config "auto", what LLM() and the CLI give when none is asked for: n-gram prompt lookup
# (SpeculativeConfig's defaults, off from 4 running requests), none for an embedding model. benchmarks/spec.py on
# the 1.5B (gguf-q8, 2 Zen 4 cores, 2026-12-03): every workload at 0.98x or better of plain decoding, 1.07-3.15x
# at one stream. {"method": "none"} turns it off.
SPECULATION_AUTO = "auto"
# A draft token below this probability (the draft's own) ends the proposal. Qwen2.5-Coder-0.5B drafting for the
# 1.5B (gguf-q8) on the benchmark's open, edit and random prompts: of the tokens it gave 0.5 or more, 90-97% were
# the target's; of those below 0.5, 35-40%. A slot costs a draft forward (0.3 of a target step on 2 Zen 4
# cores) plus a verification row, so a guess right 2 times in 5 loses.
DEFAULT_DRAFT_P_MIN = 0.5


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's ``speculative_config`` keys (``core/proposers.py``).

    ``method="ngram"`` (prompt lookup): the longest suffix of prompt + output of ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens that occurred before proposes the up to ``num_speculative_tokens`` tokens that
    followed it. ``method="draft_model"``: a smaller model with the same vocabulary (``model``: a pulled name or
    a path) proposes them greedily (``worker/drafter.py``). Either way the target model verifies them in the same
    forward as everyone's decode rows.
    """

    method: str = "ngram"
    model: str | None = None  # the draft model (method "draft_model" only)
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # no proposals in a step that starts with this many running requests or more (0: never off). A batch of
    # decode rows is already past memory-bound on a CPU: on 2 Zen 4 cores the 1.5B's 8 concurrent code edits ran
    # 0.89x with proposals (each of 8 rows verifying 4 tokens), so the default turns them off from 4 on.
    disable_by_batch_size: int = 4
    # the draft model's quantization (QUANTIZATIONS; method "draft_model" only). None: "gguf-q4" for a quantized
    # GGUF draft on CPU (a draft needs no exact weights, only few bytes a token), else the model's default
    quantization: str | None = None
    # method "draft_model": the draft stops drafting at a token it gives less than this probability (llama.cpp's
    # --draft-p-min); a row whose first draft falls below it decodes plainly. None: DEFAULT_DRAFT_P_MIN.
    draft_p_min: float | None = None

    @property
    def resolved_draft_p_min(self) -> float:
        """``draft_p_min``, or DEFAULT_DRAFT_P_MIN when not given."""
        return DEFAULT_DRAFT_P_MIN if self.draft_p_min is None else float(self.draft_p_min)

    def __post_init__(self) -> None:
        if self.draft_p_min is not None:
            if self.method != "draft_model":
                raise ValueError("speculative_config.draft_p_min is only for method 'draft_model'")
            if (
                isinstance(self.draft_p_min, bool)
                or not isinstance(self.draft_p_min, int | float)
                or not 0.0 <= self.draft_p_min < 1.0
            ):
                raise ValueError(
                    f"speculative_config.draft_p_min must be a number in [0, 1), got {self.draft_p_min!r}"
                )
        if self.quantization is not None and self.method != "draft_model":
            raise ValueError("speculative_config.quantization is only for method 'draft_model'")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"speculative_config.quantization must be one of {', '.join(QUANTIZATIONS)}, "
                f"got {self.quantization!r}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError(
                "speculative_config: method 'draft_model' needs 'model' (a pulled name or a path)"
            )
        if self.method != "draft_model" and self.model is not None:
            raise ValueError("speculative_config.model is only for method 'draft_model'")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        _positive("speculative_config.num_speculative_tokens", self.num_speculative_tokens)
        _positive("speculative_config.prompt_lookup_min", self.prompt_lookup_min)
        _positive("speculative_config.prompt_lookup_max", self.prompt_lookup_max)
        if isinstance(self.disable_by_batch_size, bool) or not isinstance(self.disable_by_batch_size, int):
            raise ValueError("speculative_config.disable_by_batch_size must be an integer (0: never)")
        if self.disable_by_batch_size < 0:
            raise ValueError("speculative_config.disable_by_batch_size must be >= 0 (0: never)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) > prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """A dict as vLLM takes it (``{"method": "ngram", "num_speculative_tokens": 4}``); unknown keys refused.
        ``prompt_lookup_min``/``_max`` given alone set both ends (as vLLM does)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        fields = dict(value)
        if fields.get("method") == "none":
            if len(fields) > 1:
                raise ValueError("speculative_config: method 'none' (off) takes no other keys")
            return None
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
            "model",
            "quantization",
            "draft_p_min",
        }
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        if low is not None and high is None and low > cls.prompt_lookup_max:
            fields["prompt_lookup_max"] = low
        if high is not None and low is None and high < cls.prompt_lookup_min:
            fields["prompt_lookup_min"] = high
        return cls(**fields)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # vLLM's default; a closed batch of 256 decodes 8% cheaper per token than at 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    reserve: Reserve = "none"
    max_num_preemptions: int = 32  # a request preempted more often than this ends with an error
    # False: a prompt is admitted only when all of it fits the step's token budget (an encoder's bidirectional
    # attention needs every token of the row in one forward)
    enable_chunked_prefill: bool = True
    max_loras: int = 0  # distinct LoRA adapters among the running requests (0: adapters off)

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        _positive("max_num_preemptions", self.max_num_preemptions)
        if self.reserve not in _RESERVE_CHOICES:
            raise ValueError(f"reserve must be one of {_RESERVE_CHOICES}, got {self.reserve!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything a user can set when building an engine (``LLM(...)`` keywords and CLI flags).

    ``None`` means "derive it": ``max_model_len`` from the model, ``num_kv_blocks`` from
    ``kv_cache_memory_bytes`` or else ``kv_cache_memory_fraction`` of free memory, ``dtype`` and
    ``device`` from the hardware (fp32 on CPU, bf16 on CUDA).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.1
    max_num_seqs: int = 256  # vLLM's default; a closed batch of 256 decodes 8% cheaper per token than at 64
    # None: DEFAULT_BATCHED_TOKENS for the device (LLM: OFFLINE_BATCHED_TOKENS). A step costs about its tokens:
    # on 2 CPU cores ~0.5 s per 512 prompt tokens of SmolLM2-135M, so a served long prompt goes in chunks that
    # let decode rows (and aborts) in.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    reserve: Reserve = "none"
    max_num_preemptions: int = 32
    seed: int = 0
    quantization: str | None = None
    num_threads: int | None = None
    # on CPU, drop to one thread fewer while that decodes faster (a neighbour holding a core) and back when it
    # stops (worker/thread_governor.py); False: num_threads always
    adaptive_threads: bool = True
    enable_prefix_caching: bool = True  # reuse the KV of full blocks whose tokens (and cache_salt) repeat
    # the prefix cache's disk tier (worker/kv_offload.py): full blocks kept in files up to this many bytes, read
    # back on a prefix hit after an eviction or a restart; None or 0: off (the CLI's default: DEFAULT_KV_DISK_BYTES)
    kv_cache_disk_bytes: int | None = None
    kv_cache_disk_dir: str | None = None  # None: <cache directory>/kv
    # the KV cache's element type (vLLM's --kv-cache-dtype): "auto" (16 bits where the arithmetic is not the exact
    # path, the model's dtype otherwise: resolve_kv_cache_dtype), "fp32", "fp16", "bf16" (or their torch names),
    # "fp8" / "fp8_e4m3" (unscaled e4m3), "int8" (codes with a scale per token and head: model/kv_format.py)
    kv_cache_dtype: str = "auto"
    # sampling defaults for fields a request leaves unset: "auto" (the model's generation_config.json, else
    # tokenmill's sampled defaults), "none" (SamplingParams' own), or a directory with a generation_config.json
    generation_config: str = "auto"
    # ranks one model's layers are split over (worker/tensor_parallel.py; gloo on CPU)
    tensor_parallel_size: int = 1
    # speculative decoding (None: off): a SpeculativeConfig or vLLM's dict, {"method": "ngram", ...}, {"method":
    # "none"} (off), or SPECULATION_AUTO (LLM's and the CLI's default: n-gram lookup for a generative model)
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None
    # the machine's limits for each step's roofline fraction (tokenmill.measure.roofline): None or "none" (off), "cached"
    # (measured once per machine and kept in the cache directory, model/hardware_cache.py: the server's default),
    # "measure" (now, and cached), or "GFLOPS,GBS"
    hardware_limits: str | None = None
    # LoRA adapters (model/lora.py; vLLM's options): off unless enabled; at most max_loras adapters in one step
    # (each a slot of max_lora_rank per projection), at most max_cpu_loras kept loaded (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if isinstance(spec, str) and spec != SPECULATION_AUTO:
            raise ValueError(f"speculative_config must be a dict or {SPECULATION_AUTO!r}, got {spec!r}")
        if not isinstance(spec, str):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(spec))
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_preemptions", self.max_num_preemptions)
        for name in (
            "max_num_batched_tokens",
            "num_kv_blocks",
            "kv_cache_memory_bytes",
            "max_model_len",
            "num_threads",
        ):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
                + (" (fp8_e5m2 is not supported: fp8_e4m3 or int8)" * (self.kv_cache_dtype == "fp8_e5m2"))
            )
        disk = self.kv_cache_disk_bytes
        if disk is not None and (isinstance(disk, bool) or not isinstance(disk, int) or disk < 0):
            raise ValueError(f"kv_cache_disk_bytes must be a number of bytes (0: off), got {disk!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction}"
            )
        if self.reserve not in _RESERVE_CHOICES:
            raise ValueError(f"reserve must be one of {_RESERVE_CHOICES}, got {self.reserve!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {self.dtype!r}")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
            )
        if self.hardware_limits not in HARDWARE_LIMIT_MODES:
            parse_hardware_limits(self.hardware_limits)  # ValueError now, not at load
        if self.tensor_parallel_size > 1 and self.quantization not in (None, "fp32"):
            raise ValueError(
                f"tensor_parallel_size > 1 runs on fp32 weights; quantization={self.quantization!r} is not split"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of None, {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )


_KV_DTYPE_NAMES = {
    "fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "int8": "int8",
}  # fmt: skip
KV_CACHE_DTYPES = ("auto", *_KV_DTYPE_NAMES)
# arithmetics whose activations are rounded anyway (llama.cpp's): their KV in 16 bits, as llama.cpp's default f16
_ROUNDING_QUANTIZATIONS = ("gguf-q8", "gguf-q4")


def resolve_kv_cache_dtype(kv_cache_dtype: str, quantization: str | None, model_dtype: str) -> str:
    """The KV cache's torch dtype name for ``kv_cache_dtype``: "auto" is float16 under llama.cpp's arithmetic
    (``gguf-q8``, ``gguf-q4``), the model's own dtype otherwise (float32 for the exact path on CPU, bfloat16 on a
    GPU)."""
    if kv_cache_dtype != "auto":
        return _KV_DTYPE_NAMES[kv_cache_dtype]
    return "float16" if quantization in _ROUNDING_QUANTIZATIONS else model_dtype


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def parse_hardware_limits(text: str) -> tuple[float, float]:
    """``"250,30"`` -> (250e9 FLOP/s, 30e9 bytes/s); ValueError for anything else."""
    try:
        gflops, gbs = (float(p) for p in text.split(","))
    except ValueError:
        raise ValueError(
            f"hardware_limits is 'cached', 'measure', 'none' or GFLOPS,GBS (e.g. 250,30), got {text!r}"
        ) from None
    if not (gflops > 0 and gbs > 0):
        raise ValueError(f"hardware_limits: both limits must be positive, got {text!r}")
    return gflops * 1e9, gbs * 1e9
