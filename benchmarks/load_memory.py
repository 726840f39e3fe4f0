"""Load time and memory of a model: ``python -m benchmarks.load_memory [MODEL]`` (a path or a pulled name;
default the embedded one). Prints the wall time of ``LLM(MODEL)`` (torch already imported), the RSS it added (``/proc/self/status``),
the weights' and the KV pool's bytes, then the RSS after one 8-token greedy generate (weights read from a
memory-mapped cache count once their pages are touched). Run it twice: the first load of a GGUF writes the
blocks cache, the second maps it.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import time


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    import tokenmill  # noqa: F401, I001  (process settings before torch: the order matters)
    import torch  # noqa: F401  (imported before the baseline: the libraries are not the model's bytes)

    from tokenmill import LLM, SamplingParams
    from tokenmill.engine import Engine  # noqa: F401

    model = sys.argv[1] if len(sys.argv) > 1 else None
    before = rss_mb()
    start = time.perf_counter()
    llm = LLM(model)
    load_s = time.perf_counter() - start
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    engine = llm.engine
    print(
        f"load {load_s:.2f} s, RSS +{rss_mb() - before:.0f} MB (weights {engine.loaded.weight_bytes / 1e6:.1f} MB, "
        f"KV pool {engine.kv_cache_bytes / 1e6:.0f} MB)"
    )
    llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=8, temperature=0))
    print(f"after one generate: RSS +{rss_mb() - before:.0f} MB")


if __name__ == "__main__":
    main()
