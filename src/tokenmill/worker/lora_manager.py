"""The LoRA adapters a runner serves: loaded from their folders (at most ``max_cpu_loras`` kept, least recently
used out first), placed in the model's ``max_loras`` slots as steps need them, and each step's rows mapped to
their slots (``model.lora.StepLoRA``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.core.sched_output import ScheduledRow
from tokenmill.lora_request import LoRARequest
from tokenmill.model.config import LlamaConfig
from tokenmill.model.cpu.kernels import lora_kernel
from tokenmill.model.lora import LoRAAdapter, LoRASlots, StepLoRA, load_adapter


class LoRAManager:
    def __init__(
        self,
        config: LlamaConfig,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int | None,
        device: torch.device | str = "cpu",
        shard: tuple[Any, Callable[[LoRAAdapter], LoRAAdapter]] | None = None,
    ) -> None:
        """``shard``: a tensor-parallel rank's projection shapes and the function that cuts an adapter to them
        (``tensor_parallel.lora_shard``): adapters are loaded whole (their shapes checked against the whole model)
        and cut to this rank's share."""
        self.config = config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        shapes, self._cut = shard if shard is not None else (None, None)
        self.slots = LoRASlots(config, max_loras, max_rank, device, shapes)
        self.kernel = lora_kernel() if torch.device(device).type == "cpu" else None
        self.requests: dict[int, LoRARequest] = {}  # every adapter added, by id
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # most recently used last
        self._slot_used: list[int] = [0] * max_loras  # the step each slot last served

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Load (or find) ``request``'s adapter; ValueError for a bad folder or one of another model, or an id
        already taken by another adapter."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) != (request.lora_path, request.lora_name):
            raise ValueError(
                f"LoRA id {request.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}), "
                f"not {request.lora_name!r} ({request.lora_path})"
            )
        adapter = self._get(request)
        self.requests[request.lora_int_id] = request
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot freed); False when it was not known."""
        if self.requests.pop(lora_int_id, None) is None:
            return False
        self.loaded.pop(lora_int_id, None)
        for slot, holder in enumerate(self.slots.holder):
            if holder == lora_int_id:
                self.slots.holder[slot] = None
        return True

    def _get(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.loaded.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request.lora_name, request.lora_path, self.config, self.max_rank)
            if self._cut is not None:
                adapter = self._cut(adapter)
            self.loaded[request.lora_int_id] = adapter
            while len(self.loaded) > self.max_cpu_loras:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(request.lora_int_id)
        return adapter

    def requests_of(self, rows: list[ScheduledRow]) -> dict[int, LoRARequest]:
        """The adapters these rows use, by id (what a tensor-parallel step sends its workers)."""
        return {row.lora_id: self.requests[row.lora_id] for row in rows if row.lora_id}

    def step(self, rows: list[ScheduledRow], step_index: int) -> StepLoRA | None:
        """The step's adapters in slots and each token's slot; None when no row has one. The scheduler admits at
        most ``max_loras`` adapters into one step."""
        ids = {row.lora_id for row in rows if row.lora_id}
        if not ids:
            return None
        if len(ids) > len(self.slots.holder):
            raise RuntimeError(f"a step with {len(ids)} adapters; the slots hold {len(self.slots.holder)}")
        slot_of = {}
        for lora_id in sorted(ids):
            if lora_id in self.slots.holder:
                slot_of[lora_id] = self.slots.holder.index(lora_id)
        for lora_id in sorted(ids - set(slot_of)):
            free = [s for s in range(len(self.slots.holder)) if s not in slot_of.values()]
            slot = min(free, key=lambda s: (self.slots.holder[s] is not None, self._slot_used[s]))
            self.slots.place(slot, lora_id, self._get(self.requests[lora_id]))
            slot_of[lora_id] = slot
        for slot in slot_of.values():
            self._slot_used[slot] = step_index
        token_slots: list[int] = []
        for row in rows:
            token_slots += [slot_of[row.lora_id] if row.lora_id else -1] * row.num_new_tokens
        return StepLoRA(self.slots, token_slots, self.kernel)
