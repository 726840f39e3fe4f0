"""A coding agent's first prompt computed once per machine: time to first token cold, then after a restart with
the prefix cache's disk tier, side by side in one run.

    python -m benchmarks.disk_prefix [--model NAME] [--tokens 19000]

An agent's first request is its system prompt and tool definitions, the same at every start (Claude Code's:
about 19,000 tokens). Here it is a chat whose system message is ``--tokens`` tokens of Python's standard library
source (a stand-in of the same size and kind, not a captured request). Fresh processes, each building the
default engine (``LLM``) with the disk tier in one temporary folder: the first computes the prompt (cold) and
writes its blocks; the second is a restart that reads them back; with ``--with-off`` a third runs with the tier
off (the cold figure again: what writing the blocks costs). Each times one request of one greedy token (time to first
token) and prints the prefill tokens computed and the tokens read back.
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
import inspect, json, sys, time
import argparse, collections, dataclasses, json as json_module, pathlib, textwrap
from tokenmill import LLM, SamplingParams
model, folder, disk_bytes, num_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model, max_model_len=32768, kv_cache_disk_bytes=disk_bytes, kv_cache_disk_dir=folder)
tok = llm.get_tokenizer()
source = "".join(inspect.getsource(m) for m in (argparse, collections, dataclasses, json_module, pathlib, textwrap))
ids = tok.encode(source)[:num_tokens]
system = tok.decode(ids)
prompt = tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "Hi."}])
t0 = time.perf_counter()
out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].outputs[0]
ttft_s = time.perf_counter() - t0
if out.finish_reason not in ("length", "stop"):
    sys.exit(f"the request ended with {out.finish_reason!r}")
stats = llm.engine.stats
if llm.engine.kv_disk is not None:
    llm.engine.kv_disk.flush()
print(json.dumps({"ttft_s": ttft_s, "prompt_tokens": len(prompt), "prefill_tokens": stats.num_prefill_tokens,
                  "disk_hit_tokens": stats.num_disk_hit_tokens}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--tokens", type=int, default=19000)
    parser.add_argument(
        "--with-off", action="store_true", help="a third process with the tier off (cold again)"
    )
    args = parser.parse_args(argv)
    print(
        f"{cpu_name()}, {os.cpu_count()} cores; {args.model}; a {args.tokens}-token system prompt", flush=True
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="disk-prefix-") as folder:
        runs = [("cold (tier on)", 8 << 30), ("restart (tier on)", 8 << 30)]
        for label, disk_bytes in runs + ([("tier off", 0)] if args.with_off else []):
            cmd = [sys.executable, "-c", _CHILD, args.model, folder, str(disk_bytes), str(args.tokens)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(f"{label}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                return 1
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append((label, result))
            print(
                f"{label:<18} time to first token {result['ttft_s']:8.2f} s; prompt {result['prompt_tokens']} tokens,"
                f" computed {result['prefill_tokens']}, read back {result['disk_hit_tokens']}",
                flush=True,
            )
    cold, warm = rows[0][1]["ttft_s"], rows[1][1]["ttft_s"]
    verdict = "PASS" if warm <= 0.10 * cold else "FAIL"
    print(f"[{verdict}] restart / cold = {warm / cold:.3f} (target <= 0.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
