"""tokenmill: an LLM inference engine and OpenAI-compatible server you can read and trust."""

import os

# How long an idle OpenMP thread spins before it sleeps, between the parallel regions of a step. libgomp's
# default (300,000 spins, milliseconds) turns a busy 2-core machine into a crawl: with another process on the
# cores, a [4, 576] x [576, 3072] matmul took 24 ms instead of 0.7 ms. Not spinning (OMP_WAIT_POLICY=PASSIVE)
# costs a wake-up per region, ~90 us under KVM here: single-stream decode ran 4x slower. The spin has to outlast
# the waits inside a step (a thread done with its half of a matmul waits for the other): 4,000 spins (~45 us at
# the 11 ns a pause-spin takes on the KVM Xeon of 2026-12-01) against the 1,000 (~11 us) used before: the fp32
# single-stream decode stack 18.2-19.3 -> 15.6-15.9 ms per step, case (b) 20.7-21.1 -> 19.8-20.2 s; next to a
# process spinning on one of the two cores, 64 decode tokens took 0.90 s at 1,000 spins, 1.16-1.46 s at
# 2,000-4,000, 2.30 s at 10,000. Measured in benchmarks/README.md. Only takes effect if tokenmill is imported
# before torch starts its thread pool, and never overrides the user's OMP_WAIT_POLICY or GOMP_SPINCOUNT.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "4000"
# Large CPU tensors (the KV cache, packed weights) on 2 MB transparent huge pages (torch's allocator reads this
# once; this kernel grants them on request only): decode attention reads every row's blocks, scattered over
# the pool, each step, and with 4 KB pages that is a TLB miss every few KB (32 vs 34-38 ms per 30 layers at
# batch 64 here). Set THP_MEM_ALLOC_ENABLE=0 to turn it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Lazy: `import tokenmill` stays light (no torch) until the engine is wanted.
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    if name == "Engine":
        from tokenmill.engine import Engine

        return Engine
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
