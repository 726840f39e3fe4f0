"""What one decode step reads, against the file's bytes and the machine's read bandwidth, side by side in one run.

    python -m benchmarks.decode_bytes [--model NAME] [--variants avx512,avx2] [--arithmetics gguf-q8,gguf]
                                      [--layouts narrow,six-bit,byte,fp32-heads] [--tokens 128] [--rounds 2]

Per kernel variant, arithmetic and layout (``narrow``: what the loader writes, the byte-quad formats in five bits a
code where their codes fit, Q5_0, Q5_1, Q5_K, Q3_K, Q2_K, Q6_K in six; ``six-bit``: all of them in six; ``byte``: a
byte a code; ``fp32-heads``: the loader's layout with the formats without
super-blocks (Q4_0 ... Q8_0) keeping fp32 scales and mins per group instead of the file's fp16), a fresh process
loads the model (its own cache folder per layout, so neither reads the other's blocks), then measures in that
process: the read bandwidth (``model/hardware.py``'s probe, the same threads), single-stream greedy decode of
``--tokens`` tokens after a short chat prompt (best of 3), and a prefill of 512 tokens (best of 2; prefix caching
off). Rounds alternate the rows, so a noisy neighbour spreads
over all of them. Printed per row: the weights' MB a step reads (``quant.decode_read_bytes``) and their ratio to
the file's tensors other than the token embedding, tokens/s, the bytes/s that makes, and its fraction of the
bandwidth. Every layout applies to both arithmetics: the exact path reads the same narrow quads (``byte`` is its
layout of a byte a code).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_name  # noqa: E402

_CHILD = r"""
import functools, json, sys, time
import torch
from tokenmill.model import gguf_blocks
_OTHER = {"six-bit": {"quad_bits": 6}, "byte": {"quad_bits": 8}, "fp32-heads": {"fp16_heads": False}}.get(sys.argv[3])
if _OTHER:  # another layout, for the side-by-side row
    gguf_blocks.QuantizedWeight.from_groups = functools.partial(
        gguf_blocks.QuantizedWeight.from_groups.__func__, gguf_blocks.QuantizedWeight, **_OTHER)
from tokenmill import LLM, SamplingParams
from tokenmill.cli.commands import _file_step_bytes
from tokenmill.model import hardware
from tokenmill.model.quant import decode_read_bytes
llm = LLM(sys.argv[1], quantization=sys.argv[2], speculative_config={"method": "none"}, enable_prefix_caching=False)
loaded = llm.engine.loaded
bandwidth = hardware.measure_read_bandwidth(torch.device("cpu"), torch.float32, 1 << 30)
prompt = llm.get_tokenizer().encode_chat([{"role": "user", "content": "Write a long story about a lighthouse."}])
params = SamplingParams(max_tokens=int(sys.argv[4]), temperature=0.0, ignore_eos=True)
llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
best = 0.0
for _ in range(3):
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    best = max(best, len(out.outputs[0].token_ids) / (time.perf_counter() - t0))
long_prompt = (prompt * (512 // len(prompt) + 1))[:512]
prefill_s = float("inf")
for _ in range(2):
    t0 = time.perf_counter()
    llm.generate([long_prompt], SamplingParams(max_tokens=1))
    prefill_s = min(prefill_s, time.perf_counter() - t0)
from tokenmill.model.cpu.kernels import kernel_summary

print(json.dumps({"variant": kernel_summary()["kernel_variant"], "decode_tps": best, "prefill_tps": 512 / prefill_s,
                  "read_bytes": decode_read_bytes(loaded.model), "file_bytes": _file_step_bytes(loaded.source),
                  "bandwidth": max(bandwidth.values()), "summary": loaded.describe_weights()}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a pulled name or a GGUF path")
    parser.add_argument("--variants", default="avx512,avx2")
    parser.add_argument("--arithmetics", default="gguf-q8,gguf")
    parser.add_argument("--layouts", default="narrow,byte", help="from narrow, six-bit, byte, fp32-heads")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    from tokenmill.model.registry import resolve

    path = str(Path(resolve(args.model)).resolve())
    rows = [
        (variant, arithmetic, layout)
        for variant in args.variants.split(",")
        for arithmetic in args.arithmetics.split(",")
        for layout in args.layouts.split(",")
    ]
    print(
        f"{cpu_name()}, {os.cpu_count()} cores; {Path(path).name}; {args.tokens} tokens, best of 3 per round"
    )
    best: dict[tuple[str, str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="decode-bytes-") as tmp:
        for round_ in range(args.rounds):
            for row in rows:
                variant, arithmetic, layout = row
                cache = Path(tmp) / f"{variant}-{arithmetic}-{layout}"
                env = {**os.environ, "TOKENMILL_CPU_ISA": variant, "TOKENMILL_CACHE_DIR": str(cache)}
                cmd = [sys.executable, "-c", _CHILD, path, arithmetic, layout, str(args.tokens)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    print(f"{row}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                    return 1
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if row not in best or result["decode_tps"] > best[row]["decode_tps"]:
                    best[row] = result
            print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    print(f"{'variant':<8} {'arithmetic':<10} {'layout':<10} {'MB/step':>8} {'x file':>7} {'tok/s':>7} "
          f"{'GB/s':>6} {'probe GB/s':>10} {'of probe':>8} {'prefill 512 tok/s':>17}")  # fmt: skip
    for row in rows:
        r = best[row]
        rate = r["read_bytes"] * r["decode_tps"]
        ratio = r["read_bytes"] / r["file_bytes"] if r["file_bytes"] else float("nan")
        print(
            f"{r['variant']:<8} {row[1]:<10} {row[2]:<10} {r['read_bytes'] / 1e6:8.1f} {ratio:7.3f} "
            f"{r['decode_tps']:7.2f} {rate / 1e9:6.2f} {r['bandwidth'] / 1e9:10.2f} {rate / r['bandwidth']:8.1%}"
            f" {r['prefill_tps']:17.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
