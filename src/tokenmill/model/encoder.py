"""BERT-style encoders for embeddings (all-MiniLM-L6-v2 and its kin), over the same flat, unpadded batch as the
decoder: rows' tokens side by side ``[T, hidden]``; only attention pads, per row, because it is bidirectional.

The model is what sentence-transformers runs for such a directory: word + absolute position + token-type 0
embeddings, LayerNorm; per layer self-attention (all of a row's tokens see each other), residual and LayerNorm,
GELU (erf) feed-forward, residual and LayerNorm (post-norm); then the pooling ``1_Pooling/config.json`` names
(mean over the row's tokens, special ones included, or the CLS token) and, when ``modules.json`` lists a
Normalize module, unit length. ``max_position_embeddings`` is sentence-transformers' ``max_seq_length`` when
``sentence_bert_config.json`` gives one (longer inputs are refused, never cut silently).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ENCODER_TYPES = ("bert",)


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int  # the longest input served (sentence-transformers' max_seq_length)
    layer_norm_eps: float = 1e-12
    pooling: str = "mean"  # "mean" or "cls"
    normalize: bool = True
    model_type: str = "bert"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def layer_window(self, layer: int) -> int | None:
        return None  # every token sees every other one of its row

    @classmethod
    def from_dir(cls, root: Path) -> EncoderConfig:
        hf = _read_json(root / "config.json")
        if hf.get("model_type") not in ENCODER_TYPES:
            raise ValueError(f"{root}: model_type {hf.get('model_type')!r} is not an encoder tokenmill runs")
        if (
            hf.get("position_embedding_type", "absolute") != "absolute"
            or hf.get("hidden_act", "gelu") != "gelu"
        ):
            raise ValueError(f"{root}: only absolute positions and erf GELU are supported in encoders")
        pooling_cfg = _read_json(root / "1_Pooling" / "config.json")
        if pooling_cfg.get("pooling_mode_cls_token"):
            pooling = "cls"
        elif pooling_cfg.get("pooling_mode_mean_tokens", True):
            pooling = "mean"
        else:
            raise ValueError(f"{root}: pooling {pooling_cfg} is not supported (mean or CLS)")
        modules = json.loads((root / "modules.json").read_text()) if (root / "modules.json").is_file() else []
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
        max_len = int(hf["max_position_embeddings"])
        max_seq = _read_json(root / "sentence_bert_config.json").get("max_seq_length")
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=int(hf["num_attention_heads"]),
            intermediate_size=int(hf["intermediate_size"]),
            max_position_embeddings=min(max_len, int(max_seq)) if max_seq else max_len,
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            pooling=pooling,
            normalize=normalize,
        )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def is_encoder_dir(path: Path) -> bool:
    return path.is_dir() and _read_json(path / "config.json").get("model_type") in ENCODER_TYPES


class EncoderLinear(nn.Linear):
    """``nn.Linear`` with an optional GELU after it; on CPU in fp32 the backend may give it a weight reordered
    for oneDNN (``packed_weight``), whose matmul adds the bias and applies the GELU in the same pass."""

    def __init__(self, in_features: int, out_features: int, gelu: bool = False) -> None:
        super().__init__(in_features, out_features)
        self.gelu = gelu
        self.packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            attr = "gelu" if self.gelu else "none"
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, attr, [], "none" if self.gelu else ""
            )  # type: ignore[no-any-return]
        y = F.linear(x, self.weight, self.bias)
        return F.gelu(y) if self.gelu else y


class EncoderLayer(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.qkv = EncoderLinear(h, 3 * h)  # query, key, value stacked
        self.out = EncoderLinear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=eps)
        self.up = EncoderLinear(h, config.intermediate_size, gelu=True)
        self.down = EncoderLinear(config.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, pad: _Padding) -> torch.Tensor:
        num_tokens, hidden = x.shape
        qkv = self.qkv(x).view(num_tokens, 3, self.num_heads, hidden // self.num_heads)  # [T, 3, heads, d]
        q, k, v = (pad.to_rows(qkv[:, i]) for i in range(3))  # each [B, heads, L, d]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=pad.mask)  # [B, heads, L, d]
        x = self.attn_norm(x + self.out(pad.to_flat(attn)))
        return self.ffn_norm(x + self.down(self.up(x)))  # type: ignore[no-any-return]


class _Padding:
    """Where a flat batch's tokens sit in a padded ``[B, L]`` one, for attention only."""

    def __init__(self, seq_lens: list[int], device: torch.device) -> None:
        self.num_rows, self.max_len = len(seq_lens), max(seq_lens)
        lens = torch.tensor(seq_lens, device=device)
        offsets = torch.arange(self.max_len, device=device)
        valid = offsets[None, :] < lens[:, None]  # [B, L]
        self.dest = valid.flatten().nonzero().squeeze(1)  # [T]: flat token -> b * L + j
        self.mask = None if bool(valid.all()) else valid[:, None, None, :]  # [B, 1, 1, L] keys to attend

    def to_rows(self, t: torch.Tensor) -> torch.Tensor:
        """``[T, heads, d]`` -> ``[B, heads, L, d]`` (padding zeros)."""
        _, heads, d = t.shape
        out = t.new_zeros(self.num_rows * self.max_len, heads, d)
        out[self.dest] = t
        return out.view(self.num_rows, self.max_len, heads, d).transpose(1, 2)

    def to_flat(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, heads, L, d]`` -> ``[T, heads * d]``, padding dropped."""
        b, heads, length, d = t.shape
        return t.transpose(1, 2).reshape(b * length, heads * d)[self.dest]


class Encoder(nn.Module):
    """Token ids of several rows, flat, in; one pooled (and normalised) vector per row out."""

    is_encoder = True

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embedding = nn.Parameter(torch.zeros(h))  # type 0: every input is one segment
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[T]``; ``seq_lens``: each row's length (summing to T) -> ``[B, hidden]``."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embedding
        x = self.embed_norm(x)  # [T, H]
        pad = _Padding(seq_lens, x.device)
        for layer in self.layers:
            x = layer(x, pad)
        lens = torch.tensor(seq_lens, device=x.device)
        if self.config.pooling == "cls":
            starts = torch.cumsum(lens, 0) - lens
            pooled = x[starts]  # [B, H]
        else:
            row = torch.repeat_interleave(torch.arange(len(seq_lens), device=x.device), lens)  # [T]
            pooled = x.new_zeros(len(seq_lens), x.shape[1]).index_add_(0, row, x) / lens[:, None].to(x.dtype)
        return F.normalize(pooled, p=2.0, dim=1) if self.config.normalize else pooled


def load_encoder(root: Path, device: torch.device, dtype: torch.dtype) -> tuple[EncoderConfig, Encoder]:
    """The encoder of an HF directory (``model.safetensors``, BERT names with or without a ``bert.`` prefix)."""
    from safetensors.torch import load_file

    config = EncoderConfig.from_dir(root)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root}: no .safetensors weights")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        raw.update({k.removeprefix("bert."): v for k, v in load_file(str(file)).items()})

    def take(name: str) -> torch.Tensor:
        try:
            return raw[name]
        except KeyError:
            raise ValueError(f"{root}: weight {name!r} is missing") from None

    state: dict[str, torch.Tensor] = {
        "word_embeddings.weight": take("embeddings.word_embeddings.weight"),
        "position_embeddings.weight": take("embeddings.position_embeddings.weight")[
            : config.max_position_embeddings
        ],
        "token_type_embedding": take("embeddings.token_type_embeddings.weight")[0],
        "embed_norm.weight": take("embeddings.LayerNorm.weight"),
        "embed_norm.bias": take("embeddings.LayerNorm.bias"),
    }
    for i in range(config.num_hidden_layers):
        p, q = f"encoder.layer.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            state[q + f"qkv.{kind}"] = torch.cat(
                [take(p + f"attention.self.{n}.{kind}") for n in ("query", "key", "value")]
            )
            state[q + f"out.{kind}"] = take(p + f"attention.output.dense.{kind}")
            state[q + f"attn_norm.{kind}"] = take(p + f"attention.output.LayerNorm.{kind}")
            state[q + f"up.{kind}"] = take(p + f"intermediate.dense.{kind}")
            state[q + f"down.{kind}"] = take(p + f"output.dense.{kind}")
            state[q + f"ffn_norm.{kind}"] = take(p + f"output.LayerNorm.{kind}")
    with torch.device("meta"):
        model = Encoder(config)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=True)
    return config, model.to(device).eval()
