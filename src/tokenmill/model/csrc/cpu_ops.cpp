// tokenmill's CPU kernels, one extension module (built on first use by tokenmill.model.cpu_kernels).
#include <torch/extension.h>

#include "attention_decode.h"
#include "attention_prefill.h"
#include "decode_stack.h"
#include "elementwise.h"
#include "panel_linear.h"
#include "small_linear.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged attention of one query per row (CPU, fp32)", pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
        pybind11::arg("scale"), pybind11::arg("table_index") = pybind11::none());
  m.def("paged_prefill_", &paged_prefill_, "causal attention of prefill tokens in tiles, into out (CPU, fp32)");
  m.def("paged_prefill_supported", &paged_prefill_supported, "whether paged_prefill_ takes this head size");
  m.def("small_linear", &small_linear, "x [M, K] @ W [N, K]^T * scale (CPU; W int8, scale [N] fp32)");
  m.def("pack_panels", &pack_panels, "fp32 weight [N, K] -> column panels [ceil(N/32), K, 32] for panel_linear");
  m.def("panel_linear", &panel_linear, "x [M, K] @ W^T with W as panels [P, K, 32]; N output features (CPU)");
  m.def("panel_linear_available", &panel_linear_available, "whether panel_linear was compiled (AVX-512)");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, H] rows");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += delta, then RMSNorm of residual");
  m.def("silu_mul", &silu_mul, "[T, 2I] gate | up -> silu(gate) * up [T, I]");
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q/k of a fused qkv, K/V into the paged cache; returns q");
  m.def("has_avx512", &has_avx512, "whether the AVX-512 kernels were compiled (else portable loops)");
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t,
                          double>())
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward);
}
