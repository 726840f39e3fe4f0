"""Load time of the embedded model, and single-stream decode next to transformers ``generate``.

    python benchmarks/bench_load_decode.py [--tokens 128] [--threads N] [--json out.json]

1. Load: two fresh processes build ``LLM()`` with ``TOKENMILL_CACHE_DIR`` set to one empty temporary
   folder: the first dequantizes the GGUF and fills the cache, the second loads from it. Each reports
   the import time (torch and tokenmill) and the ``LLM()`` time separately.
2. Decode: case (c) of the suite (``--tokens`` tokens after a short chat prompt, greedy, EOS ignored)
   through tokenmill and through transformers ``generate`` on the same token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# transformers' GGUF loader draws a progress bar; tqdm reads this when it is first imported.
os.environ.setdefault("TQDM_DISABLE", "1")

from benchmarks.common import default_dtype, embedded_gguf_path, pick_device  # noqa: E402
from benchmarks.peers import HFStaticRunner  # noqa: E402
from benchmarks.tokenmill_runner import TokenmillRunner  # noqa: E402
from benchmarks.workloads import CHAT_MESSAGES, Workload  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

_LOAD_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
from tokenmill import LLM
t1 = time.perf_counter()
llm = LLM(device=sys.argv[1], num_threads=int(sys.argv[2]))
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1}))
"""


def measure_load(device: str, num_threads: int) -> dict[str, dict[str, float]]:
    out = {}
    with tempfile.TemporaryDirectory(prefix="tokenmill-cache-") as cache_dir:
        env = {**os.environ, "TOKENMILL_CACHE_DIR": cache_dir}
        for label in ("first", "cached"):
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-c", _LOAD_PROBE, device, str(num_threads)],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            wall_s = time.perf_counter() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"load probe failed:\n{proc.stderr[-2000:]}")
            out[label] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": wall_s}
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-hf", action="store_true", help="tokenmill only")
    parser.add_argument("--json", type=Path, default=None, help="default bench_out/load_decode-<time>.json")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    device = pick_device(args.device)
    dtype = default_dtype(device)

    load = measure_load(device, threads)
    for label, t in load.items():
        print(
            f"load ({label:>6}): LLM() {t['load_s']:.2f} s, imports {t['import_s']:.2f} s, "
            f"process {t['process_s']:.2f} s"
        )

    tm = TokenmillRunner(device, dtype, threads)
    tm.load()
    workload = Workload("c", "single-stream decode", [tm.encode_chat(CHAT_MESSAGES)], [args.tokens])
    results = [tm.run(workload)]
    tm.close()
    if not args.no_hf:
        hf = HFStaticRunner(embedded_gguf_path(), device, dtype)
        if hf.unavailable() is None:
            hf.load()
            results.append(hf.run(workload))
            hf.close()
        else:
            print("transformers: not installed")
    print(
        f"single stream, {len(workload.prompts[0])}-token chat prompt, {args.tokens} tokens, {device} {dtype}, "
        f"{threads} threads:"
    )
    for r in results:
        assert r.time_s is not None
        detail = ""
        if "decode_tokens_per_s" in r.extra:
            detail = f" (first token {1e3 * r.extra['ttft_s']:.0f} ms, then {r.extra['decode_tokens_per_s']:.1f} tok/s)"
        print(f"  {r.engine:<10} {r.time_s:7.2f} s  {args.tokens / r.time_s:7.1f} tok/s{detail}")
    if len(results) == 2 and results[0].time_s and results[1].time_s:
        print(f"  tokenmill is {results[1].time_s / results[0].time_s:.2f}x transformers generate")
    summary: dict[str, object] = {
        "device": device,
        "dtype": dtype,
        "num_threads": threads,
        "load": load,
        "decode": [
            {"engine": r.engine, "time_s": r.time_s, "num_tokens": args.tokens, **r.extra} for r in results
        ],
    }
    path = args.json or REPO_ROOT / "bench_out" / f"load_decode-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {path}")
    return summary


if __name__ == "__main__":
    main()
