"""tokenmill: an LLM inference engine and OpenAI-compatible server you can read and trust."""

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
