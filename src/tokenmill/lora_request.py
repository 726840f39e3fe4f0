"""Which LoRA adapter a request runs with: vLLM's ``LoRARequest`` (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique to it, and the PEFT folder it loads from
    (``adapter_config.json`` + ``adapter_model.safetensors``). ``base_model_name``: the model it was trained on,
    when known (the server's ``--lora-modules`` JSON form takes it; it is reported, the weights' shapes are
    what is checked)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest: lora_name must be a non-empty string")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"LoRARequest: lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("LoRARequest: lora_path must be a non-empty string")
