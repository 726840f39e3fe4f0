"""The per-row LoRA delta (``csrc/lora.h``'s ``lora_add_`` on every variant, and ``StepLoRA``'s torch path) against
float64: each row through its own adapter's parts, ``out[rows of part i] += B_i (A_i x)``, computed from the
adapters' own matrices, never from the slot layout. Row counts 1..40 and 300, runs of one slot and alternating
slots, rows without an adapter, ranks below the slots' maximum, widths with vector tails, one to three parts."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import tiny_config

from tokenmill.model.lora import LoRAAdapter, LoRASlots, StepLoRA, part_shapes

MAX_RANK = 16


def random_adapter(config, rank: int, seed: int, leave: tuple[str, ...] = ()) -> tuple[LoRAAdapter, dict]:
    """An adapter as ``load_adapter`` builds it (stacked A, block-diagonal B) and its parts' own matrices."""
    generator = torch.Generator().manual_seed(seed)
    adapter = LoRAAdapter(name=f"a{seed}", rank=rank, path="", digest=str(seed))
    own: dict = {}
    for fused, parts in part_shapes(config).items():
        if fused in leave:
            continue
        for layer in range(config.num_hidden_layers):
            a = torch.randn(len(parts) * rank, parts[0][2], generator=generator)
            out_rows = sum(p[1] for p in parts)
            b = torch.zeros(out_rows, len(parts) * rank)
            row = 0
            for i, (_, rows, _) in enumerate(parts):
                b[row : row + rows, i * rank : (i + 1) * rank] = torch.randn(rows, rank, generator=generator)
                own[(layer, fused, i)] = (
                    a[i * rank : (i + 1) * rank].double(),
                    b[row : row + rows, i * rank : (i + 1) * rank].double(),
                    row,
                )
                row += rows
            adapter.weights[(layer, fused)] = (a, b)
    return adapter, own


def reference(config, owns: list[dict], slots_of_rows: list[int], layer: int, fused: str, x, out):
    expected = out.double().clone()
    for t, s in enumerate(slots_of_rows):
        if s < 0:
            continue
        for i, (_, rows, _) in enumerate(part_shapes(config)[fused]):
            if (layer, fused, i) not in owns[s]:
                continue
            a, b, row = owns[s][(layer, fused, i)]
            expected[t, row : row + rows] += b @ (a @ x[t].double())
    return expected


def row_slots(num_rows: int, num_slots: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    slots: list[int] = []
    while len(slots) < num_rows:  # runs of one slot (a prompt's chunk), single rows, rows without an adapter
        slots += [rng.randrange(-1, num_slots)] * rng.choice([1, 1, 2, 5, 11])
    return slots[:num_rows]


CONFIG = tiny_config(
    hidden_size=40, intermediate_size=100, num_attention_heads=5, num_key_value_heads=1, head_dim=8
)


@pytest.mark.parametrize("num_rows", [*range(1, 41), 300])
def test_kernel_and_torch_path_against_float64(kernel_variant, num_rows: int) -> None:
    slots = LoRASlots(CONFIG, max_loras=3, max_rank=MAX_RANK)
    owns = []
    for s, (rank, leave) in enumerate([(16, ()), (4, ("o_proj",)), (7, ("qkv_proj", "down_proj"))]):
        adapter, own = random_adapter(CONFIG, rank, seed=s, leave=leave)
        slots.place(s, s + 1, adapter)
        owns.append(own)
    token_slots = row_slots(num_rows, 3, seed=num_rows)
    generator = torch.Generator().manual_seed(num_rows)
    for fused, parts in part_shapes(CONFIG).items():
        x = torch.randn(num_rows, parts[0][2], generator=generator)
        base = torch.randn(num_rows, sum(p[1] for p in parts), generator=generator)
        expected = reference(CONFIG, owns, token_slots, 1, fused, x, base)
        for kernel in (kernel_variant.lora_add_, None):
            out = base.clone()
            StepLoRA(slots, token_slots, kernel).add(1, fused, x, out)
            torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5, msg=f"{fused} {kernel}")


def test_kernel_refuses_bad_shapes(kernel_variant) -> None:
    x, out = torch.zeros(2, 8), torch.zeros(2, 6)
    a, b = torch.zeros(2 * 1 * 4, 8), torch.zeros(2, 4, 6)
    ok = torch.tensor([0, -1])
    kernel_variant.lora_add_(x, out, a, b, ok, [0, 6])
    with pytest.raises(RuntimeError, match="slot 2 of row 1"):
        kernel_variant.lora_add_(x, out, a, b, torch.tensor([0, 2]), [0, 6])
    with pytest.raises(RuntimeError, match="part_starts"):
        kernel_variant.lora_add_(x, out, a, b, ok, [0, 5])
    with pytest.raises(RuntimeError, match="a \\[S \\* P \\* R, K\\]"):
        kernel_variant.lora_add_(x, out, torch.zeros(3, 8), b, ok, [0, 6])
    with pytest.raises(RuntimeError, match="one row per token"):
        kernel_variant.lora_add_(x, out, a, b, torch.tensor([0]), [0, 6])
