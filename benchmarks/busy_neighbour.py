"""Single-stream decode with and without a busy neighbour: 1 thread, every thread fixed, and the default (the
thread governor, ``worker/thread_governor.py``), side by side in one run.

    python -m benchmarks.busy_neighbour [--model NAME] [--tokens 256] [--repeats 2]

The neighbour is a second process spinning on one core (a plain Python loop) for the whole of a measurement; the
engine is the default one (``LLM``) with ``num_threads`` and ``adaptive_threads`` set per row. Each row is the
best of ``--repeats`` runs of ``--tokens`` greedy tokens after a short chat prompt, EOS ignored. The target: with
the neighbour, the default never below the 1-thread rate. The rows run one after another, so a machine whose speed
drifts moves their ratio by several percent; the default's row also counts its busy decode steps at all the threads
(each waited for the starved thread: the neighbour's arrival seen, then each probe back) and the steps a due probe
waited on the load counters (``worker/cpu_load.py``), which drift does not move.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from benchmarks.common import cpu_name
from tokenmill import LLM, SamplingParams

_SPIN = "import time\nwhile True: pass"


def decode_tps(llm: LLM, prompt: list[int], num_tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        elapsed_s = time.perf_counter() - t0
        best = max(best, len(out.outputs[0].token_ids) / elapsed_s)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a pulled model's name or a path (default: embedded)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    max_threads = torch.get_num_threads()
    rows = [("1 thread", 1, False), (f"{max_threads} threads", max_threads, False), ("default", None, True)]
    print(f"{cpu_name()}, {os.cpu_count()} cores; model {args.model or 'embedded'}; {args.tokens} tokens")
    print(f"{'engine':<12} {'quiet tok/s':>12} {'busy tok/s':>12}")
    results: dict[str, dict[str, float]] = {}
    for label, threads, adaptive in rows:
        torch.set_num_threads(max_threads)
        llm = LLM(args.model, num_threads=threads, adaptive_threads=adaptive)
        prompt = llm.get_tokenizer().encode_chat(
            [{"role": "user", "content": "Write a long story about a lighthouse."}]
        )
        quiet = decode_tps(llm, prompt, args.tokens, args.repeats)
        governor = llm.engine.thread_governor
        before = governor.decode_steps_at[max_threads] if governor is not None else 0
        spinner = subprocess.Popen([sys.executable, "-c", _SPIN])
        try:
            time.sleep(0.5)
            busy = decode_tps(llm, prompt, args.tokens, args.repeats)
        finally:
            spinner.kill()
            spinner.wait()
        results[label] = {"quiet": quiet, "busy": busy}
        detail = ""
        if governor is not None:
            # the busy decode steps that waited for a starved thread, and the steps a due probe waited
            collapsed = governor.decode_steps_at[max_threads] - before
            deferred = governor.num_probes_deferred
            detail = f"  ({collapsed} busy steps at {max_threads} threads, probes deferred {deferred})"
        print(f"{label:<12} {quiet:12.1f} {busy:12.1f}{detail}", flush=True)
        del llm
    single, default = results["1 thread"]["busy"], results["default"]["busy"]
    verdict = "PASS" if default >= 0.95 * single else "FAIL"
    print(f"[{verdict}] busy: default / 1 thread = {default / single:.2f} (target >= 1, 5% noise allowed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
