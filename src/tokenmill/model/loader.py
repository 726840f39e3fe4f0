"""``load_model``: a path (or nothing, for the embedded default) in, config + weights + tokenizer out.

A ``.gguf`` file goes through :mod:`~tokenmill.model.gguf_loader`, a directory through
:mod:`~tokenmill.model.hf_loader`. Every problem a user can fix (wrong path, missing files, another
architecture, a quantization type tokenmill cannot read) is a ``ValueError`` that says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.config import QUANTIZATIONS
from tokenmill.model import kv_format
from tokenmill.model.config import LlamaConfig
from tokenmill.model.embedded import embedded_model_path
from tokenmill.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

GGUF_BLOCK_MODES = (
    "gguf",
    "gguf-q8",
    "gguf-q4",
)  # of tokenmill.config.QUANTIZATIONS: the blocks kept as they are
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    config: LlamaConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    source: str  # the path loaded
    device: torch.device
    dtype: torch.dtype
    quantization: str | None = (
        None  # what was applied: "gguf", "gguf-q8", "fp32" (a GGUF dequantized), "int8", None
    )
    weight_bytes: int = 0  # the weights' resident bytes (quant.weight_bytes), reported at start
    quantization_reason: str = (
        "asked for"  # why this quantization (model/arithmetic.py when the default chose)
    )

    def describe_weights(self) -> str:
        mode = self.quantization or str(self.dtype).removeprefix("torch.")
        return f"weights {self.weight_bytes / 1e6:.1f} MB resident ({mode})"

    def describe_arithmetic(self) -> str:
        """Which arithmetic runs and why, as the start line and ``tokenmill info`` say it."""
        from tokenmill.model.arithmetic import describe

        mode = self.quantization or str(self.dtype).removeprefix("torch.")
        return f"arithmetic {mode} ({describe(self.quantization)}): {self.quantization_reason}"


def resolve_device_dtype(
    device: str = "auto", dtype: str | torch.dtype | None = None
) -> tuple[torch.device, torch.dtype]:
    """``auto`` is CUDA when available, else CPU; the default dtype is float32 on CPU, bfloat16 on CUDA."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    if dtype is None:
        return resolved, torch.bfloat16 if resolved.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return resolved, dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return resolved, _DTYPES[dtype]


def load_model(
    model: str | None = None,
    device: str = "auto",
    dtype: str | None = None,
    cache_dir: str | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """Load a Llama model: ``None`` (embedded SmolLM2-135M-Instruct), a ``.gguf`` file, an HF directory, or the
    name of a model ``tokenmill pull`` fetched (:mod:`tokenmill.model.registry`).

    ``cache_dir`` holds dequantized GGUF weights (default ``$TOKENMILL_CACHE_DIR`` or ``~/.cache/tokenmill``).
    ``quantization`` (:data:`tokenmill.config.QUANTIZATIONS`): ``None`` lets :mod:`~tokenmill.model.arithmetic`
    choose for a quantized GGUF on CPU with the C++ kernels (``LoadedModel.quantization_reason`` says why).
    ``"gguf"`` keeps a GGUF's quantized tensors as their blocks and computes from them exactly (fp32 activations),
    ``"gguf-q8"`` too, with the activations rounded to 8 bits per super-block of 256 for the K-quants and per group
    of 32 for the other types (integer dot products, as llama.cpp
    and vLLM's GGUF kernels do), ``"gguf-q4"`` as ``"gguf-q8"`` with the
    projections rounded to 4 bits first (approximate; a draft model's default), ``"fp32"`` dequantizes them at load, ``"int8"`` swaps the projections and the LM head
    for weight-only int8 after loading (:mod:`~tokenmill.model.quant`; norms and the embedding table stay in
    ``dtype``).
    """
    resolved_device, resolved_dtype = resolve_device_dtype(device, dtype)
    path = _model_path(model)
    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    _check_quantization(quantization, path, is_gguf, resolved_device, resolved_dtype)
    from tokenmill.model.encoder import is_encoder_dir

    if is_encoder_dir(path):
        return _load_encoder(path, resolved_device, resolved_dtype, quantization)
    if path.is_dir():
        config, llama, tokenizer = _load_hf(path, resolved_device, resolved_dtype)
        reason = "asked for" if quantization is not None else "a Hugging Face directory: its weights' dtype"
    elif is_gguf:
        config, llama, tokenizer, quantization, reason = _load_gguf(
            path, cache_dir, quantization, resolved_device, resolved_dtype
        )
    else:
        raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    if quantization == "int8":
        from tokenmill.model.quant import quantize_model_int8

        quantize_model_int8(llama)
    from tokenmill.model.backends import select_backend

    select_backend(resolved_device, resolved_dtype, config.head_dim).prepare(llama)
    from tokenmill.model.quant import weight_bytes

    return LoadedModel(
        config=config,
        model=llama,
        tokenizer=tokenizer,
        source=str(path),
        device=resolved_device,
        dtype=resolved_dtype,
        quantization=quantization or ("fp32" if is_gguf else None),
        weight_bytes=weight_bytes(llama),
        quantization_reason=reason,
    )


def _load_hf(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """A Hugging Face directory's config, model and tokenizer; its config checked before anything large is read."""
    from tokenmill.model.hf_loader import load_hf_model, read_hf_config, safetensors_files
    from tokenmill.tokenizer import Tokenizer

    config = read_hf_config(path)
    safetensors_files(path)
    tokenizer = Tokenizer.from_hf_dir(path)
    config, llama = load_hf_model(path, device, dtype, config)
    return config, llama, tokenizer


def _load_encoder(
    path: Path, device: torch.device, dtype: torch.dtype, quantization: str | None
) -> LoadedModel:
    """An embedding model's directory (``model/encoder.py``): its encoder and its tokenizer, which neither
    truncates nor pads (an input longer than the model takes is refused, never cut)."""
    from tokenmill.model.encoder import load_encoder
    from tokenmill.model.quant import weight_bytes
    from tokenmill.tokenizer import Tokenizer

    if quantization is not None:
        raise ValueError(f"quantization {quantization!r} does not apply to an embedding model")
    tokenizer = Tokenizer.from_hf_dir(path)
    tokenizer.disable_truncation_and_padding()
    config, encoder = load_encoder(path, device, dtype)
    from tokenmill.model.backends import prepare_encoder

    prepare_encoder(encoder, device, dtype)
    return LoadedModel(
        config=config,  # type: ignore[arg-type]
        model=encoder,  # type: ignore[arg-type]
        tokenizer=tokenizer,
        source=str(path),
        device=device,
        dtype=dtype,
        weight_bytes=weight_bytes(encoder),  # type: ignore[arg-type]
    )


def _load_gguf(
    path: Path, cache_dir: str | None, quantization: str | None, device: torch.device, dtype: torch.dtype
) -> tuple[LlamaConfig, LlamaForCausalLM, Tokenizer, str | None, str]:
    """A GGUF's config, model and tokenizer, the quantization it got and why (``model/arithmetic.py`` chooses
    for quantized blocks on CPU when none is asked for)."""
    from tokenmill.model.gguf_loader import GGUFFile
    from tokenmill.tokenizer import Tokenizer

    gguf_file = GGUFFile(path, cache_dir)
    reason = "asked for"
    if quantization is None:
        reason = _why_not_blocks(gguf_file, device, dtype)
    if quantization is None and not reason:
        from tokenmill.model.cpu.kernels import loaded

        choice = gguf_file.default_arithmetic(loaded().variant)
        quantization, reason = choice.quantization, choice.reason
    # GGUFFile offers GGUFReader's `fields`: one parse of the metadata (none on a cache hit)
    tokenizer = Tokenizer.from_gguf_reader(gguf_file, source=str(path))
    if quantization in GGUF_BLOCK_MODES:
        config, llama = gguf_file.load_quantized_model(
            int8_activations=quantization == "gguf-q8",
            requantize=quantization == "gguf-q4",
            wide_quads=gguf_file.wide_quads(),
            super_block_acts=gguf_file.super_block_acts(),
        )
    else:
        config, llama = gguf_file.load_model(device, dtype)
    return config, llama, tokenizer, quantization, reason


def _model_path(model: str | None) -> Path:
    from tokenmill.model.registry import CATALOGUE, resolve

    path = embedded_model_path() if model is None else Path(resolve(model)).expanduser()
    if not path.exists():
        raise ValueError(
            f"model path not found: {model} (tokenmill loads local .gguf files, HF model directories, or a model "
            f"`tokenmill pull` fetched: {', '.join(CATALOGUE)})"
        )
    return path


def _check_quantization(
    quantization: str | None, path: Path, is_gguf: bool, device: torch.device, dtype: torch.dtype
) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of None, {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    if quantization not in GGUF_BLOCK_MODES:
        return
    if not is_gguf:
        raise ValueError(f"quantization={quantization!r} needs a .gguf file, got {path}")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"quantization={quantization!r} runs on CPU in float32 (activations); use quantization='fp32' "
            f"for {device.type} / {dtype}"
        )


def _why_not_blocks(gguf_file: Any, device: torch.device, dtype: torch.dtype) -> str:
    """Why a GGUF's blocks are dequantized at load by default, or "" when they are kept: they are kept when the
    file has quantized tensors the kernels take, on CPU in fp32 with the C++ kernels loaded (without them the
    torch fallback would dequantize at every step)."""
    from tokenmill.model.cpu.kernels import loaded, quant_kernels

    if device.type != "cpu" or dtype != torch.float32:
        return f"GGUF blocks are computed on CPU in float32; on {device.type} in {dtype} they are dequantized"
    if quant_kernels() is None:
        return f"no C++ kernels ({loaded().reason}): the blocks are dequantized at load"
    if not gguf_file.quantized_tensor_types():
        return "the file holds no quantized tensors the kernels take"
    return ""


def allocate_kv_cache(
    config: LlamaConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each ``[num_blocks, block_size, num_kv_heads, row]`` zeros (``row``: ``head_dim``, or
    int8's codes and scale, ``kv_format.row_width``)."""
    shape = (num_blocks, block_size, config.num_key_value_heads, kv_format.row_width(config.head_dim, dtype))
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_hidden_layers)
    ]


def kv_bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    row = kv_format.row_width(config.head_dim, dtype)
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * row * dtype.itemsize
