"""Llama weights from a Hugging Face model directory: ``config.json`` plus safetensors (one file or shards)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tokenmill.generation_defaults import read_json_object
from tokenmill.model.config import LlamaConfig
from tokenmill.model.llama import LlamaForCausalLM, build_llama

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: Path) -> LlamaConfig:
    """``config.json`` (eos ids joined with ``generation_config.json``'s); ValueError when not a Llama dir."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    config = LlamaConfig.from_hf_dict(read_json_object(config_path))
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        eos = read_json_object(generation_path).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        eos_ids = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
        return dataclasses.replace(config, eos_token_ids=eos_ids)
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: the shards named by the index, or the single file; ValueError if none."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json_object(index_path).get("weight_map") or {}
        shards = [model_dir / name for name in sorted(set(weight_map.values()))]
        if not shards:
            raise ValueError(f"{index_path} lists no weight files")
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise ValueError(
                f"{model_dir} is missing safetensors shard(s) named in {INDEX_FILE}: {', '.join(absent)}"
            )
        return shards
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    hint = f" (found {', '.join(others)}: only safetensors weights are supported)" if others else ""
    raise ValueError(f"no safetensors weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")


def load_hf_model(
    model_dir: Path, device: torch.device, dtype: torch.dtype, config: LlamaConfig | None = None
) -> tuple[LlamaConfig, LlamaForCausalLM]:
    from safetensors import safe_open

    config = read_hf_config(model_dir) if config is None else config
    state_dict: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                state_dict[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return config, build_llama(config, state_dict, dtype)
