"""The choice of a model's compute backend (``backend.py``'s plain torch, ``cpu/backend.py``'s C++ kernels), made
once at load from the device and the dtype."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.backend import TorchBackend
from tokenmill.model.cpu import kernels
from tokenmill.model.cpu.backend import CpuKernelBackend
from tokenmill.model.cpu.packing import can_pack, pack_encoder, pack_for_cpu


def select_backend(
    device: torch.device | str, dtype: torch.dtype, head_dim: int, *, decode_stack: bool = True
) -> TorchBackend:
    """The backend for a model on ``device`` in ``dtype``: the C++ kernels for float32 on CPU when they are loaded
    (``decode_stack=False`` leaves out the fused decode stack: tensor parallelism all-reduces between layers),
    else plain torch (on CPU in float32 with oneDNN's blocked weights, no panel kernels without the C++ ones)."""
    device = torch.device(device)
    if device.type == "cpu" and dtype == torch.float32 and kernels.loaded().module is not None:
        return CpuKernelBackend(head_dim, decode_stack=decode_stack)
    return TorchBackend(device, pack=pack_for_cpu if can_pack(device, dtype) else None)


def prepare_encoder(encoder: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """An embedding model's linears on CPU in fp32: weights reordered for oneDNN, whose matmul adds the bias
    and the GELU in the same pass (``model/cpu/packing.pack_encoder``); elsewhere the plain ``F.linear``."""
    if can_pack(device, dtype) and torch.backends.mkldnn.is_available():
        pack_encoder(encoder)
