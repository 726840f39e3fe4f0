"""Shared real-model fixtures: the embedded model is loaded once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def embedded_loaded():
    """The embedded SmolLM2-135M-Instruct as a LoadedModel on the exact path (``quantization="gguf"``: its GGUF
    blocks kept, fp32 activations), named because the tests that compare with transformers need it."""
    from tokenmill.model.loader import load_model

    return load_model(None, device="cpu", quantization="gguf")


@pytest.fixture(scope="session")
def make_engine(embedded_loaded):
    """Build an Engine over the already loaded embedded model: make_engine(num_kv_blocks=..., ...)."""
    from tokenmill.engine import Engine

    def make(**overrides):
        overrides.setdefault("num_kv_blocks", 256)
        overrides.setdefault("device", "cpu")
        return Engine(loaded=embedded_loaded, **overrides)

    return make


@pytest.fixture(scope="session")
def hf_embedded(hf_gguf):
    """transformers' own reading of the same GGUF file: the independent reference (model, tokenizer)."""
    from tokenmill.model.embedded import embedded_model_path

    path = embedded_model_path()
    return hf_gguf.model(path), hf_gguf.tokenizer(path)


@pytest.fixture(scope="session")
def embedded_fp32():
    """The embedded model dequantized at load (``quantization="fp32"``): the path before GGUF blocks were kept."""
    from tokenmill.model.loader import load_model

    return load_model(None, device="cpu", quantization="fp32")


@pytest.fixture(scope="session")
def embedded_q8():
    """The embedded model's blocks with 8-bit activations (``quantization="gguf-q8"``, llama.cpp's arithmetic)."""
    from tokenmill.model.loader import load_model

    return load_model(None, device="cpu", quantization="gguf-q8")
