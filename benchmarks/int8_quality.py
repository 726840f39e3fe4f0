"""What weight-only int8 costs in quality: the embedded model in fp32 next to the same model with int8 weights.

    python benchmarks/int8_quality.py [--tokens 32] [--threads N] [--gguf-q8] [--bf16]

1. Greedy agreement: 16 varied prompts (half through the chat template, half as raw text), ``--tokens``
   greedy tokens each with EOS ignored. Reported: the fraction of prompts whose continuations are
   identical, the mean number of matching leading tokens (after a divergence the texts differ, so later
   tokens say little), and how close fp32's own choice was where the two part (the gap between its
   top-2 logprobs there: small gaps mean near-ties that any rounding change can flip).
2. Log-likelihood of a fixed paragraph (:data:`TEXT`, a few hundred tokens), teacher-forced: the mean
   per-token negative log-likelihood and the perplexity under each, their difference, and how often the
   two models' top-1 next-token predictions agree along the text.

Both engines run on the same device and dtype (fp32 on CPU); only the weights of the projections and the
LM head differ.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.engine import Engine  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

CHAT_PROMPTS = [
    "What is the capital of Australia, and why was it chosen?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences how a refrigerator keeps food cold.",
    "List three tips for getting better sleep.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "If a train travels 60 miles in 1.5 hours, what is its average speed?",
    "Translate 'Good morning, how are you?' into French.",
    "Give me a short summary of the plot of Romeo and Juliet.",
]
RAW_PROMPTS = [
    "The history of the printing press begins",
    "Once upon a time, in a small village by the sea, there lived",
    "def quicksort(items):\n    ",
    "The three primary colors are",
    "Photosynthesis is the process by which",
    "In 1969, the Apollo 11 mission",
    "Dear hiring manager, I am writing to apply for",
    "The best way to learn a new language is",
]

TEXT = (
    "The old lighthouse stood at the end of a narrow spit of rock, a mile beyond the last house in the "
    "village. For more than a century it had warned ships away from the reef that lay hidden under the "
    "grey water, and the people of the village still spoke of it as if it were a living thing. When the "
    "keeper retired, nobody was sent to replace him. The light was automated, the little cottage at its "
    "base was locked, and the path that led to it slowly disappeared under grass and sea thrift.\n\n"
    "Every summer, though, children from the village walked out along the rocks at low tide to look at "
    "it. They pressed their faces against the salt-stained windows of the cottage and told each other "
    "stories about the keeper: that he had once rescued a whole crew from a sinking fishing boat, that he "
    "kept a parrot that could whistle sea shanties, that on stormy nights he still climbed the stairs to "
    "check on the lamp. Most of the stories were not true, but a few of them were, and nobody could quite "
    "remember which.\n\n"
    "Scientists who study coastal erosion say that the rock beneath the lighthouse is wearing away by a "
    "few centimetres every year. In time the sea will reach the foundations, and the tower will have to "
    "be taken down or moved inland, stone by stone. The village council has already begun to discuss "
    "the cost. Some people argue that the money would be better spent on the school, the harbour wall or "
    "the road that floods every winter. Others say that a village without its lighthouse would no "
    "longer be the same place, and that some things are worth keeping simply because they have always "
    "been there.\n\n"
    "For now, the light still turns every night, sweeping its pale beam across the water in the same "
    "slow rhythm it has kept for a hundred years, and the ships still give the reef a wide berth."
)


@dataclass
class Likelihood:
    mean_nll: float
    top1: list[int]  # the model's argmax next token at each scored position


@dataclass
class Continuation:
    token_ids: list[int]
    top2_gaps: list[float]  # logprob of the best token minus the second best, per position


def greedy(engine: Engine, prompts: list[list[int]], num_tokens: int) -> list[Continuation]:
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, logprobs=2)
    outputs = [out.outputs[0] for out in engine.generate(prompts, params)]
    return [
        Continuation(
            out.token_ids, [lp.top_logprobs[0][1] - lp.top_logprobs[1][1] for lp in out.logprobs or []]
        )
        for out in outputs
    ]


def likelihood(engine: Engine, token_ids: list[int]) -> Likelihood:
    """Teacher-forced log-likelihood of ``token_ids[1:]`` given the tokens before each."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    entries = engine.generate([token_ids], params)[0].prompt_logprobs
    assert entries is not None and entries[0] is None
    scored = [e for e in entries[1:] if e is not None]
    return Likelihood(
        mean_nll=-sum(e.logprob for e in scored) / len(scored),
        top1=[e.top_logprobs[0][0] for e in scored],
    )


def leading_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_prompts(engine: Engine) -> list[list[int]]:
    tokenizer = engine.tokenizer
    chat = [list(tokenizer.encode_chat([{"role": "user", "content": p}])) for p in CHAT_PROMPTS]
    raw = [list(tokenizer.encode(p)) for p in RAW_PROMPTS]
    return chat + raw


def compare(reference: Engine, candidate: Engine, num_tokens: int) -> dict[str, float]:
    """Greedy agreement and likelihood numbers of ``candidate`` against ``reference``."""
    prompts = build_prompts(reference)
    ref_out, cand_out = greedy(reference, prompts, num_tokens), greedy(candidate, prompts, num_tokens)
    matches = [leading_match(a.token_ids, b.token_ids) for a, b in zip(ref_out, cand_out, strict=True)]
    # Where the two first part, how close was the reference's own choice (its top-2 logprob gap)?
    gaps = [out.top2_gaps[m] for out, m in zip(ref_out, matches) if m < num_tokens]
    text_ids = list(reference.tokenizer.encode(TEXT))
    ref_ll, cand_ll = likelihood(reference, text_ids), likelihood(candidate, text_ids)
    top1_agree = sum(a == b for a, b in zip(ref_ll.top1, cand_ll.top1, strict=True)) / len(ref_ll.top1)
    return {
        "num_prompts": len(prompts),
        "identical_fraction": sum(m == num_tokens for m in matches) / len(prompts),
        "mean_leading_match": sum(matches) / len(matches),
        "min_leading_match": min(matches),
        "median_gap_at_divergence": statistics.median(gaps) if gaps else float("nan"),
        "max_gap_at_divergence": max(gaps, default=float("nan")),
        "text_tokens": len(text_ids),
        "nll_ref": ref_ll.mean_nll,
        "nll_cand": cand_ll.mean_nll,
        "top1_agreement": top1_agree,
    }


def use_int_mm(engine: Engine) -> None:
    """Run this engine's Int8Linear layers through ``torch._int_mm`` on per-row int8 activations.

    The path ``quant.py`` rejected (faster from 4 rows up, see ``bench_int8_matmul.py``), kept here so its
    quality cost stays measurable. Patches the instances of this one engine only.
    """
    import torch

    from benchmarks.bench_int8_matmul import int_mm_dynamic
    from tokenmill.model.quant import Int8Linear

    def forward(layer: Int8Linear, w_int8_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, layer.in_features)  # [T, in]
        out = int_mm_dynamic(x2d, w_int8_t, layer.scales.float())  # [T, out]
        return out.to(x.dtype).view(*x.shape[:-1], layer.out_features)

    for module in engine.loaded.model.modules():
        if isinstance(module, Int8Linear):
            module.forward = partial(forward, module, module.weight_int8.t().contiguous())  # [in, out]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory (default: embedded)")
    parser.add_argument("--int-mm", action="store_true", help="also measure the rejected torch._int_mm path")
    parser.add_argument("--bf16", action="store_true", help="also the whole model in bf16, for scale (slow)")
    parser.add_argument(
        "--gguf-q8",
        action="store_true",
        help="also quantization='gguf-q8' (8-bit activations on the GGUF blocks)",
    )
    args = parser.parse_args()

    common = {"model": args.model, "device": "cpu", "num_threads": args.threads}
    common["num_kv_blocks"] = 256  # 16 short prompts + 32 tokens, or the text: a few hundred tokens
    t0 = time.perf_counter()
    reference = Engine(**common, dtype="float32")
    candidates = {"int8": Engine(**common, dtype="float32", quantization="int8")}
    if args.int_mm:
        candidates["int8 int_mm"] = Engine(**common, dtype="float32", quantization="int8")
        use_int_mm(candidates["int8 int_mm"])
    if args.bf16:
        candidates["bf16"] = Engine(**common, dtype="bfloat16")
    if args.gguf_q8:
        candidates["gguf-q8"] = Engine(**common, dtype="float32", quantization="gguf-q8")
    print(f"loaded {len(candidates) + 1} engines in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    results = {name: compare(reference, engine, args.tokens) for name, engine in candidates.items()}
    print(f"measured in {time.perf_counter() - t0:.1f} s\n")

    first = next(iter(results.values()))
    n, k, num_text = int(first["num_prompts"]), args.tokens, int(first["text_tokens"])
    rows: list[tuple[str, str, Callable[[dict[str, float]], str]]] = [
        ("identical continuations", "-", lambda r: f"{r['identical_fraction'] * n:.0f}/{n}"),
        ("mean matching lead tokens", f"{k}", lambda r: f"{r['mean_leading_match']:.1f}"),
        ("min matching lead tokens", f"{k}", lambda r: f"{r['min_leading_match']:.0f}"),
        ("fp32 top-2 gap where they part, median", "-", lambda r: f"{r['median_gap_at_divergence']:.3f}"),
        ("fp32 top-2 gap where they part, max", "-", lambda r: f"{r['max_gap_at_divergence']:.3f}"),
        ("text: mean NLL (nats/token)", f"{first['nll_ref']:.4f}", lambda r: f"{r['nll_cand']:.4f}"),
        ("text: perplexity", f"{math.exp(first['nll_ref']):.3f}", lambda r: f"{math.exp(r['nll_cand']):.3f}"),
        ("text: NLL minus fp32", "-", lambda r: f"{r['nll_cand'] - r['nll_ref']:+.4f}"),
        ("text: top-1 agreement with fp32", "-", lambda r: f"{r['top1_agreement']:.1%}"),
    ]
    print(f"{n} prompts x {k} greedy tokens; a fixed text of {num_text} tokens ({num_text - 1} scored)")
    width = max(len(label) for label, _, _ in rows)
    print(f"{'':<{width}} {'fp32':>8}" + "".join(f" {name:>12}" for name in results))
    for label, ref_cell, cell in rows:
        print(f"{label:<{width}} {ref_cell:>8}" + "".join(f" {cell(r):>12}" for r in results.values()))


if __name__ == "__main__":
    main()
