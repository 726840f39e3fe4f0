"""LoRA adapters on the decoder's fused projections: loaded from PEFT folders, kept in slots, applied per row.

An adapter adds ``scale * x @ A^T @ B^T`` to a projection's output (``A [r, in]``, ``B [out, r]``; ``scale`` is
``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA). The decoder fuses q, k, v into ``qkv_proj`` and gate,
up into ``gate_up_proj``; an adapter's parts of one fused projection are stacked: ``A`` of q, k and v one above
the other (``[3r, in]``) and their ``B`` as one block-diagonal ``[out, 3r]``, so a fused projection takes its whole
adapter in two matmuls.

Serving many adapters at once (:class:`LoRASlots`): ``max_loras`` slots per projection, each ``[width, in]`` for
A and ``[out, width]`` for B (``width`` = parts x ``max_lora_rank``; a smaller rank leaves zero columns). A step
whose rows use adapters runs each projection once for every row (the base weights, whatever their arithmetic),
then every slot's A over every row, masked to each row's own slot, then B: rows of the base model and of several
adapters share one batch, and each row gets exactly its own adapter's delta (the mask zeroes the rest before B).
The extra work is ``max_loras * width`` columns per projection: a few percent of a projection's own.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenmill.model.config import LlamaConfig

# tokenmill's fused projections and the Hugging Face modules each is made of, in row order
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
PART_OF = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}
# checkpoints that come fused (Phi-3) name the fused module itself
PART_OF.update({"qkv_proj": "qkv_proj", "gate_up_proj": "gate_up_proj"})
_SUPPORTED_CONFIG = {"lora", "LORA"}


def part_shapes(config: LlamaConfig) -> dict[str, list[tuple[str, int, int]]]:
    """Per fused projection, its parts as (name, rows, in_features), in row order."""
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    return {
        "qkv_proj": [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h)],
        "o_proj": [("o_proj", h, q)],
        "gate_up_proj": [("gate_proj", inter, h), ("up_proj", inter, h)],
        "down_proj": [("down_proj", h, inter)],
    }


@dataclass
class LoRAAdapter:
    """One adapter's weights: ``weights[(layer, fused)] = (A [parts * r, in], B [out, parts * r])``, B scaled."""

    name: str
    rank: int
    path: str
    digest: str  # sha256 of the weights file: the prefix cache keeps adapters apart by it
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_adapter_config(path: Path) -> dict[str, Any]:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {path}: no adapter_config.json (a PEFT adapter folder is expected)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {path}: adapter_config.json is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path}: adapter_config.json must hold an object")
    return config


def _check_config(path: Path, config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """(rank, scale) from a PEFT config, or ValueError for what tokenmill does not apply."""
    if str(config.get("peft_type", "LORA")) not in _SUPPORTED_CONFIG:
        raise ValueError(f"LoRA adapter {path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, allowed in (
        ("use_dora", (False, None)),
        ("bias", ("none", None)),
        ("fan_in_fan_out", (False, None)),
    ):
        if config.get(key) not in allowed:
            raise ValueError(f"LoRA adapter {path}: {key}={config.get(key)!r} is not supported")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {path}: modules_to_save {config['modules_to_save']} is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(
            f"LoRA adapter {path}: per-module ranks (rank_pattern, alpha_pattern) are not supported"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA adapter {path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {path}: rank {rank} is above max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {path}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _module_key(path: Path, key: str, num_layers: int) -> tuple[int, str, str]:
    """A PEFT tensor name -> (layer, module, "lora_A" | "lora_B")."""
    parts = key.split(".")
    try:
        which = parts[-2]
        layer = int(parts[parts.index("layers") + 1])
        module = parts[-3]
    except (ValueError, IndexError):
        raise ValueError(f"LoRA adapter {path}: tensor {key!r} is not a layer's projection") from None
    if which not in ("lora_A", "lora_B") or parts[-1] != "weight":
        raise ValueError(f"LoRA adapter {path}: tensor {key!r} is not a lora_A / lora_B weight")
    if module not in PART_OF:
        raise ValueError(f"LoRA adapter {path}: target module {module!r} is not one this model has "
                         f"(it takes {', '.join(sorted(PART_OF))})")  # fmt: skip
    if not 0 <= layer < num_layers:
        raise ValueError(f"LoRA adapter {path}: layer {layer} is past the model's {num_layers} layers")
    return layer, module, which


def load_adapter(name: str, path: str | Path, config: LlamaConfig, max_rank: int) -> LoRAAdapter:
    """A LoRA adapter on this model's projections: a PEFT folder (``adapter_config.json`` +
    ``adapter_model.safetensors``) or llama.cpp's GGUF LoRA file. ValueError for a rank above ``max_rank``,
    modules the model does not have, and shapes (or a GGUF architecture) of another base model."""
    import hashlib

    source = Path(path)
    if source.is_file() and source.suffix == ".gguf":
        found, rank, scale = _read_gguf_lora(source, config, max_rank)
        weights_file = source
    else:
        rank, scale = _check_config(source, read_adapter_config(source), max_rank)
        weights_file = source / "adapter_model.safetensors"
        if not weights_file.is_file():
            raise ValueError(f"LoRA adapter {source}: no adapter_model.safetensors")
        found = _read_peft_tensors(source, weights_file, config.num_hidden_layers)
    digest = hashlib.sha256(weights_file.read_bytes()).hexdigest()
    adapter = LoRAAdapter(name=name, rank=rank, path=str(source), digest=digest)
    for fused, parts in part_shapes(config).items():
        for layer in range(config.num_hidden_layers):
            pair = _fused_pair(source, found, layer, fused, parts, rank, scale)
            if pair is not None:
                adapter.weights[(layer, fused)] = pair
    if not adapter.weights:
        raise ValueError(f"LoRA adapter {source}: no lora_A / lora_B weights")
    return adapter


Found = dict[
    tuple[int, str], dict[str, torch.Tensor]
]  # (layer, module) -> {"lora_A": [r, in], "lora_B": [out, r]}


def _read_peft_tensors(folder: Path, weights_file: Path, num_layers: int) -> Found:
    from safetensors.torch import load_file

    found: Found = {}
    for key, tensor in load_file(str(weights_file)).items():
        layer, module, which = _module_key(folder, key, num_layers)
        found.setdefault((layer, module), {})[which] = tensor.float()
    return found


def _read_gguf_lora(path: Path, config: LlamaConfig, max_rank: int) -> tuple[Found, int, float]:
    """llama.cpp's LoRA GGUF (``convert_lora_to_gguf.py``): ``general.type`` adapter, ``adapter.type`` lora,
    ``adapter.lora.alpha``, tensors ``blk.N.<base tensor>.weight.lora_a`` ``[r, in]`` and ``.lora_b`` ``[out, r]``
    (q and k rows interleaved as llama.cpp's converter writes a ``llama`` model's). Scale alpha / r, 1 without
    alpha, as llama.cpp applies it."""
    import gguf

    from tokenmill.model.gguf_loader import hf_tensor_name, rope_row_order

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {path}: not a readable GGUF file: {exc}") from None

    def field(key: str) -> object:
        value = reader.fields.get(key)
        return None if value is None else value.contents()

    if field("general.type") != "adapter" or str(field("adapter.type")).lower() != "lora":
        raise ValueError(
            f"LoRA adapter {path}: a GGUF with general.type adapter and adapter.type lora is expected"
        )
    arch = str(field("general.architecture") or "llama")
    if _GGUF_ARCH.get(config.model_type, config.model_type) != arch:
        raise ValueError(f"LoRA adapter {path}: made for a {arch} model, this model is {config.model_type}")
    found: Found = {}
    for tensor in reader.tensors:
        base, _, which = tensor.name.rpartition(".")
        if which not in ("lora_a", "lora_b"):
            raise ValueError(f"LoRA adapter {path}: tensor {tensor.name!r} is not a lora_a / lora_b weight")
        try:
            hf_name = hf_tensor_name(base, arch)
        except ValueError:
            raise ValueError(
                f"LoRA adapter {path}: tensor {tensor.name!r} is not a layer's projection"
            ) from None
        layer, module, _ = _module_key(
            path, f"{hf_name.removesuffix('.weight')}.lora_A.weight", config.num_hidden_layers
        )
        values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()).float()
        if which == "lora_b" and (order := rope_row_order(hf_name, config)) is not None:
            values = values[order]
        found.setdefault((layer, module), {})["lora_A" if which == "lora_a" else "lora_B"] = values
    ranks = {pair["lora_A"].shape[0] for pair in found.values() if "lora_A" in pair}
    if len(ranks) != 1:
        raise ValueError(
            f"LoRA adapter {path}: lora_a tensors of ranks {sorted(ranks)}; one rank is supported"
        )
    rank = ranks.pop()
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {path}: rank {rank} is above max_lora_rank {max_rank}")
    alpha = field("adapter.lora.alpha")
    scale = float(alpha) / rank if isinstance(alpha, (int, float)) and alpha else 1.0
    return found, rank, scale


# tokenmill's model_type -> the GGUF architecture llama.cpp writes it as
_GGUF_ARCH = {"mistral": "llama"}


def _fused_pair(
    folder: Path,
    found: dict[tuple[int, str], dict[str, torch.Tensor]],
    layer: int,
    fused: str,
    parts: list[tuple[str, int, int]],
    rank: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One fused projection's stacked A and block-diagonal, scaled B for one layer (None: the adapter leaves it)."""
    if (layer, fused) in found and len(parts) > 1:  # a checkpoint with the fused module (Phi-3)
        parts = [(fused, sum(p[1] for p in parts), parts[0][2])]
    if not any((layer, p[0]) in found for p in parts):
        return None
    out_rows = sum(p[1] for p in parts)
    a = torch.zeros(len(parts) * rank, parts[0][2])
    b = torch.zeros(out_rows, len(parts) * rank)
    row = 0
    for i, (module, rows, in_features) in enumerate(parts):
        pair = found.get((layer, module))
        if pair is not None:
            if set(pair) != {"lora_A", "lora_B"}:
                raise ValueError(f"LoRA adapter {folder}: layer {layer} {module} lacks lora_A or lora_B")
            la, lb = pair["lora_A"], pair["lora_B"]
            if tuple(la.shape) != (rank, in_features) or tuple(lb.shape) != (rows, rank):
                raise ValueError(
                    f"LoRA adapter {folder}: layer {layer} {module} has A {tuple(la.shape)} and B "
                    f"{tuple(lb.shape)}, this model needs ({rank}, {in_features}) and ({rows}, {rank}): "
                    "an adapter of another base model"
                )
            a[i * rank : (i + 1) * rank] = la
            b[row : row + rows, i * rank : (i + 1) * rank] = lb * scale
        row += rows
    return a, b


class LoRASlots:
    """``max_loras`` slots for every fused projection of every layer (``csrc/lora.h`` says the layout): A
    ``[max_loras * parts * max_rank, in]`` (slot, then part, then rank row) and B ``[max_loras, max_rank, out]``
    (each slot's B transposed, its parts side by side: output n of part i takes rank rows ``i * max_rank ..``), zero
    where a slot is empty or its adapter's rank is smaller."""

    def __init__(
        self,
        config: LlamaConfig,
        max_loras: int,
        max_rank: int,
        device: torch.device | str = "cpu",
        shapes: dict[str, list[tuple[str, int, int]]] | None = None,
    ) -> None:
        """``shapes``: the projections' parts as this process holds them (a tensor-parallel rank's share);
        default the whole model's (:func:`part_shapes`)."""
        self.max_loras, self.max_rank = max_loras, max_rank
        shapes = part_shapes(config) if shapes is None else shapes
        self.parts = {fused: len(parts) for fused, parts in shapes.items()}
        self.part_starts = {
            fused: [0, *itertools.accumulate(p[1] for p in parts)] for fused, parts in shapes.items()
        }
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for fused, parts in shapes.items():
            out_rows, in_features = sum(p[1] for p in parts), parts[0][2]
            for layer in range(config.num_hidden_layers):
                self.a[(layer, fused)] = torch.zeros(
                    max_loras * len(parts) * max_rank, in_features, device=device
                )
                self.b[(layer, fused)] = torch.zeros(max_loras, max_rank, out_rows, device=device)
        self.holder: list[int | None] = [None] * max_loras  # the adapter id in each slot
        self._stack_weights: list[torch.Tensor] | None = None

    def stack_weights(self) -> list[torch.Tensor]:
        """Per layer, (a, b) of qkv, o, gate_up and down: what the C++ decode stack takes (``forward_lora``); the
        same tensors every step (a placement writes into them)."""
        if self._stack_weights is None:
            layers = sorted({layer for layer, _ in self.a})
            order = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
            self._stack_weights = [
                t
                for layer in layers
                for fused in order
                for t in (self.a[(layer, fused)], self.b[(layer, fused)])
            ]
        return self._stack_weights

    def place(self, slot: int, adapter_id: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (every projection; the ones it leaves are zeroed)."""
        r, big = adapter.rank, self.max_rank
        for key, a_slots in self.a.items():
            parts = self.parts[key[1]]
            a_view = a_slots[slot * parts * big : (slot + 1) * parts * big]
            b_view = self.b[key][slot]  # [max_rank, out]
            a_view.zero_(), b_view.zero_()
            pair = adapter.weights.get(key)
            if pair is None:
                continue
            a, b = pair  # [parts * r, in], block-diagonal [out, parts * r]
            starts = self.part_starts[key[1]]
            for i in range(parts):
                a_view[i * big : i * big + r] = a[i * r : (i + 1) * r]
                b_view[:r, starts[i] : starts[i + 1]] = b[starts[i] : starts[i + 1], i * r : (i + 1) * r].t()
        self.holder[slot] = adapter_id


class StepLoRA:
    """A step's adapters: each token's slot (-1: the base model), and :meth:`add`, which adds every row's own
    adapter delta to a projection's output (the C++ kernel on CPU, else torch: the rows' A products over every
    slot, masked to each row's own)."""

    def __init__(self, slots: LoRASlots, token_slots: list[int], kernel: Any = None) -> None:
        self.slots = slots
        self.kernel = kernel  # csrc/lora.h's lora_add_, or None
        device = next(iter(slots.a.values())).device
        self.index = torch.tensor(token_slots, dtype=torch.long, device=device)
        self.masks: dict[int, torch.Tensor] = {}
        if kernel is None:
            one_hot = torch.zeros(len(token_slots), slots.max_loras, device=device)
            rows = self.index >= 0
            one_hot[rows.nonzero().squeeze(1), self.index[rows]] = 1.0
            # per number of parts: [T, max_loras * parts * max_rank], slot-major as A's rows
            self.masks = {
                p: one_hot.repeat_interleave(p * slots.max_rank, dim=1) for p in set(slots.parts.values())
            }

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out += B_s A_s x`` per row for projection ``fused`` of ``layer`` (``x [T, in]``, ``out [T, out]``)."""
        key = (layer, fused)
        a, b = self.slots.a[key], self.slots.b[key]
        starts = self.slots.part_starts[fused]
        if self.kernel is not None and x.dtype == out.dtype == torch.float32 and out.is_contiguous():
            self.kernel(x.contiguous(), out, a, b, self.index, starts)
            return out
        parts, rank, num_slots = self.slots.parts[fused], self.slots.max_rank, self.slots.max_loras
        h = torch.mm(x.float(), a.t()).mul_(self.masks[parts])  # [T, slots * parts * rank]
        h = h.view(-1, num_slots, parts, rank)
        b_all = b.view(num_slots * rank, -1)  # [slots * rank, out]
        for i in range(parts):
            h_i = h[:, :, i, :].reshape(-1, num_slots * rank)
            out[:, starts[i] : starts[i + 1]] += (h_i @ b_all[:, starts[i] : starts[i + 1]]).to(out.dtype)
        return out
