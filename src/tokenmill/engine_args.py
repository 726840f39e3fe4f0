"""The engine's command-line flags, shared by every command that builds an engine (generate, chat, serve,
bench). One definition, so `tokenmill serve --num-kv-blocks` and `tokenmill chat --num-kv-blocks` cannot drift."""

from __future__ import annotations

import argparse
import json

from tokenmill.config import KV_CACHE_DTYPES, QUANTIZATIONS, SPECULATION_AUTO, EngineConfig

DEFAULT_KV_DISK_BYTES = 8 << 30  # the disk tier's bound when a command builds the engine


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    _add_kv_cache_arguments(parser)
    _add_scheduling_arguments(parser)
    _add_compute_arguments(parser)
    _add_lora_arguments(parser)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and arithmetic")
    g.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF directory or a pulled model's name (default: embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    g.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="activations and unquantized weights (default: float32 on CPU, bfloat16 on CUDA)",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="for a GGUF on CPU the default is gguf-q8 where measured quality allows (`tokenmill info --load` "
        "says which and why); gguf: the exact path, fp32 activations times the quantized blocks' exact values; "
        "gguf-q8: the same blocks times activations rounded to 8 bits (per 256 for K-quants, else per 32), integer "
        "dot products (llama.cpp's "
        "arithmetic, faster); gguf-q4: as gguf-q8 with "
        "the projections rounded to 4 bits at load (approximate, fewest bytes: a draft's default); fp32: dequantize them "
        "at load; int8: weight-only int8 from the fp32 weights",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for fields a request leaves unset: auto (the model's generation_config.json, "
        "else tokenmill's: temperature 0.8, top_p 0.95, top_k 40, min_p 0.05), none "
        "(OpenAI's: temperature 1.0, no filters), or a directory holding a generation_config.json",
    )
    g.add_argument(
        "--engine-seed", type=int, default=0, help="the engine's base seed (for unseeded requests)"
    )


def _add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the prefix cache's unit)")
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="the KV pool's size in blocks (default: from its memory)",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="the KV pool's size in bytes (default: a tenth of free memory, at most 2 GiB on CPU)",
    )
    g.add_argument(
        "--reserve",
        default="none",
        choices=["none", "worst_case"],
        help="none: KV blocks given one at a time, preemption when they run out (vLLM); worst_case: prompt + "
        "max_tokens reserved at admission (TGI)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the KV cache's element type: auto (fp16 under llama.cpp's arithmetic, gguf-q8, the default for a "
        "GGUF on CPU; the model's dtype otherwise: fp32 on the exact path), fp32, fp16, bf16, fp8 (= fp8_e4m3, "
        "unscaled), int8 (a scale per token and head)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of repeated prompt prefixes (on by default; --no-enable-prefix-caching: off)",
    )
    g.add_argument(
        "--kv-cache-disk-bytes",
        type=int,
        default=DEFAULT_KV_DISK_BYTES,
        help="the prefix cache's disk tier: full KV blocks kept in files under the cache directory (least "
        "recently used out past this many bytes; default 8 GiB), read back when a prompt's prefix is not in "
        "memory, after an eviction or a restart",
    )
    g.add_argument(
        "--no-kv-cache-disk",
        dest="kv_cache_disk_bytes",
        action="store_const",
        const=0,
        help="turn the disk tier off",
    )
    g.add_argument("--kv-cache-disk-dir", default=None, help="the disk tier's folder (default: <cache>/kv)")


def _add_scheduling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scheduling")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests in one step at most")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per step; long prompts go in chunks of this (server default 512 on CPU, 2048 on CUDA)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens a request may reach (default: the model's)",
    )
    g.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\'; by default n-gram prompt lookup while fewer than 4 '
        'requests run (it never cost more than 2%% in benchmarks/spec.py); \'{"method": "none"}\' turns it off',
    )


def _add_compute_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("threads, parallelism and the machine's limits")
    g.add_argument("--num-threads", type=int, default=None, help="torch's threads (default: one a core)")
    g.add_argument(
        "--adaptive-threads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CPU, run with one thread fewer while that decodes faster (another process holding a core) "
        "and go back when it stops (on by default; --no-adaptive-threads: always --num-threads)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model's layers over this many processes (torch.distributed, gloo on CPU; fp32 weights)",
    )
    g.add_argument(
        "--hardware-limits",
        default="cached",
        metavar="cached|measure|none|GFLOPS,GBS",
        help="the machine's limits, for each step's fraction of them (tokenmill:step_roofline_fraction): "
        "'cached' (the default: measured once per machine in a few seconds, fp32 matmul, integer dot product, "
        "read bandwidth, and kept in the cache directory), 'measure' them again now, 'none' (off), or give "
        "them, e.g. 250,30",
    )


def _add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters on the model")
    g.add_argument(
        "--max-loras", type=int, default=1, help="adapters in one step (each a slot of --max-lora-rank)"
    )
    g.add_argument("--max-lora-rank", type=int, default=16, help="the highest rank an adapter may have")
    g.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept loaded (default: --max-loras)"
    )


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        reserve=args.reserve,
        quantization=args.quantization,
        num_threads=args.num_threads,
        adaptive_threads=getattr(args, "adaptive_threads", True),
        seed=args.engine_seed,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_disk_bytes=getattr(args, "kv_cache_disk_bytes", None),
        kv_cache_disk_dir=getattr(args, "kv_cache_disk_dir", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        generation_config=args.generation_config,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=getattr(args, "speculative_config", None) or SPECULATION_AUTO,
        hardware_limits=getattr(args, "hardware_limits", None),
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        max_cpu_loras=getattr(args, "max_cpu_loras", None),
    )
