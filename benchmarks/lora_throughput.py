"""Many LoRA adapters at once against the base model alone, side by side in one process.

    python -m benchmarks.lora_throughput [--model NAME] [--num-adapters 4] [--rank 16] [--num-requests 16]
                                         [--max-tokens 64] [--prompt-tokens 128] [--rounds 2]

Random rank-``--rank`` adapters on every projection (q, k, v, o, gate, up, down), or ``--targets`` (PEFT folders
written to a temporary directory), serve ``--num-requests`` concurrent requests spread evenly over them; the same requests run
on the base model in the same engine (``enable_lora=True``, ``max_loras`` = the adapters). Rounds alternate the
two; printed: the best tokens/s of each and their ratio (the target: adapters at least 0.85 of the base).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_name  # noqa: E402

MODULES = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}  # fmt: skip


def write_adapter(folder: Path, config, rank: int, seed: int, targets: list[str] | None = None) -> Path:  # type: ignore[no-untyped-def]
    """A random PEFT LoRA folder for a model of ``config`` (tokenmill's LlamaConfig) on ``targets`` (default: every
    projection)."""
    targets = list(MODULES) if targets is None else targets
    import torch
    from safetensors.torch import save_file

    from tokenmill.model.lora import part_shapes

    shapes = {name: (rows, cols) for parts in part_shapes(config).values() for name, rows, cols in parts}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            block, (rows, cols) = MODULES[module], shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, cols, generator=generator) / cols**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(rows, rank, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (folder / "adapter_config.json").write_text(json.dumps(config_json))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="qwen2.5-coder-1.5b-instruct", help="a pulled name, a path, or embedded"
    )
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--targets",
        default="all",
        help="all (every projection) or a comma list, e.g. q_proj,v_proj (peft's default)",
    )
    args = parser.parse_args(argv)
    from tokenmill import LLM, LoRARequest, SamplingParams

    llm = LLM(None if args.model == "embedded" else args.model, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
              enable_prefix_caching=False)  # fmt: skip
    config = llm.engine.loaded.config
    targets = None if args.targets == "all" else args.targets.split(",")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, config.vocab_size - 100) for _ in range(args.prompt_tokens)]
               for _ in range(args.num_requests)]  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        adapters = [
            LoRARequest(
                f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", config, args.rank, i, targets))
            )
            for i in range(args.num_adapters)
        ]
        loras = [adapters[i % len(adapters)] for i in range(args.num_requests)]
        llm.generate(
            prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras[:2]
        )  # warm-up
        best = {"base": 0.0, "adapters": 0.0}
        for round_ in range(args.rounds):
            for name, requests in (("base", None), ("adapters", loras)):
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                rate = tokens / (time.perf_counter() - start)
                best[name] = max(best[name], rate)
                print(f"round {round_ + 1}: {name:<8} {rate:7.1f} tok/s", flush=True)
    print(f"{cpu_name()}; {Path(llm.engine.loaded.source).name} ({llm.engine.quantization}); "
          f"{args.num_requests} requests over {args.num_adapters} adapters of rank {args.rank} on {args.targets}, "
          f"{args.prompt_tokens} + {args.max_tokens} tokens each")  # fmt: skip
    ratio = best["adapters"] / best["base"]
    print(f"base {best['base']:.1f} tok/s, adapters {best['adapters']:.1f} tok/s: {ratio:.3f}x "
          f"({'meets' if ratio >= 0.85 else 'below'} 0.85)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
