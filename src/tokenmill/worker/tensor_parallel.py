"""Tensor parallelism over ``torch.distributed``: one model's layers split across ranks (gloo on CPU, NCCL on
CUDA with one device per rank; the NCCL path runs in ``benchmarks/gpu_check.sh`` on a machine with two GPUs and
has not run yet).

Rank 0 is the engine's own process: it schedules, and before each forward broadcasts the step's rows (the
scheduler's own output, plain data: ``core/sched_output.py``) to the worker processes, which run the same
forward (``forward.forward_rows``) on their shards; rank 0 alone computes logits and samples.

The split, for ``world`` ranks (Megatron-style, as vLLM's column/row parallel linears):

* attention: the KV heads in contiguous, near-equal groups (3 KV heads on 2 ranks: 2 + 1), each rank with
  the query heads that read them; q/k/v rows (and biases) of those heads (column parallel), the matching
  columns of o_proj (row parallel) with an all-reduce of its output; each rank's KV cache holds only its heads
  (the pool is sized per rank). A size above the number of KV heads is a ValueError: heads are split, never
  replicated.
* MLP: gate and up rows of a contiguous slice of the intermediate dims, the same columns of down_proj, then an
  all-reduce.
* embedding, norms and the LM head replicated (the head runs on rank 0 only).

The C++ decode stack runs every layer in one call, with no place for the all-reduces: under TP the layers run
one by one. Worker processes start with ``torch.multiprocessing`` (spawn), exit with the driver (daemonic) or
on an empty broadcast; a worker that dies is found before the next step (a RuntimeError naming it), and a
collective with a dead peer fails after ``timeout_s`` instead of hanging.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
from datetime import timedelta
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tokenmill.model.llama import Linear, LlamaForCausalLM


class AllReduce(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the ranks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.inner(x))

    @staticmethod
    def reduce(out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out)
        return out


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share [start, end) of ``n`` items, near-equal (the first ranks one more)."""
    bounds = [0, *accumulate(n // world + (1 if r < n % world else 0) for r in range(world))]
    return bounds[rank], bounds[rank + 1]


def check_size(num_kv_heads: int, world: int) -> None:
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {world}")
    if world > num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {world} exceeds the model's {num_kv_heads} KV heads: tokenmill splits KV "
            "heads across ranks and does not replicate them"
        )


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return layer


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, rank: int, world: int) -> Any:
    """Keep this rank's share of every layer of a dense (fp32 ``Linear``) model, in place; returns the config
    with this rank's KV heads (for its cache)."""
    config = model.config
    check_size(config.num_key_value_heads, world)
    d, group = config.head_dim, config.num_queries_per_kv
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    k0, k1 = split(hkv, world, rank)
    q0, q1 = k0 * group, k1 * group
    i0, i1 = split(config.intermediate_size, world, rank)
    inter = config.intermediate_size
    rows_qkv = torch.cat(
        [
            torch.arange(q0 * d, q1 * d),
            hq * d + torch.arange(k0 * d, k1 * d),
            (hq + hkv) * d + torch.arange(k0 * d, k1 * d),
        ]
    )
    rows_gate_up = torch.cat([torch.arange(i0, i1), inter + torch.arange(i0, i1)])
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not isinstance(proj, Linear):
                raise ValueError("tensor parallelism splits dense weights: load with quantization='fp32'")
        qkv = attn.qkv_proj
        attn.qkv_proj = _linear(qkv.weight[rows_qkv], None if qkv.bias is None else qkv.bias[rows_qkv])
        o = attn.o_proj
        o_bias = o.bias if o.bias is not None and rank == 0 else None  # added once, before the sum
        attn.o_proj = AllReduce(_linear(o.weight[:, q0 * d : q1 * d], o_bias))
        attn.num_heads, attn.num_kv_heads = q1 - q0, k1 - k0
        gate_up = mlp.gate_up_proj
        mlp.gate_up_proj = _linear(gate_up.weight[rows_gate_up], None)
        mlp.down_proj = AllReduce(_linear(mlp.down_proj.weight[:, i0:i1], None))
    return dataclasses.replace(config, num_key_value_heads=k1 - k0, num_attention_heads=q1 - q0)


def lora_shard(config: Any, rank: int, world: int) -> tuple[dict[str, list[tuple[str, int, int]]], Any]:
    """This rank's LoRA projection shapes, and the function that cuts an adapter (``model/lora.py``: stacked A,
    block-diagonal B) to them as :func:`shard_model` cuts the weights: the column-parallel projections (qkv,
    gate_up) keep their rows of B, the row-parallel ones (o, down) their columns of A, whose delta joins the
    projection's sum over the ranks (``llama.project``)."""
    from tokenmill.model.lora import part_shapes

    d, group, h = config.head_dim, config.num_queries_per_kv, config.hidden_size
    k0, k1 = split(config.num_key_value_heads, world, rank)
    q0, q1 = k0 * group, k1 * group
    i0, i1 = split(config.intermediate_size, world, rank)
    rows = {
        "qkv_proj": [(q0 * d, q1 * d), (k0 * d, k1 * d), (k0 * d, k1 * d)],
        "gate_up_proj": [(i0, i1)] * 2,
    }
    cols = {"o_proj": (q0 * d, q1 * d), "down_proj": (i0, i1)}
    full = part_shapes(config)
    shapes = {fused: [(n, b - a, k) for (n, _, k), (a, b) in zip(full[fused], r, strict=True)]
              for fused, r in rows.items()}  # fmt: skip
    shapes.update({fused: [(fused, h, b - a)] for fused, (a, b) in cols.items()})

    def cut(adapter: Any) -> Any:
        weights = {}
        for (layer, fused), (a, b) in adapter.weights.items():
            if fused in rows:
                starts = accumulate((p[1] for p in full[fused]), initial=0)
                index = torch.cat([torch.arange(s + lo, s + hi) for s, (lo, hi) in zip(starts, rows[fused])])
                weights[(layer, fused)] = (a, b[index].contiguous())
            else:
                lo, hi = cols[fused]
                weights[(layer, fused)] = (a[:, lo:hi].contiguous(), b)
        return dataclasses.replace(adapter, weights=weights)

    return shapes, cut


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prepare(loaded: Any, rank: int, world: int) -> Any:
    """Shard a loaded model and prepare its backend again, without the decode stack (the all-reduces sit between
    layers)."""
    from tokenmill.model.backends import select_backend

    local_config = shard_model(loaded.model, rank, world)
    select_backend(loaded.device, loaded.dtype, local_config.head_dim, decode_stack=False).prepare(
        loaded.model
    )
    return local_config


def _backend_and_device(load_kwargs: dict[str, Any], rank: int) -> tuple[str, dict[str, Any]]:
    """gloo on CPU; NCCL on CUDA with one device per rank (``cuda:<rank>``)."""
    device = str(load_kwargs.get("device") or "auto")
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(rank)
        return "nccl", {**load_kwargs, "device": f"cuda:{rank}"}
    return "gloo", load_kwargs


def _worker_main(rank: int, world: int, init_method: str, load_kwargs: dict[str, Any], num_blocks: int,
                 block_size: int, num_threads: int, timeout_s: float, kv_dtype: str,
                 lora_options: tuple[int, int, int | None] | None = None) -> None:  # fmt: skip
    from tokenmill.model.loader import allocate_kv_cache, load_model
    from tokenmill.worker.forward import forward_rows
    from tokenmill.worker.lora_manager import LoRAManager

    torch.set_num_threads(num_threads)
    backend, load_kwargs = _backend_and_device(load_kwargs, rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))  # fmt: skip
    loaded = load_model(**load_kwargs)
    local_config = _prepare(loaded, rank, world)
    kv = allocate_kv_cache(local_config, num_blocks, block_size, getattr(torch, kv_dtype), loaded.device)
    loras = None
    if lora_options is not None:
        loras = LoRAManager(
            loaded.config, *lora_options, device=loaded.device, shard=lora_shard(loaded.config, rank, world)
        )
    dist.barrier()  # loaded: the driver may start
    with torch.inference_mode():
        for step in itertools.count(1):
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            rows, requests = box[0]
            step_lora = None
            if loras is not None:
                for request in requests.values():
                    loras.add(request)
                step_lora = loras.step(rows, step)
            forward_rows(loaded.model, rows, kv, block_size, loaded.device, step_lora)
    dist.destroy_process_group()


class TensorParallelGroup:
    """The driver's side: starts ``world - 1`` workers, shards its own model as rank 0, broadcasts each step."""

    def __init__(self, loaded: Any, load_kwargs: dict[str, Any], world: int, num_blocks: int, block_size: int,
                 timeout_s: float = 30.0, kv_dtype: torch.dtype | None = None,
                 lora_options: tuple[int, int, int | None] | None = None) -> None:  # fmt: skip
        """``lora_options``: (max_loras, max_lora_rank, max_cpu_loras) when LoRA adapters are served."""
        check_size(loaded.config.num_key_value_heads, world)
        if loaded.device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(
                f"tensor_parallel_size {world} needs {world} CUDA devices, found {torch.cuda.device_count()}"
            )
        if loaded.device.type == "cuda" and loaded.device.index not in (None, 0):
            raise ValueError("under tensor parallelism rank 0 runs on cuda:0")
        self.world = world
        num_threads = max(1, torch.get_num_threads() // world)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: the loopback (workers inherit it)
        ctx = torch.multiprocessing.get_context("spawn")
        self.workers = [
            ctx.Process(
                target=_worker_main,
                args=(
                    r,
                    world,
                    init_method,
                    load_kwargs,
                    num_blocks,
                    block_size,
                    num_threads,
                    timeout_s,
                    str(kv_dtype or loaded.dtype).removeprefix("torch."),
                    lora_options,
                ),
                daemon=True,
                name=f"tokenmill-tp{r}",
            )
            for r in range(1, world)
        ]
        for w in self.workers:
            w.start()
        torch.set_num_threads(num_threads)
        backend, _ = _backend_and_device({"device": str(loaded.device)}, 0)
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=world,
                                timeout=timedelta(seconds=timeout_s))  # fmt: skip
        self.local_config = _prepare(loaded, 0, world)
        dist.barrier()
        self._closed = False

    def check_alive(self) -> None:
        for rank, w in enumerate(self.workers, start=1):
            if not w.is_alive():
                raise RuntimeError(f"tensor-parallel worker {rank} died (exit code {w.exitcode})")

    def broadcast(self, rows: list[Any], loras: dict[int, Any] | None = None) -> None:
        """A step's scheduled rows (``ScheduledRow``: plain data), and the LoRA adapters they use (``LoRARequest``
        by id), to every worker."""
        self.check_alive()
        dist.broadcast_object_list([(rows, loras or {})], src=0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if all(w.is_alive() for w in self.workers):
                dist.broadcast_object_list([None], src=0)
        finally:
            for w in self.workers:
                w.join(timeout=5)
                if w.is_alive():
                    w.kill()
            if dist.is_initialized():
                dist.destroy_process_group()
