"""What llama.cpp's arithmetic (``--quantization gguf-q8``: activations rounded to 8 bits per group, integer
dot products with the blocks' codes) costs in quality against the exact path (the same GGUF blocks in fp32
arithmetic), per model, on texts a package ships:

1. perplexity, teacher-forced over windows of ``--window`` tokens, on at least ``--num-tokens`` tokens of
   English prose (the Python documentation's topic texts, ``pydoc_data.topics``) and, for code models, of
   Python source (the standard library's own modules);
2. top-1 agreement: how often the two arithmetics' most likely next token is the same along those texts;
3. greedy agreement on 50 chat prompts (``--max-tokens`` tokens each): identical outputs, and the mean number
   of leading tokens that match.

The exact path keeps its KV in fp32; gguf-q8 runs with each ``--kv-cache-dtype`` given (default: auto, fp16), so
one run also measures what a 16- or 8-bit KV cache costs on top of the arithmetic.

The rule the defaults follow: gguf-q8 may be a model's default where its perplexity rises at most 1% on every
text and top-1 agreement is at least 97%.

    python -m benchmarks.arithmetic_quality --model qwen2.5-coder-0.5b-instruct [--num-tokens 20000]
        [--kv-cache-dtype auto --kv-cache-dtype int8 --kv-cache-dtype fp8]

gguf-q8 runs the forms ``model/arithmetic.py`` chose for the file; ``TOKENMILL_WIDE_QUADS=0/1`` (Q8_0 and IQ4 tensors
exact or rounded) and ``TOKENMILL_SUPER_BLOCK_ACTS=0/1`` (the K-quants' activations per group of 32 or per
super-block of 256) measure the others.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.int8_quality import leading_match
from tokenmill.engine import Engine
from tokenmill.sampling_params import SamplingParams

CHAT_PROMPTS = [
    "What is the capital of Australia, and why was it chosen?", "Write a haiku about autumn leaves.",
    "Explain in two sentences how a refrigerator keeps food cold.", "List three tips for better sleep.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "If a train travels 60 miles in 1.5 hours, what is its average speed?",
    "Translate 'Good morning, how are you?' into French.", "Summarize the plot of Romeo and Juliet.",
    "What is the difference between a list and a tuple in Python?", "Write a SQL query that counts users by country.",
    "Explain recursion to a ten-year-old.", "Give three uses of a hash map.",
    "Write a bash one-liner that counts lines in all .py files.", "What causes the seasons on Earth?",
    "Write a limerick about a cat who codes.", "Explain what an HTTP 404 error means.",
    "Write a JavaScript function that debounces another function.", "Name five prime numbers above 50.",
    "What is the time complexity of binary search, and why?", "Describe the water cycle briefly.",
    "Write a regular expression that matches an email address.", "What does 'git rebase' do?",
    "Explain the difference between TCP and UDP.", "Write a Python class for a stack with push and pop.",
    "Why is the sky blue?", "Give a short definition of machine learning.",
    "Write a function in C that reverses a string in place.", "What is a closure in programming?",
    "Convert 100 degrees Fahrenheit to Celsius and show the steps.", "List the planets of the solar system.",
    "Write a Rust function that sums a vector of integers.", "What is the purpose of a unit test?",
    "Explain what a race condition is.", "Write a Python decorator that times a function.",
    "What are the three states of matter?", "Suggest a name for a coffee shop run by robots.",
    "Explain the CAP theorem in one paragraph.", "Write a haiku about debugging at night.",
    "How do vaccines train the immune system?", "Write a Go function that checks whether a number is even.",
    "What is the difference between 'let' and 'const' in JavaScript?", "Explain big-O notation briefly.",
    "Write a Python list comprehension that squares the even numbers of a list.",
    "What is photosynthesis?", "Give two advantages and two drawbacks of microservices.",
    "Write a short thank-you note to a colleague.", "What does the 'yield' keyword do in Python?",
    "Explain the difference between a process and a thread.", "Write a SQL query to find duplicate emails.",
    "What is the Pythagorean theorem?",
]  # fmt: skip
assert len(CHAT_PROMPTS) == 50


def prose_text() -> str:
    """English prose a package ships: the Python documentation's topic texts (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def code_text() -> str:
    """Python source a package ships: standard-library modules, in a fixed order."""
    import argparse as a
    import collections as c
    import dataclasses as d
    import json.decoder as jd
    import pathlib as p
    import textwrap as t

    return "\n\n".join(inspect.getsource(m) for m in (a, d, t, jd, c, p))


def windows(engine: Engine, text: str, num_tokens: int, window: int) -> list[list[int]]:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --num-tokens {num_tokens}")
    ids = ids[:num_tokens]
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]


def scored(engine: Engine, chunks: list[list[int]]) -> tuple[list[float], list[int]]:
    """(log-probability of each scored token, the argmax at each scored position), teacher-forced."""
    logprobs: list[float] = []
    top1: list[int] = []
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    for chunk in chunks:
        entries = engine.generate([chunk], params)[0].prompt_logprobs
        assert entries is not None
        for entry in entries[1:]:
            assert entry is not None
            logprobs.append(entry.logprob)
            top1.append(entry.top_logprobs[0][0])
    return logprobs, top1


def greedy(engine: Engine, max_tokens: int) -> list[list[int]]:
    try:
        prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    except ValueError:  # a base model without a chat template: the prompts as plain text
        prompts = [engine.tokenizer.encode(p) for p in CHAT_PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return [list(out.outputs[0].token_ids) for out in engine.generate(prompts, params)]


def measure(model: str | None, texts: dict[str, str], args: argparse.Namespace) -> dict[str, object]:
    """The exact path (fp32 arithmetic and KV) against gguf-q8 with each KV dtype of ``--kv-cache-dtype``."""
    row: dict[str, object] = {"model": model or "embedded"}
    length = args.window + 64
    exact = Engine(model=model, quantization="gguf", kv_cache_dtype="fp32", max_model_len=length)
    candidates = {
        f"gguf-q8 + {kv} KV": Engine(
            model=model, quantization="gguf-q8", kv_cache_dtype=kv, max_model_len=length
        )
        for kv in args.kv_cache_dtype or ["auto"]
    }
    for name, engine in candidates.items():  # what auto resolved to
        row[f"KV cache of {name}"] = str(engine.kv_dtype).removeprefix("torch.")
    exact_outs = greedy(exact, args.max_tokens)
    for text_name, text in texts.items():
        chunks = windows(exact, text, args.num_tokens, args.window)
        exact_lp, exact_top = scored(exact, chunks)
        ppl_exact = math.exp(-statistics.fmean(exact_lp))
        row[f"{text_name}: perplexity exact"] = round(ppl_exact, 4)
        row[f"{text_name}: tokens scored"] = len(exact_top)
        for name, engine in candidates.items():
            lp, top = scored(engine, chunks)
            ppl = math.exp(-statistics.fmean(lp))
            row[f"{text_name}: perplexity {name}"] = round(ppl, 4)
            row[f"{text_name}: perplexity rise % {name}"] = round(100 * (ppl / ppl_exact - 1), 3)
            agree = sum(a == b for a, b in zip(exact_top, top)) / len(exact_top)
            row[f"{text_name}: top-1 agreement % {name}"] = round(100 * agree, 2)
    for name, engine in candidates.items():
        outs = greedy(engine, args.max_tokens)
        same = sum(a == b for a, b in zip(exact_outs, outs))
        row[f"greedy identical {name}"] = f"{same}/{len(CHAT_PROMPTS)}"
        leading = statistics.fmean(leading_match(a, b) for a, b in zip(exact_outs, outs))
        row[f"greedy leading tokens (mean) {name}"] = round(leading, 1)
        rises = [v for k, v in row.items() if "rise %" in k and k.endswith(name)]
        agreements = [v for k, v in row.items() if "agreement %" in k and k.endswith(name)]
        holds = all(float(r) <= 1.0 for r in rises) and all(float(a) >= 97.0 for a in agreements)  # type: ignore[arg-type]
        row[f"meets the default's rule: {name}"] = holds
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", action="append", default=None, help="repeat; default: the embedded model")
    parser.add_argument("--num-tokens", type=int, default=20_000, help="tokens scored per text")
    parser.add_argument("--window", type=int, default=1024, help="tokens per teacher-forced window")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per chat prompt")
    parser.add_argument("--code", action="store_true", help="also the Python source text (for code models)")
    parser.add_argument(
        "--kv-cache-dtype",
        action="append",
        default=None,
        help="gguf-q8's KV dtype (repeat to compare several in one run; default: auto, fp16)",
    )
    parser.add_argument("--json", default=None, help="write the rows to this file too")
    args = parser.parse_args(argv)
    texts = {"prose": prose_text()} | ({"code": code_text()} if args.code else {})
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    print(
        f"# {time.strftime('%Y-%m-%d')}, {cpu}, {args.num_tokens} tokens per text, windows of {args.window}"
    )
    rows = []
    for model in args.model or [None]:
        started = time.perf_counter()
        row = measure(model, texts, args)
        row["seconds"] = round(time.perf_counter() - started)
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
