"""Speculative decoding against plain decoding, on three kinds of work and on random tokens.

    python -m benchmarks.spec --model qwen2.5-coder-1.5b-instruct [--concurrency 1,8] [--methods off,ngram]

Workloads (``--workloads``; prompts through the model's chat template, greedy, ``max_tokens`` each):

- ``edit``: a function in the prompt, "add type hints and a docstring" (input-grounded: the answer copies it);
- ``summary``: a passage and "summarise it, quoting its key sentences" (partly grounded);
- ``open``: "write a function that ..." with nothing to copy (open-ended code generation);
- ``random``: random token ids, no template (little to match: the cost of speculating for nothing; the 1.5B's
  greedy answer to noise often repeats itself, which prompt lookup then catches).

Methods: ``off``, ``ngram`` (prompt lookup), ``draft_model`` (``--draft-model NAME``, e.g. the 0.5B for the 1.5B;
``draft_model:gguf-q8`` loads the draft with that quantization instead of its default, ``gguf-q4``).

At concurrency c the first c prompts of a workload (the list repeated past its end) run together (one ``generate``
call; with ``--rounds R``, R such calls one after another over the next prompts); the model is loaded once and each method gets its own engine on it, warmed up untimed. Per (workload,
concurrency, method): wall time, output tokens/s, the speed-up over ``off`` in the same run, the share of outputs
identical to ``off``'s, and speculation's counts: acceptance rate (accepted / proposed tokens), mean acceptance
length (tokens per verification row: 1 + accepted / verifications) and the waste (decode positions computed for
rejected tokens).
Times are this machine's; the counts hold anywhere.

Where ``off`` runs, each workload's line after the table bounds prompt lookup from ``off``'s own outputs: the
speed-up it would give if verifying cost nothing, ``tokens / steps`` when every step takes 1 + the accepted length
of the proposal the ngram proposer (``core/proposers.py``, no back-off) makes there, for ``num_speculative_tokens``
and for proposals of any length. A count, true on any machine: a target above it is out of the method's reach on
that workload whatever the kernels.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

FUNCTIONS = [
    "def fib(n):\n    if n < 2:\n        return n\n    a, b = 0, 1\n    for _ in range(n - 1):\n"
    "        a, b = b, a + b\n    return b\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n"
    "        if n % d == 0:\n            return False\n    return True\n",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n",
    "def word_counts(text):\n    counts = {}\n    for word in text.lower().split():\n"
    "        word = word.strip('.,;:!?')\n        if word:\n            counts[word] = counts.get(word, 0) + 1\n"
    "    return counts\n",
    "def flatten(items):\n    result = []\n    for item in items:\n        if isinstance(item, list):\n"
    "            result.extend(flatten(item))\n        else:\n            result.append(item)\n    return result\n",
    "def binary_search(values, target):\n    lo, hi = 0, len(values) - 1\n    while lo <= hi:\n"
    "        mid = (lo + hi) // 2\n        if values[mid] == target:\n            return mid\n"
    "        if values[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n    return -1\n",
    "def chunk(seq, size):\n    if size <= 0:\n        raise ValueError('size must be positive')\n"
    "    return [seq[i:i + size] for i in range(0, len(seq), size)]\n",
    "def parse_kv(line):\n    result = {}\n    for part in line.split(';'):\n        if '=' not in part:\n"
    "            continue\n        key, value = part.split('=', 1)\n        result[key.strip()] = value.strip()\n"
    "    return result\n",
]
PASSAGES = [
    "The lighthouse on the northern cape was built in 1871 from granite quarried two miles inland. Its lamp "
    "burned whale oil until 1902, when a kerosene burner replaced it, and electricity arrived only in 1956. "
    "The keepers kept a log of every ship that passed, and the logs survive in the town library. In the storm "
    "of 1923 the keeper's daughter rowed out alone to reach a stranded schooner, and all nine sailors lived. "
    "The light was automated in 1988, and the keeper's house is now a small museum open in the summer.",
    "Sourdough bread rises because of a culture of wild yeast and lactic acid bacteria. The yeast produces "
    "carbon dioxide, which forms the bubbles in the crumb, while the bacteria produce acids that give the "
    "bread its sour taste and help it keep. A starter must be fed with flour and water every day or two. "
    "Bakers judge a starter ready when it doubles in volume within a few hours of feeding. Long, cool "
    "fermentation develops more flavour than a short, warm one.",
]
OPEN_TASKS = [
    "Write a Python function that validates an email address with a regular expression.",
    "Write a Python class for a fixed-size ring buffer with push, pop and len.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that returns the n most common words in a file.",
    "Write a Python function that computes the Levenshtein distance of two strings.",
    "Write a Python function that parses a CSV line with quoted fields.",
    "Write a Python function that checks whether a string of brackets is balanced.",
    "Write a Python function that rotates a square matrix by 90 degrees.",
]


def chat_prompts(kind: str) -> list[list[dict[str, str]]]:
    if kind == "edit":
        return [
            [
                {
                    "role": "user",
                    "content": f"Add type hints and a docstring to this function:\n```python\n{f}```",
                }
            ]
            for f in FUNCTIONS
        ]
    if kind == "summary":
        return [
            [
                {
                    "role": "user",
                    "content": f"Summarise this passage, quoting its key sentences exactly:\n\n{p}",
                }
            ]
            for p in PASSAGES * 4
        ]
    if kind == "open":
        return [[{"role": "user", "content": task}] for task in OPEN_TASKS]
    raise ValueError(kind)


def build_prompts(engine: Any, kind: str, n: int, seed: int = 0) -> list[list[int]]:
    if kind == "random":
        rng = random.Random(seed)
        vocab = engine.tokenizer.vocab_size
        return [[rng.randrange(vocab) for _ in range(256)] for _ in range(n)]
    messages = chat_prompts(kind)
    # more requests than prompts (32 concurrent): the list again, in order (their prefixes then cache alike)
    return [engine.tokenizer.encode_chat(messages[i % len(messages)]) for i in range(n)]


def run_one(engine: Any, prompts: list[list[int]], max_tokens: int, concurrency: int = 0) -> dict[str, Any]:
    """``prompts`` in consecutive ``generate`` calls of ``concurrency`` each (0: all in one call)."""
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    before = engine.stats.totals()
    size = concurrency or len(prompts)
    start = time.perf_counter()
    outputs = [
        o for i in range(0, len(prompts), size) for o in engine.generate(prompts[i : i + size], params)
    ]
    elapsed_s = time.perf_counter() - start
    after = engine.stats
    drafts = after.num_spec_drafts - before.num_spec_drafts
    proposed = after.num_spec_draft_tokens - before.num_spec_draft_tokens
    accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    decode = after.num_decode_tokens - before.num_decode_tokens
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "time_s": elapsed_s,
        "num_output_tokens": num_tokens,
        "output_tps": num_tokens / elapsed_s,
        "iterations": after.num_iterations - before.num_iterations,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "waste_fraction": (proposed - accepted) / decode if decode else 0.0,
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def ngram_bound(
    prompts: list[list[int]], outputs: list[list[int]], num_speculative_tokens: int
) -> tuple[int, int, int]:
    """(tokens, steps, steps with a proposal) if prompt lookup's proposals were verified for free: the outputs
    replayed through the ngram proposer, each step emitting 1 + the proposal's agreement with the output."""
    from tokenmill.config import SpeculativeConfig
    from tokenmill.core.proposers import NgramProposer

    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=num_speculative_tokens))
    num_tokens = num_steps = num_proposals = 0
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        t = 0
        while t < len(output):
            proposal = proposer.lookup(str(i), prompt + output[:t], num_speculative_tokens)
            accepted = 0
            while (
                accepted < len(proposal)
                and t + accepted < len(output)
                and proposal[accepted] == output[t + accepted]
            ):
                accepted += 1
            num_proposals += bool(proposal)
            num_steps += 1
            t += 1 + accepted
        num_tokens += len(output)
    return num_tokens, num_steps, num_proposals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--workloads", default="edit,summary,open,random")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument(
        "--methods",
        default="off,ngram",
        help="off, ngram, draft_model (needs --draft-model); draft_model:Q loads the draft with quantization Q "
        "(speculative_config.quantization, e.g. draft_model:gguf-q8 beside the default gguf-q4); a suffix @P sets "
        "draft_p_min (draft_model@0: every slot drafted, as before draft_p_min)",
    )
    parser.add_argument("--draft-model", default=None, help="the draft model for method draft_model")
    parser.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="speculative_config's (default 4)"
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument(
        "--quantization",
        default=None,
        help="the engine's (default: the model's default arithmetic, model/arithmetic.py)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="at concurrency c, this many consecutive batches of c prompts each (the workload's list in order, "
        "repeated): --concurrency 1 --rounds 8 runs eight prompts one after another, a single stream over more "
        "than the first prompt",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from tokenmill.engine import Engine
    from tokenmill.model.loader import load_model
    from tokenmill.system_info import collect, one_line

    loaded = load_model(args.model, quantization=args.quantization)
    engines = {}
    for method in args.methods.split(","):
        spec: dict[str, Any] | None = None
        if method != "off":
            named, _, p_min = method.partition("@")
            name, _, draft_quantization = named.partition(":")
            spec = {"method": name, "num_speculative_tokens": args.num_speculative_tokens}
            if name == "draft_model":
                spec["model"] = args.draft_model
            if draft_quantization:
                spec["quantization"] = draft_quantization
            if p_min:
                spec["draft_p_min"] = float(p_min)
            if args.disable_by_batch_size is not None:
                spec["disable_by_batch_size"] = args.disable_by_batch_size
        engines[method] = Engine(
            loaded=loaded, model=args.model, speculative_config=spec, max_num_batched_tokens=2048
        )
    warm = build_prompts(engines["off"], "open", 1)
    for engine in engines.values():
        run_one(engine, warm, 8)
    machine = one_line(collect())
    print(f"# {loaded.source} | {machine} | python {platform.python_version()}")
    header = (
        "| workload | conc | method | time s | tok/s | speed-up | same as off | accept | mean len | waste |"
    )
    print(header)
    print("| --- " * 10 + "|")
    rows = []
    bounds = []
    for kind in args.workloads.split(","):
        for conc in (int(c) for c in args.concurrency.split(",")):
            base: dict[str, Any] | None = None
            for method, engine in engines.items():
                prompts = build_prompts(engine, kind, conc * args.rounds)
                r = run_one(engine, prompts, args.max_tokens, conc)
                if method == "off" or base is None:
                    base = r
                if method == "off" and conc == 1:
                    k = args.num_speculative_tokens
                    found = [ngram_bound(prompts, r["token_ids"], n) for n in (k, 1 << 20)]
                    bounds.append(
                        f"# {kind}: prompt lookup with free verification, from off's outputs: at most "
                        f"{found[0][0] / found[0][1]:.2f}x (k = {k}; {found[0][0]} tokens in {found[0][1]} steps, "
                        f"{found[0][2]} with a proposal), {found[1][0] / found[1][1]:.2f}x with proposals of any "
                        "length"
                    )
                same = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"])) / len(prompts)
                speedup = r["output_tps"] / base["output_tps"]
                fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
                print(
                    f"| {kind} | {conc} | {method} | {r['time_s']:.2f} | {r['output_tps']:.2f} | {speedup:.2f}x | "
                    f"{same:.0%} | {fmt(r['acceptance_rate'])} | {fmt(r['mean_acceptance_length'])} | "
                    f"{r['waste_fraction']:.2f} |",
                    flush=True,
                )
                rows.append(
                    {
                        "workload": kind,
                        "concurrency": conc,
                        "method": method,
                        "speedup": speedup,
                        "same_as_off": same,
                        **{k: v for k, v in r.items() if k != "token_ids"},
                    }
                )
    for line in bounds:
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"model": loaded.source, "machine": machine, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
