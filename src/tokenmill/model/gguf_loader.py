"""Weights from a GGUF file (``llama``, ``qwen2``, ``qwen3``, ``phi3``), renamed to Hugging Face names: kept as
their quantized blocks (the default on CPU, :func:`read_quantized_gguf`) or dequantized and cached as safetensors.

Reading a GGUF file means parsing its metadata (2 s for SmolLM2's 49k-token vocabulary, 5.6 s for Qwen2.5's
152k) and converting every tensor. :class:`GGUFFile` does that once and caches the result in
``$TOKENMILL_CACHE_DIR`` (default ``~/.cache/tokenmill``), keyed by the file's path, size and modification
time (:func:`~tokenmill.model.weights_cache.file_identity`; entries no load can find again are deleted whenever
one is written): with ``quantization="gguf"`` the blocks as the kernels read them
(``gguf-blocks-*``, per panel width and mode), with ``"fp32"`` the weights as float32, already fused the way
:class:`~tokenmill.model.llama.LlamaForCausalLM` holds them; the metadata (config and tokenizer fields) in the
safetensors header either way. A later load memory-maps the cache (the weights are then file pages, shared
with the page cache and read from disk once) and never opens the GGUF reader.

For llama-architecture files llama.cpp's converter reorders the rows of every Q and K projection: Hugging Face
rotates pairs (i, i + D/2) of each head, GGUF rotates neighbours (2i, 2i + 1), so the converter moves HF row
``half * D/2 + i`` of a head to row ``2i + half``. :func:`unpermute_rope_rows` moves them back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.model.config import LlamaConfig
from tokenmill.model.gguf_blocks import QUANTIZED_TYPES, Groups, requantize_4bit, to_groups
from tokenmill.model.llama import LlamaForCausalLM, build_llama, fuse_hf_state_dict
from tokenmill.model.weights_cache import file_identity, prune_dead_entries

CACHE_FORMAT_VERSION = 1  # bump when the conversion changes: old cache files are then ignored
BLOCKS_CACHE_VERSION = 10  # likewise for the rewritten blocks (gguf_blocks' layout, quant.quantized_state)
_CONFIG_KEY = "tokenmill_config"
_FIELDS_KEY = "gguf_fields"
_TYPES_KEY = "gguf_tensor_types"
_STEP_BYTES_KEY = "gguf_step_bytes"  # the file's tensor bytes other than the token embedding's
_SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_NAMES_BY_ARCH = {  # where an architecture stores a tensor under another name (Phi-3: fused q/k/v, gate/up)
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # Gemma 3's four norms: after attention, before and after the MLP (ffn_norm is the one before it)
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"
_TOKEN_EMBD, _OUTPUT = "token_embd.weight", "output.weight"


def default_cache_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ValueError if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    names = {**_LAYER_NAMES, **_LAYER_NAMES_BY_ARCH.get(arch, {})}
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{match.group(3)}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a {arch} model")


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row interleave: per head, rows (2i, 2i+1) go back to (i, i + D/2)."""
    out_features, in_features = weight.shape
    half = out_features // num_heads // 2
    interleaved = weight.view(num_heads, half, 2, in_features)  # [H, D/2, 2, in]: row 2i + j
    return interleaved.transpose(1, 2).reshape(out_features, in_features)  # [H, 2, D/2, in]: row j*D/2 + i


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """One ``gguf.ReaderTensor`` -> float32 array in torch order (``[out, in]`` for matrices)."""
    import gguf

    type_name = tensor.tensor_type.name
    if type_name not in _SUPPORTED_TYPES:
        raise ValueError(_type_error(tensor.name, type_name))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions fastest-first; torch wants them slowest-first
    shape = tuple(int(n) for n in reversed(tensor.shape))
    values = values.reshape(shape)
    # F32 tensors come back as read-only views of the memory-mapped file
    return values if values.flags.writeable else values.copy()


def _type_error(name: str, type_name: str) -> str:
    return f"GGUF tensor {name!r} has type {type_name}, which tokenmill cannot load (supported: {', '.join(_SUPPORTED_TYPES)})"


def _read_config(path: Path, reader: Any) -> tuple[LlamaConfig, dict[str, Any]]:
    """The model config from the file's metadata, and its tensors by name; unreadable types refused first."""
    import gguf

    meta = {
        name: field.contents()
        for name, field in reader.fields.items()
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY
    }
    by_name = {t.name: t for t in reader.tensors}
    for tensor in reader.tensors:  # refuse before spending time on the others
        if tensor.tensor_type.name not in _SUPPORTED_TYPES:
            raise ValueError(_type_error(tensor.name, tensor.tensor_type.name))
    if "token_embd.weight" not in by_name:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    rope_freqs = None
    if _ROPE_FREQS in by_name:
        rope_freqs = tuple(float(x) for x in dequantize_tensor(by_name[_ROPE_FREQS]).reshape(-1))
    config = LlamaConfig.from_gguf_metadata(
        meta,
        vocab_size=int(by_name["token_embd.weight"].shape[-1]),
        tie_word_embeddings="output.weight" not in by_name,
        rope_freq_factors=rope_freqs,
        qkv_bias="blk.0.attn_q.bias" in by_name or "blk.0.attn_qkv.bias" in by_name,
        qk_norm="blk.0.attn_q_norm.weight" in by_name,
    )
    return config, by_name


def _arch(reader: Any) -> str:
    field = reader.fields.get("general.architecture")
    return str(field.contents()) if field is not None else "llama"


def _as_hf_values(name: str, weight: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """A tensor as the Hugging Face checkpoint holds it: llama.cpp's converter writes Gemma's RMSNorm weights
    as 1 + w, the multiplier itself; the checkpoint (and so ``fuse_hf_state_dict``'s input) holds w."""
    if config.norm_offset and name.endswith("norm.weight"):
        return weight - config.norm_offset
    return weight


def rope_row_order(name: str, config: LlamaConfig) -> torch.Tensor | None:
    """For a Q or K projection (weight or bias) of a llama-architecture file, the permutation of its rows that
    undoes llama.cpp's interleave; else None. llama.cpp's converter permutes only the checkpoints it writes as
    ``llama`` (Llama, Mistral): Qwen2, Qwen3 and Phi-3 keep Hugging Face's row order (its NEOX rope type)."""
    if config.model_type != "llama":
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        heads = config.num_attention_heads
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        heads = config.num_key_value_heads
    else:
        return None
    rows = heads * config.head_dim
    return unpermute_rope_rows(torch.arange(rows, dtype=torch.int64)[:, None], heads)[:, 0]


def convert_gguf(
    path: Path, *, reader: Any = None, progress: bool = True
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Read ``path`` (or its open ``gguf.GGUFReader``): config and float32 HF-named weights, Q/K un-permuted."""
    import gguf
    from tqdm import tqdm

    reader = gguf.GGUFReader(path) if reader is None else reader
    config, _ = _read_config(path, reader)
    state_dict: dict[str, torch.Tensor] = {}
    tensors = [t for t in reader.tensors if t.name != _ROPE_FREQS]
    arch = _arch(reader)
    for tensor in tqdm(tensors, desc=f"dequantizing {path.name}", unit="tensor", disable=not progress):
        name = hf_tensor_name(tensor.name, arch)
        weight = _as_hf_values(name, torch.from_numpy(dequantize_tensor(tensor)), config)
        order = rope_row_order(name, config)
        state_dict[name] = (weight if order is None else weight[order]).contiguous()
    return config, state_dict


def read_quantized_gguf(
    path: Path, reader: Any
) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, Groups]]:
    """Config, the fp32 tensors (norms, and weights of types without a kernel) and the quantized ones as
    :class:`~tokenmill.model.gguf_blocks.Groups`, all under Hugging Face names, Q/K rows un-permuted."""
    config, _ = _read_config(path, reader)
    arch = _arch(reader)
    dense: dict[str, torch.Tensor] = {}
    quantized: dict[str, Groups] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        name = hf_tensor_name(tensor.name, arch)
        order = rope_row_order(name, config)
        type_name = tensor.tensor_type.name
        if type_name in QUANTIZED_TYPES and len(tensor.shape) == 2:
            groups = to_groups(type_name, tensor.data, int(tensor.shape[0]))
            quantized[name] = groups if order is None else groups.take_rows(order.numpy())
        else:
            weight = _as_hf_values(name, torch.from_numpy(dequantize_tensor(tensor)), config)
            dense[name] = (weight if order is None else weight[order]).contiguous()
    return config, dense, quantized


# "gguf-q4" leaves these as the file has them: the SmolLM2-135M drafting for itself accepted 0.77 of its tokens with
# its Q8_0 embedding (the tied head) rounded to 4 bits, over 0.9 with it kept
_KEPT_BY_REQUANTIZE = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


class _Field:
    """A metadata value behind the ``contents()`` call ``gguf.ReaderField`` offers."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def contents(self) -> Any:
        return self._value


class GGUFFile:
    """A GGUF file and its cache entry; ``fields`` mirrors ``gguf.GGUFReader.fields`` (the tokenizer reads it).

    On a cache hit ``fields`` comes from the cache header and the GGUF reader is never opened.
    """

    def __init__(self, path: str | Path, cache_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
        self._identity = file_identity(self.path)
        self.cache_path = self.cache_dir / f"gguf-{self._identity}-v{CACHE_FORMAT_VERSION}.safetensors"
        self._reader: Any = None
        self._cached_header = _read_header(self.cache_path)
        # any cache of this file holds its metadata: the GGUF reader (5.6 s on Qwen2.5's 152k-token vocabulary)
        # is opened only when none exists
        self._any_header = self._cached_header or next(
            (h for p in sorted(self.cache_dir.glob(f"gguf-blocks-{self._identity}-*.safetensors"))
             if (h := _read_header(p)) is not None),
            None,
        )  # fmt: skip

    def blocks_cache_path(
        self,
        tile_rows: int,
        int8_activations: bool,
        requantized: bool = False,
        wide_quads: bool = True,
        super_block_acts: bool = True,
    ) -> Path:
        """Where ``quantization="gguf"`` (``"gguf-q8"``, ``"gguf-q4"``) keeps this file's blocks rewritten for
        tiles of ``tile_rows`` (the kernel variant's panel width); ``-narrow``: Q8_0 and IQ4 tensors kept exact under
        ``int8_activations`` (``wide_quads`` False; load_quantized_model passes True without them); ``-g32``: the
        K-quants' activations rounded per group of 32 (``super_block_acts`` False, likewise)."""
        mode = "q4" if requantized else "q8" if int8_activations else "exact"
        mode += ("" if wide_quads else "-narrow") + ("" if super_block_acts else "-g32")
        name = f"gguf-blocks-{self._identity}-w{tile_rows}-{mode}-v{BLOCKS_CACHE_VERSION}.safetensors"
        return self.cache_dir / name

    @property
    def is_cached(self) -> bool:
        return self._cached_header is not None

    @functools.cached_property
    def fields(self) -> dict[str, Any]:
        if self._any_header is not None:
            return {key: _Field(value) for key, value in json.loads(self._any_header[_FIELDS_KEY]).items()}
        return dict(self.reader().fields)

    def _header(self, config: LlamaConfig) -> dict[str, str]:
        return {
            _CONFIG_KEY: _config_to_json(config),
            _FIELDS_KEY: json.dumps(_metadata_values(self.reader())),
            _TYPES_KEY: json.dumps(sorted({t.tensor_type.name for t in self.reader().tensors})),
            _STEP_BYTES_KEY: str(self._file_step_bytes()),
            "source": str(self.path.resolve()),
        }

    def reader(self) -> Any:
        if self._reader is None:
            import gguf

            self._reader = gguf.GGUFReader(self.path)
        return self._reader

    def load_weights(self) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
        """Config and fused float32 weights; converts (and fills the cache) on a miss."""
        if self._cached_header is not None:
            from safetensors.torch import load_file

            config = _config_from_json(self._cached_header[_CONFIG_KEY])
            return config, load_file(self.cache_path, device="cpu")  # memory-mapped, no copy
        config, hf_state_dict = convert_gguf(self.path, reader=self.reader())
        fused = fuse_hf_state_dict(config, hf_state_dict)
        del hf_state_dict
        self._store(self.cache_path, fused, config)
        return config, fused

    def _store(self, path: Path, tensors: dict[str, torch.Tensor], config: LlamaConfig) -> bool:
        """Write a cache entry, then delete the entries no load can find again (``weights_cache``); False when it
        could not be written (an unwritable cache costs time at the next load, not this one)."""
        try:
            _write_cache_atomically(path, tensors, self._header(config))
        except OSError as exc:
            warnings.warn(f"could not write GGUF cache {path}: {exc}", stacklevel=3)
            return False
        prune_dead_entries(
            self.cache_dir, {"gguf-": CACHE_FORMAT_VERSION, "gguf-blocks-": BLOCKS_CACHE_VERSION}
        )
        return True

    def _file_step_bytes(self) -> int:
        tensors = self.reader().tensors
        tied = all(t.name != _OUTPUT for t in tensors)  # the head reads the embedding's table
        skip = {_ROPE_FREQS} if tied else {_ROPE_FREQS, _TOKEN_EMBD}
        return sum(int(t.n_bytes) for t in tensors if t.name not in skip)

    def step_bytes(self) -> int:
        """The file's tensor bytes other than the token embedding's (unless the head is tied to it): what a decode
        step would read of the file's own blocks (``tokenmill info --load`` prints it beside the bytes the loaded model's step reads)."""
        if self._any_header is not None and _STEP_BYTES_KEY in self._any_header:
            return int(self._any_header[_STEP_BYTES_KEY])
        return self._file_step_bytes()

    def quantized_tensor_types(self) -> list[str]:
        """The types among this file's tensors that the quantized kernels take (empty: an fp16/fp32 file)."""
        if self._any_header is not None and _TYPES_KEY in self._any_header:
            types = json.loads(self._any_header[_TYPES_KEY])
        else:
            types = sorted({t.tensor_type.name for t in self.reader().tensors})
        return [t for t in types if t in QUANTIZED_TYPES]

    def _identity_fields(self) -> tuple[str, str, int]:
        """What ``model/arithmetic.py`` knows a measured file by: architecture, general name, size in bytes."""

        def text(key: str) -> str:
            field = self.fields.get(key)
            return "" if field is None else str(field.contents())

        return text("general.architecture"), text("general.name"), self.path.stat().st_size

    def default_arithmetic(self, kernel_variant: str | None) -> Any:
        """``model/arithmetic.py``'s choice for this file (a :class:`~tokenmill.model.arithmetic.Choice`)."""
        from tokenmill.model.arithmetic import choose

        return choose(*self._identity_fields(), kernel_variant)

    def wide_quads(self) -> bool:
        """Whether 8-bit activations reach this file's Q8_0 and IQ4 tensors too (``arithmetic.wide_quads``)."""
        from tokenmill.model.arithmetic import wide_quads

        return wide_quads(*self._identity_fields())

    def super_block_acts(self) -> bool:
        """Whether a K-quant's activations are rounded per super-block of 256 (``arithmetic.super_block_acts``)."""
        from tokenmill.model.arithmetic import super_block_acts

        return super_block_acts(*self._identity_fields())

    def load_quantized_model(
        self,
        int8_activations: bool = False,
        requantize: bool = False,
        wide_quads: bool = True,
        super_block_acts: bool = True,
    ) -> tuple[LlamaConfig, LlamaForCausalLM]:
        """The model with its quantized tensors kept as blocks (``quantization="gguf"``), fp32 elsewhere; CPU.
        ``int8_activations`` (``"gguf-q8"``): 4-bit blocks in the layout of the 8-bit-activation kernel.
        ``requantize`` (``"gguf-q4"``, implies ``int8_activations``): the projections' blocks rounded to 4 bits
        first (:func:`~tokenmill.model.gguf_blocks.requantize_4bit`: approximate weights, fewer bytes).
        ``wide_quads`` (with ``int8_activations``): False keeps the Q8_0 and IQ4 tensors exact (:meth:`wide_quads`).
        ``super_block_acts`` (likewise): False rounds the K-quants' activations per group of 32
        (:meth:`super_block_acts`).

        The first load rewrites the blocks (seconds: 18 s for a 1.5B) and writes them to a cache file; later
        loads map that file, so the weights are file pages shared with the page cache, read from disk once.
        """
        from safetensors.torch import load_file

        from tokenmill.model.cpu.kernels import quant_kernels
        from tokenmill.model.quant import build_quantized_llama, quantized_state, rebuild_quantized_llama

        kernels = quant_kernels()
        tile_rows = kernels[2] if kernels is not None else 8
        matmuls = None if kernels is None else (kernels[0], kernels[1])
        int8_activations = int8_activations or requantize
        # without 8-bit activations nothing is rounded
        wide_quads = wide_quads or not int8_activations
        super_block_acts = super_block_acts or not int8_activations
        cache = self.blocks_cache_path(tile_rows, int8_activations, requantize, wide_quads, super_block_acts)
        header = _read_header(cache)
        if header is not None:
            config = _config_from_json(header[_CONFIG_KEY])
            return config, rebuild_quantized_llama(config, load_file(cache, device="cpu"), matmuls)
        config, dense, quantized = read_quantized_gguf(self.path, self.reader())
        if requantize:
            # the projections; the embedding and head keep their type (a draft's argmax is its head's)
            quantized = {
                name: groups if name in _KEPT_BY_REQUANTIZE else requantize_4bit(groups)
                for name, groups in quantized.items()
            }
        model = build_quantized_llama(
            config, dense, quantized, tile_rows, matmuls, int8_activations, wide_quads, super_block_acts
        )
        del dense, quantized
        if not self._store(cache, quantized_state(model), config):
            return config, model
        # the model built from the mapped file: its weights are the cache's pages, not a private copy
        return config, rebuild_quantized_llama(config, load_file(cache, device="cpu"), matmuls)

    def load_model(self, device: torch.device, dtype: torch.dtype) -> tuple[LlamaConfig, LlamaForCausalLM]:
        config, state_dict = self.load_weights()
        for name in list(state_dict):  # one tensor at a time: never two full copies of the model
            state_dict[name] = state_dict[name].to(device=device, dtype=dtype)
        return config, build_llama(config, state_dict, dtype, fused=True)


def load_gguf_model(
    path: str | Path, device: torch.device, dtype: torch.dtype, cache_dir: str | Path | None = None
) -> tuple[LlamaConfig, LlamaForCausalLM]:
    return GGUFFile(path, cache_dir).load_model(device, dtype)


def _metadata_values(reader: Any) -> dict[str, Any]:
    """Every key/value field but the file header's (``GGUF.*``), as Python values."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _read_header(path: Path) -> dict[str, str] | None:
    """A cache file's tokenmill metadata, or None when it is absent or unreadable (then it is rebuilt)."""
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            header = f.metadata()
        if header is None or _CONFIG_KEY not in header or _FIELDS_KEY not in header:
            raise ValueError("no tokenmill metadata")
        return dict(header)
    except Exception as exc:  # a damaged cache file is rebuilt, not fatal
        warnings.warn(f"ignoring unreadable GGUF cache {path}: {exc}", stacklevel=2)
        return None


def _write_cache_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write to a temporary file in the same directory, then rename: readers never see half a file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp_name, metadata=metadata)
        os.chmod(tmp_name, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp_name, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)


def _config_to_json(config: LlamaConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def _config_from_json(text: str) -> LlamaConfig:
    fields = json.loads(text)
    fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    for key in ("rope_freq_factors", "sliding_window_layers"):
        if fields.get(key) is not None:
            fields[key] = tuple(fields[key])
    return LlamaConfig(**fields)
