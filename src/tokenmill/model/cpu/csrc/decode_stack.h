// The whole decoder stack for a step of a few decode rows (one new token each), in one call.
//
// At batch 1 the model reads ~540 MB of fp32 weights per token (~20 ms here), but the eager forward issues
// ~2,000 small torch ops per step (norms, rope, splits, residual adds: ~13 ms of dispatch on this CPU). This
// runs the same arithmetic as LlamaDecoderLayer.forward with no per-op dispatch: RMSNorm -> fused QKV ->
// RoPE -> K/V into the paged cache -> attention -> o_proj + residual -> RMSNorm -> gate/up -> SiLU * up ->
// down + residual, for every layer, then the final norm. The matmuls are panel_linear's (fp32), small_linear's
// (int8) or quant_linear's (GGUF blocks); only they and the attention run on more than one thread.
#pragma once
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "attention_decode.h"
#include "elementwise.h"
#include "lora.h"
#include "panel_linear.h"
#include "quant_linear.h"
#include "small_linear.h"

namespace {

struct LinearWeight {
  torch::Tensor weight;  // fp32 panels [N / kPanel, K, kPanel] (panel_linear.h), int8 [N, K], or quantized bytes
  torch::Tensor scale;   // [N] fp32 for int8, int64 meta [P, 9] for quantized (quant_linear.h), else undefined
  QuantMatrix quant;     // parsed from weight and scale when quantized
  bool quantized() const { return weight.scalar_type() == torch::kUInt8; }
  bool panels() const { return weight.dim() == 3; }
  int64_t out_features() const {
    return quantized() ? quant.n : panels() ? weight.size(0) * kPanel : weight.size(0);
  }
  int64_t in_features() const { return quantized() ? quant.k : weight.size(1); }
  void apply(const float* x, int64_t M, float* y) const {
    if (quantized())
      quant_linear_raw(x, M, quant, y);
    else if (panels())
      panel_linear_raw(x, M, in_features(), weight.data_ptr<float>(), out_features(), y);
    else
      small_linear_raw(x, M, in_features(), weight.data_ptr<int8_t>(), scale.data_ptr<float>(), y, weight.size(0));
  }
};

struct DecoderLayerWeights {
  torch::Tensor input_norm, post_norm;  // [H] fp32
  LinearWeight qkv, o, gate_up, down;
  torch::Tensor qkv_bias, q_norm, k_norm;  // [(Hq + 2 Hkv) D], [D], [D] fp32; undefined when the family has none
};

}  // namespace

class DecodeStack {
 public:
  static constexpr size_t kTensorsPerLayer = 13;
  // Per layer, in order: input_norm, post_norm, then (weight, scale) for qkv, o, gate_up, down (a scale is an
  // empty tensor for an fp32 weight, the int64 meta for a quantized one), then qkv_bias, q_norm, k_norm (empty
  // tensors where the family has none). final_norm [H]; inv_freq [R/2] fp32 for R rotated dims of a head.
  DecodeStack(std::vector<torch::Tensor> tensors, torch::Tensor final_norm, torch::Tensor inv_freq,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
      : final_norm_(final_norm.contiguous()),
        inv_freq_(inv_freq.contiguous()),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(static_cast<float>(eps)) {
    TORCH_CHECK(tensors.size() % kTensorsPerLayer == 0, kTensorsPerLayer, " tensors per layer");
    TORCH_CHECK(inv_freq_.scalar_type() == torch::kFloat32 && 0 < inv_freq_.numel() &&
                    2 * inv_freq_.numel() <= head_dim,
                "inv_freq: float32 [R/2], R <= head_dim");
    hidden_ = final_norm_.numel();
    auto lin = [](torch::Tensor w, torch::Tensor s) {
      LinearWeight l{w.contiguous(), s.numel() > 0 ? s.contiguous() : torch::Tensor()};
      if (l.quantized()) {
        TORCH_CHECK(l.scale.defined(), "a quantized weight needs its meta");
        l.quant = parse_quant_matrix(l.weight, l.scale);
        return l;
      }
      TORCH_CHECK((l.weight.scalar_type() == torch::kFloat32 && l.weight.dim() == 3 && l.weight.size(2) == kPanel &&
                   !l.scale.defined()) ||
                      (l.weight.scalar_type() == torch::kInt8 && l.weight.dim() == 2 && l.scale.defined() &&
                       l.scale.scalar_type() == torch::kFloat32 && l.scale.numel() == l.weight.size(0)),
                  "weights are fp32 panels [N / kPanel, K, kPanel], int8 [N, K] with fp32 scales [N], or "
                  "quantized bytes with their int64 meta");
      return l;
    };
    auto optional = [](const torch::Tensor& t, int64_t n, const char* name) {
      if (t.numel() == 0) return torch::Tensor();
      TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.numel() == n, name, ": float32 [", n, "]");
      return t.contiguous();
    };
    for (size_t i = 0; i < tensors.size(); i += kTensorsPerLayer) {
      const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
      DecoderLayerWeights L{tensors[i].contiguous(),
                            tensors[i + 1].contiguous(),
                            lin(tensors[i + 2], tensors[i + 3]),
                            lin(tensors[i + 4], tensors[i + 5]),
                            lin(tensors[i + 6], tensors[i + 7]),
                            lin(tensors[i + 8], tensors[i + 9]),
                            optional(tensors[i + 10], q_size + 2 * kv_size, "qkv_bias"),
                            optional(tensors[i + 11], head_dim, "q_norm"),
                            optional(tensors[i + 12], head_dim, "k_norm")};
      TORCH_CHECK(L.q_norm.defined() == L.k_norm.defined(), "q_norm and k_norm come together");
      TORCH_CHECK(L.qkv.out_features() == q_size + 2 * kv_size && L.qkv.in_features() == hidden_, "qkv shape");
      TORCH_CHECK(L.o.out_features() == hidden_ && L.o.in_features() == q_size, "o_proj shape");
      TORCH_CHECK(L.gate_up.in_features() == hidden_ && L.gate_up.out_features() % 2 == 0, "gate_up shape");
      TORCH_CHECK(L.down.out_features() == hidden_ && L.down.in_features() * 2 == L.gate_up.out_features(),
                  "down shape");
      layers_.push_back(std::move(L));
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [M, H] embeddings (fp32) of M decode tokens; cos/sin [M, R/2] their rotation (the eager forward's own
  // tensors: computed once, by torch, for both paths, so a token's K and V do not depend on the path that made
  // them); k/v_caches one per layer; slot_mapping [M]; block_tables [M, max_blocks]; seq_lens [M] (context after
  // this token). Writes each layer's new K/V, returns the final-normed hidden states [M, H].
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> k_caches,
                        std::vector<torch::Tensor> v_caches, torch::Tensor slot_mapping, torch::Tensor block_tables,
                        torch::Tensor seq_lens) const {
    return forward_lora(x, cos, sin, k_caches, v_caches, slot_mapping, block_tables, seq_lens, {}, torch::Tensor());
  }

  // forward, each row's LoRA delta added after every projection (csrc/lora.h): lora_weights per layer (a, b) of
  // qkv, o, gate_up, down (a [S * P * R, in], b [S, R, out] fp32, model/lora.py's slots), lora_slots [M] int64
  // (-1: none); an empty lora_weights: no adapters.
  torch::Tensor forward_lora(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> k_caches,
                             std::vector<torch::Tensor> v_caches, torch::Tensor slot_mapping,
                             torch::Tensor block_tables, torch::Tensor seq_lens,
                             std::vector<torch::Tensor> lora_weights, torch::Tensor lora_slots) const {
    const int64_t M = x.size(0), H = hidden_, D = head_dim_, Hq = num_heads_, Hkv = num_kv_heads_;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == H && x.scalar_type() == torch::kFloat32, "x: fp32 [M, hidden]");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers() &&
                    static_cast<int64_t>(v_caches.size()) == num_layers(),
                "one K and one V cache per layer");
    const int64_t half = inv_freq_.numel(), R = 2 * half;
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.dim() == 2 &&
                    cos.size(0) == M && cos.size(1) == half && sin.sizes() == cos.sizes(),
                "cos/sin: float32 [M, R/2]");
    TORCH_CHECK(slot_mapping.numel() == M && seq_lens.numel() == M && block_tables.dim() == 2 &&
                    block_tables.size(0) == M,
                "one slot, table and length per row");
    TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && block_tables.scalar_type() == torch::kInt64 &&
                    seq_lens.scalar_type() == torch::kInt64,
                "int64 indices");
    auto cos_t = cos.contiguous(), sin_t = sin.contiguous();
    auto slots_t = slot_mapping.contiguous();
    auto tables_t = block_tables.contiguous();
    auto lens_t = seq_lens.contiguous();
    const int64_t* slots = slots_t.data_ptr<int64_t>();
    const int64_t* lens = lens_t.data_ptr<int64_t>();
    const int64_t max_blocks = tables_t.size(1);
    TORCH_CHECK(num_layers() > 0 && k_caches[0].dim() == 4, "KV caches: [num_blocks, block_size, Hkv, D]");
    const int64_t num_blocks = k_caches[0].size(0), block_size = k_caches[0].size(1);
    const int64_t* tables = tables_t.data_ptr<int64_t>();
    for (int64_t i = 0; i < tables_t.numel(); ++i)
      TORCH_CHECK(tables[i] >= 0 && tables[i] < num_blocks, "block id out of range");
    for (int64_t m = 0; m < M; ++m)
      TORCH_CHECK(lens[m] > 0 && lens[m] <= max_blocks * block_size, "seq_len out of range");

    const float* cos_p = cos_t.data_ptr<float>();
    const float* sin_p = sin_t.data_ptr<float>();

    const int64_t q_size = Hq * D, kv_size = Hkv * D, qkv_size = q_size + 2 * kv_size;
    const bool lora = !lora_weights.empty();
    std::vector<LoraBlock> lora_rows;
    int64_t lora_rank = 0;
    if (lora) {
      TORCH_CHECK(static_cast<int64_t>(lora_weights.size()) == 8 * num_layers(), "lora_weights: 8 per layer");
      for (const auto& t : lora_weights)
        TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && !t.is_cuda(), "lora_weights: fp32");
      TORCH_CHECK(lora_slots.defined() && lora_slots.scalar_type() == torch::kInt64 && lora_slots.numel() == M &&
                      lora_slots.is_contiguous(),
                  "lora_slots: int64 [M]");
      lora_rank = lora_weights[1].size(1);
      lora_rows = lora_blocks(lora_slots.data_ptr<int64_t>(), M, lora_weights[1].size(0));
    }
    // out [M, N] += the rows' adapter deltas of projection p (0 qkv, 1 o, 2 gate_up, 3 down) of layer l; called
    // only with adapters (a step without them builds no part list)
    auto add_lora = [&](int64_t l, int p, const float* in, int64_t K, float* out, const std::vector<int64_t>& parts) {
      const torch::Tensor& a = lora_weights[8 * l + 2 * p];
      const torch::Tensor& b = lora_weights[8 * l + 2 * p + 1];
      const int64_t N = parts.back(), P = static_cast<int64_t>(parts.size()) - 1;
      TORCH_CHECK(a.dim() == 2 && a.size(1) == K && b.dim() == 3 && b.size(1) == lora_rank && b.size(2) == N &&
                      a.size(0) == b.size(0) * P * lora_rank,
                  "lora_weights of layer ", l, " projection ", p, ": a [S * P * R, in], b [S, R, out]");
      lora_add_raw(in, K, out, N, a.data_ptr<float>(), b.data_ptr<float>(), lora_rank, parts, lora_rows);
    };
    int64_t max_inter = 0;
    for (const auto& L : layers_) max_inter = std::max(max_inter, L.down.in_features());
    auto residual = x.contiguous().clone();  // [M, H], updated in place layer by layer
    float* h = residual.data_ptr<float>();
    std::vector<float> normed(M * H), qkv(M * qkv_size), q_rows(M * q_size), attn(M * q_size), proj(M * H),
        gate_up(M * 2 * max_inter), act(M * max_inter);

    for (int64_t l = 0; l < num_layers(); ++l) {
      const DecoderLayerWeights& L = layers_[l];
      const torch::Tensor& kc = k_caches[l];
      const torch::Tensor& vc = v_caches[l];
      TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == k_caches[0].scalar_type() &&
                      vc.scalar_type() == kc.scalar_type() && kc.dim() == 4 && kc.size(0) == num_blocks &&
                      kc.size(1) == block_size && kc.size(2) == Hkv && kv_head_dim(kc) == D && vc.sizes() == kc.sizes(),
                  "KV caches: contiguous [num_blocks, block_size, Hkv, row] of one dtype, the same for every layer");
      const int64_t num_slots = kc.size(0) * kc.size(1);

      for (int64_t m = 0; m < M; ++m)
        rms_norm_row(h + m * H, L.input_norm.data_ptr<float>(), H, eps_, normed.data() + m * H);
      L.qkv.apply(normed.data(), M, qkv.data());  // [M, q | k | v]
      if (lora) add_lora(l, 0, normed.data(), H, qkv.data(), {0, q_size, q_size + kv_size, qkv_size});
      for (int64_t m = 0; m < M; ++m) {
        float* row = qkv.data() + m * qkv_size;
        if (L.qkv_bias.defined()) {
          const float* b = L.qkv_bias.data_ptr<float>();
          for (int64_t i = 0; i < qkv_size; ++i) row[i] += b[i];
        }
        if (L.q_norm.defined()) {
          rms_norm_heads_(row, Hq, D, L.q_norm.data_ptr<float>(), eps_);
          rms_norm_heads_(row + q_size, Hkv, D, L.k_norm.data_ptr<float>(), eps_);
        }
        // q and k heads are adjacent: rotate them in place
        rope_heads(row, row, Hq + Hkv, D, R, cos_p + m * half, sin_p + m * half);
        TORCH_CHECK(slots[m] >= 0 && slots[m] < num_slots, "slot out of range");
        std::copy(row, row + q_size, q_rows.data() + m * q_size);
      }
      with_paged_cache(kc, vc, [&](const auto& cache) {
        for (int64_t m = 0; m < M; ++m) {  // K and V of each row into its slot, in the cache's dtype
          const float* row = qkv.data() + m * qkv_size;
          cache.write_token(slots[m], row + q_size, row + q_size + kv_size);
        }
        attend_rows(q_rows.data(), cache, tables, max_blocks, lens, M, Hq, 1.f / std::sqrt(static_cast<float>(D)),
                    attn.data());
      });
      L.o.apply(attn.data(), M, proj.data());
      if (lora) add_lora(l, 1, attn.data(), q_size, proj.data(), {0, H});
      for (int64_t i = 0; i < M * H; ++i) h[i] += proj[i];

      for (int64_t m = 0; m < M; ++m)
        rms_norm_row(h + m * H, L.post_norm.data_ptr<float>(), H, eps_, normed.data() + m * H);
      const int64_t I = L.down.in_features();
      L.gate_up.apply(normed.data(), M, gate_up.data());  // [M, gate | up]
      if (lora) add_lora(l, 2, normed.data(), H, gate_up.data(), {0, I, 2 * I});
      for (int64_t m = 0; m < M; ++m)
        silu_mul_row(gate_up.data() + m * 2 * I, gate_up.data() + m * 2 * I + I, I, act.data() + m * I);
      L.down.apply(act.data(), M, proj.data());
      if (lora) add_lora(l, 3, act.data(), I, proj.data(), {0, H});
      for (int64_t i = 0; i < M * H; ++i) h[i] += proj[i];
    }
    auto out = torch::empty_like(residual);
    for (int64_t m = 0; m < M; ++m)
      rms_norm_row(h + m * H, final_norm_.data_ptr<float>(), H, eps_, out.data_ptr<float>() + m * H);
    return out;
  }

 private:
  std::vector<DecoderLayerWeights> layers_;
  torch::Tensor final_norm_, inv_freq_;
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_ = 0;
  float eps_;
};
