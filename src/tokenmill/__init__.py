"""tokenmill: an LLM inference engine and OpenAI-compatible server you can read and trust."""

import os

# OpenMP threads that spin while waiting turn a busy 2-core machine into a crawl: with another process on the
# cores, a [4, 576] x [576, 3072] matmul on 2 spinning threads took 24 ms instead of 0.7 ms (measured here,
# benchmarks/README.md). Passive waiting costs a few microseconds per parallel region on an idle machine.
# It only takes effect if tokenmill is imported before torch starts its thread pool; set it yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput"]
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
