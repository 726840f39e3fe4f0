// tokenmill's CPU kernels, one extension module per instruction-set variant: setup.py compiles this file as
// tokenmill._C_avx512, _C_avx2 and _C_base with each variant's flags (simd.h says what each covers), and
// tokenmill.model.cpu.kernels loads the best one the CPU runs.
#include <torch/extension.h>

#include "attention_decode.h"
#include "attention_prefill.h"
#include "decode_stack.h"
#include "elementwise.h"
#include "lora.h"
#include "panel_linear.h"
#include "peak_probe.h"
#include "quant_linear.h"
#include "small_linear.h"

#ifndef TOKENMILL_SOURCE_DIGEST
#define TOKENMILL_SOURCE_DIGEST "unknown"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged attention of one query per row (CPU, fp32)", pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
        pybind11::arg("scale"), pybind11::arg("table_index") = pybind11::none());
  m.def("paged_prefill_", &paged_prefill_, "causal attention of prefill tokens in tiles, into out (CPU, fp32)");
  m.def("paged_prefill_supported", &paged_prefill_supported, "whether paged_prefill_ takes this head size");
  m.def("small_linear", &small_linear, "x [M, K] @ W [N, K]^T * scale (CPU; W int8, scale [N] fp32)");
  m.def("pack_panels", &pack_panels, "fp32 weight [N, K] -> column panels [ceil(N/W), K, W] for panel_linear");
  m.def("panel_linear", &panel_linear, "x [M, K] @ W^T with W as panels [P, K, W]; N output features (CPU)");
  m.def("panel_width", &panel_width, "output columns per panel of pack_panels (two vectors)");
  m.def("quant_linear", &quant_linear, "x [M, K] @ W^T, W in GGUF-derived blocks (data uint8, meta int64 [P, 9])",
        pybind11::arg("x"), pybind11::arg("data"), pybind11::arg("meta"), pybind11::arg("expand_once_bytes") = -1);
  m.def("quant_linear_silu", &quant_linear_silu, "(silu(gate) * up) @ W^T of gate_up [M, 2K] (gate | up), W as quant_linear's");
  m.def("quant_tile_rows", &quant_tile_rows, "output rows per tile of the quantized layout (the panel width)");
  m.def("quant_rows", &quant_rows, "rows ids of a quantized W as fp32 [n, K] (embedding lookup)");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, H] rows");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += delta, then RMSNorm of residual");
  m.def("silu_mul", &silu_mul, "[T, 2I] gate | up -> silu(gate) * up [T, I]");
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q/k of a fused qkv, K/V into the paged cache; returns q");
  m.def("qk_norm_", &qk_norm_, "RMSNorm of every q and k head of a fused qkv, in place (Qwen3)");
  m.def("lora_add_", &lora_add_, "out[t] += B_s(A_s x[t]) with s row t's LoRA slot (-1: none), in place (CPU, fp32)");
  m.def("qdot_peak", &tokenmill_peak::qdot_peak, "the integer dot product in registers: iters x kAccs calls per thread");
  m.def("qdot_peak_ops_per_iter", &tokenmill_peak::qdot_peak_ops_per_iter, "integer operations of one round");
  m.def("dot_fma_mix", &tokenmill_peak::dot_fma_mix,
        "rounds of dot products with (or without) fp32 multiply-adds beside them: dot_fma_mix_counts() of each");
  m.def("dot_fma_mix_counts", &tokenmill_peak::dot_fma_mix_counts, "[dot products, multiply-adds] of one round");
  m.def("fma_peak", &tokenmill_peak::fma_peak, "the fp32 multiply-add in registers: iters x kAccs calls per thread");
  m.def("fma_peak_flops_per_iter", &tokenmill_peak::fma_peak_flops_per_iter, "flops of one round");
  m.def("isa", [] { return std::string(simd::kIsa); }, "the instruction-set variant compiled: avx512, avxvnni, avx2, base");
  m.def("source_digest", [] { return std::string(TOKENMILL_SOURCE_DIGEST); }, "sha256 prefix of csrc/ at build");
  // module_local: each variant module registers its own DecodeStack type
  pybind11::class_<DecodeStack>(m, "DecodeStack", pybind11::module_local())
      .def(pybind11::init<std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t,
                          double>())
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward)
      .def("forward_lora", &DecodeStack::forward_lora);
}
