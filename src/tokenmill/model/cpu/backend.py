"""The CPU kernel backend: float32 on CPU with tokenmill's C++ kernels (``kernels.py`` loads them).

It packs every fp32 projection once (``packing.py``), gives int8 and GGUF-block projections their kernels, builds
the C++ decode stack (every layer of a decode-only step in one call), and plans each step's attention for the
kernels that read the paged cache in place:

* decode rows (one new token each): ``paged_decode``, one query per row;
* prefills: ``paged_prefill_`` in tiles when the head size is a multiple of the panel width; else the tokens of
  prefills up to :data:`KERNEL_PREFILL_MAX_LEN` go through ``paged_decode`` one query per row (each over its
  causal prefix) and longer ones through torch's chunked matmuls, whose work grows better with length
  (benchmarks/README.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.model.attention import AttentionMetadata, KVCache, PrefillSeq, plan_prefill
from tokenmill.model.backend import TorchBackend, attend_prefills
from tokenmill.model.cpu import kernels
from tokenmill.model.cpu.packing import attach_cpu_kernels, build_decode_stack, can_pack, pack_for_cpu

if TYPE_CHECKING:
    from tokenmill.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)
KERNEL_PREFILL_MAX_LEN = 512


@dataclass
class DecodeRows:
    """Rows of one query token each, for ``paged_decode``: the decode rows, or every token of the short
    prefills, each over its own causal prefix."""

    token_rows: torch.Tensor  # [n] int64: flat batch rows
    block_tables: torch.Tensor  # [num_tables, max_num_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [n] int64: keys each row sees
    # [n] int64: which block table each row reads (None: row i reads table i)
    table_index: torch.Tensor | None = None


@dataclass
class KernelPlan:
    """A step's attention for the C++ kernels, read in place from the paged cache (see the module docstring)."""

    decode_rows: DecodeRows | None  # every decode row
    # every prefill for the tiled kernel: [n, 4] int64 (first flat row, query tokens, position of the first,
    # block table row); None without one (no prefill, or a head size the tiled kernel does not take)
    prefill_seqs: torch.Tensor | None
    prefill_rows: DecodeRows | None  # without the tiled kernel: the short prefills' tokens
    prefills: list[PrefillSeq]  # without the tiled kernel: the long prefills, through chunked matmuls
    decode: Any  # the kernels' paged_decode
    tiled: Any  # the kernels' paged_prefill_, or None

    @property
    def decode_only(self) -> bool:
        """Every row decodes one token: the step the decode stack can take whole."""
        return (
            self.decode_rows is not None
            and self.prefill_seqs is None
            and self.prefill_rows is None
            and not self.prefills
        )

    def attend(
        self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
        k_cache, v_cache = kv_cache
        if self.prefill_seqs is not None:  # a tile's query tokens share the keys and values they read
            self.tiled(out, q.contiguous(), k_cache, v_cache, meta.block_tables, self.prefill_seqs, scale)
        for rows in (self.decode_rows, self.prefill_rows):
            if rows is not None:
                q_rows = q.index_select(0, rows.token_rows)  # [n, Hq, D], contiguous
                attended = self.decode(
                    q_rows, k_cache, v_cache, rows.block_tables, rows.seq_lens, scale, rows.table_index
                )
                out.index_copy_(0, rows.token_rows, attended)
        attend_prefills(out, q, kv_cache, self.prefills, scale, use_sdpa=False)
        return out


class CpuKernelBackend(TorchBackend):
    """float32 on CPU with the C++ kernels (chosen by :func:`tokenmill.model.backend.select_backend`)."""

    def __init__(self, head_dim: int, *, decode_stack: bool = True, tiled_prefill: bool = True) -> None:
        """``tiled_prefill=False`` plans prefills without the tiled kernel (to compare the two)."""
        super().__init__("cpu")
        state = kernels.loaded()
        if state.module is None:
            raise ValueError(f"the CPU kernel backend needs the C++ kernels ({state.reason})")
        self.name = f"cpu-kernels-{state.variant}"
        self.ops = state.module
        self._decode = kernels.paged_decode_kernel()
        self._tiled = kernels.paged_prefill_kernel(head_dim) if tiled_prefill else None
        self._want_stack = decode_stack
        self.decode_stack = None  # the C++ DecodeStack over the model's weights, once prepared
        self._window: int | None = None

    def prepare(self, model: LlamaForCausalLM) -> None:
        """Pack the fp32 projections, attach the int8 / GGUF kernels, build the decode stack."""
        if can_pack(self.device, model.model.norm.weight.dtype):  # TOKENMILL_NO_PACK=1 leaves it out
            pack_for_cpu(model)
        attach_cpu_kernels(model)
        self.decode_stack = build_decode_stack(model) if self._want_stack else None
        config = model.config
        windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
        self._window = min((w for w in windows if w is not None), default=None)
        model.backend = self
        self._log_slow_paths(model)

    def plan(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
    ) -> AttentionMetadata:
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, block_size, "cpu")
        meta.ops = self.ops
        start = meta.query_start_loc
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        prefill = [i for i, n in enumerate(query_lens) if n > 1]
        decode_rows = None
        if decode:
            decode_rows = DecodeRows(
                token_rows=torch.tensor([start[i] for i in decode], dtype=torch.int64),
                block_tables=meta.block_tables[decode],
                seq_lens=torch.tensor([seq_lens[i] for i in decode], dtype=torch.int64),
            )
        tiled_seqs, short_rows, long_prefills = None, None, []
        if prefill and self._tiled is not None:
            tiled_seqs = torch.tensor(
                [[start[i], query_lens[i], seq_lens[i] - query_lens[i], i] for i in prefill],
                dtype=torch.int64,
            )
        elif prefill:
            short = [i for i in prefill if seq_lens[i] <= KERNEL_PREFILL_MAX_LEN]
            if short:
                short_rows = _prefill_token_rows(short, query_lens, seq_lens, start, meta.block_tables)
            tables = meta.host_block_tables
            long_prefills = [plan_prefill(i, meta, tables[i], "cpu") for i in prefill if i not in short]
        meta.plan = KernelPlan(decode_rows, tiled_seqs, short_rows, long_prefills, self._decode, self._tiled)
        return meta

    def fused_step(self, meta: AttentionMetadata) -> Callable[..., torch.Tensor] | None:
        """A decode-only step goes through the C++ decode stack (when every sequence is within the sliding window,
        if any: the stack attends to all keys)."""
        plan = meta.plan
        if self.decode_stack is None or not isinstance(plan, KernelPlan) or not plan.decode_only:
            return None
        if self._window is not None and max(meta.seq_lens) > self._window:
            return None
        if meta.lora is not None and getattr(meta.lora, "kernel", None) is None:
            return None  # adapters without the C++ kernels: layer by layer
        return self._decode_stack_step

    def _decode_stack_step(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        rows = meta.plan.decode_rows  # type: ignore[union-attr]
        cos, sin = rope
        args = (
            x,
            cos.view(x.shape[0], -1),  # [T, R/2]
            sin.view(x.shape[0], -1),
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            meta.slot_mapping,
            rows.block_tables,
            rows.seq_lens,
        )
        if meta.lora is not None:  # each row's adapter added after every projection, in the stack
            lora = meta.lora
            return self.decode_stack.forward_lora(*args, lora.slots.stack_weights(), lora.index)  # type: ignore[no-any-return]
        return self.decode_stack.forward(*args)  # type: ignore[no-any-return]

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "attention": "paged_decode + "
            + ("tiled paged_prefill" if self._tiled else "per-row / chunked prefill"),
            "decode_stack": self.decode_stack is not None,
        }

    def _log_slow_paths(self, model: LlamaForCausalLM) -> None:
        """Say once, at load, which of this model's shapes leave a fast path, and what runs instead."""
        config, state = model.config, kernels.loaded()
        if self._tiled is None:
            logger.info(
                "head_dim %d: no tiled prefill attention on the %s kernels (needs a multiple of %d); prefills run "
                "one query per row up to %d tokens, chunked matmuls beyond",
                config.head_dim, state.variant, self.ops.panel_width(), KERNEL_PREFILL_MAX_LEN,
            )  # fmt: skip
        if self.decode_stack is None and self._want_stack and state.variant != "base":
            logger.info("no C++ decode stack for this model: decode steps run layer by layer")
        if config.has_sliding_window:
            logger.info(
                "sliding window of %d tokens: a step with a sequence past it attends through the windowed torch "
                "path", config.sliding_window,
            )  # fmt: skip


def _prefill_token_rows(
    seqs: list[int], query_lens: list[int], seq_lens: list[int], start: list[int], block_tables: torch.Tensor
) -> DecodeRows:
    """Every token of ``seqs`` as a row of one query over its causal prefix."""
    rows, lens, tables = [], [], []
    for i in seqs:
        first_pos = seq_lens[i] - query_lens[i]
        rows.extend(range(start[i], start[i + 1]))
        lens.extend(range(first_pos + 1, seq_lens[i] + 1))  # token at position p sees p + 1 keys
        tables.extend([i] * query_lens[i])
    return DecodeRows(
        token_rows=torch.tensor(rows, dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=torch.tensor(lens, dtype=torch.int64),
        table_index=torch.tensor(tables, dtype=torch.int64),
    )
