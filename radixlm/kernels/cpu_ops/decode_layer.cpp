// A pre-norm decoder layer's decode step (Llama's block: RMSNorm, QKV, RoPE, paged attention,
// O, RMSNorm, gated SiLU MLP) in one call from Python. It calls the kernels of fused_ops.cpp,
// few_rows_matmul.cpp, blocked_matmul.cpp, pair_matmul.cpp and quantized_matmul.cpp (or
// torch's linear) in the
// order and on the operands the layer's modules give them, so its outputs equal theirs to
// the bit; what it leaves out is the Python between them (module calls, views, the
// attention backend's dispatch: a quarter of a batch-1 step of the default model,
// benchmarks/RESULTS.md). decode_layers runs a model's consecutive layers so in one call,
// leaving out the Python between the layers too. Their declarations are kernels.h's.

#include "common.h"
#include "kernels.h"

// fused_ops.ProjectionKernel's values, which the build passes (fused_ops._shared_constants).
#if !defined(RADIXLM_PROJECTION_PAIRS) || !defined(RADIXLM_PROJECTION_GGUF)
#error "build through fused_ops.py, which defines RADIXLM_PROJECTION_* from ProjectionKernel"
#endif

namespace radixlm_decode_layer {

struct LayerShape {
  int64_t tokens, heads, kv_heads, head_dim;
};

// How a projection is multiplied: fused_ops.ProjectionKernel's values.
enum ProjectionKernel : int64_t {
  kPairs = RADIXLM_PROJECTION_PAIRS,
  kInt8 = RADIXLM_PROJECTION_INT8,
  kDense = RADIXLM_PROJECTION_DENSE,
  kTorchLinear = RADIXLM_PROJECTION_TORCH_LINEAR,
  kInt8Pairs = RADIXLM_PROJECTION_INT8_PAIRS,
  kBlocked = RADIXLM_PROJECTION_BLOCKED,
  kInt8Blocked = RADIXLM_PROJECTION_INT8_BLOCKED,
  kGguf = RADIXLM_PROJECTION_GGUF,
};

// A pass's LoRA groups (lora_add's rows, starts, slots), or none (rows undefined).
struct LoraPass {
  at::Tensor rows, starts, slots;
};

// A projection's adapter weights (lora_add's a, b_t, scales, ranks, bounds), or none (a
// undefined or empty).
struct LoraWeights {
  at::Tensor a, b_t, scales, ranks, bounds;
};

// A projection's weight (and int8 scales, else an empty tensor; for GGUF blocks, the parts
// and their types) and the kernel that multiplies it, as the layer's Linear module would for
// this step's rows, then its adapters' terms for the pass's rows that use one (lora_add, as
// the module's LoraProjection adds them).
struct Projection {
  int64_t kernel;
  at::Tensor weight, scales;
  LoraWeights lora;
  std::vector<at::Tensor> parts;
  std::vector<int64_t> types;

  at::Tensor operator()(const at::Tensor& x, const LoraPass& pass) const {
    at::Tensor y = multiply(x);
    if (pass.rows.defined() && lora.a.defined() && lora.a.numel() > 0) {
      lora_add(x, y, pass.rows, pass.starts, pass.slots, lora.a, lora.b_t, lora.scales,
               lora.ranks, lora.bounds);
    }
    return y;
  }

  at::Tensor multiply(const at::Tensor& x) const {
    switch (kernel) {
      case kPairs: return pair_matmul(x, weight);
      case kInt8: return int8_matmul(x, weight, scales);
      case kDense: return dense_matmul(x, weight);
      case kTorchLinear: return at::linear(x, weight);
      case kInt8Pairs: return int8_pair_matmul(x, weight, scales);
      case kBlocked: return blocked_matmul(x, weight);
      case kInt8Blocked: return blocked_int8_matmul(x, weight, scales);
      case kGguf: return quantized_matmul_parts(x, parts, types);
    }
    TORCH_CHECK(false, "unknown projection kernel ", kernel);
  }
};

// q (T, H, D), k and v (T, H_kv, D) of the new tokens, as views of the QKV product, with RoPE
// applied to q and k.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotated_qkv(const at::Tensor& qkv_flat,
                                                           const at::Tensor& cos,
                                                           const at::Tensor& signed_sin,
                                                           const LayerShape& s) {
  const at::Tensor qkv = qkv_flat.view({s.tokens, s.heads + 2 * s.kv_heads, s.head_dim});
  const at::Tensor qk = rotary(qkv.slice(1, 0, s.heads + s.kv_heads), cos, signed_sin);
  return {qk.slice(1, 0, s.heads), qk.slice(1, s.heads), qkv.slice(1, s.heads + s.kv_heads)};
}

// One layer's decode step (see decode_layer for the operands), its projections given.
std::tuple<at::Tensor, at::Tensor> layer_step(
    const at::Tensor& x, const at::Tensor& residual, bool has_residual,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    const Projection (&projections)[4], const at::Tensor& cos, const at::Tensor& signed_sin,
    at::Tensor& k_buffer, at::Tensor& v_buffer, const at::Tensor& out_cache_loc,
    const at::Tensor& kv_slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    double scale, const LoraPass& lora) {
  TORCH_CHECK(x.dim() == 2 && k_buffer.dim() == 3, "x must be (T, hidden), k_buffer 3-D");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
              "heads must be a positive multiple of kv_heads");
  const auto& [qkv_proj, o_proj, gate_up_proj, down_proj] = projections;
  const LayerShape shape{x.size(0), heads, kv_heads, k_buffer.size(2)};
  at::Tensor h, stream;
  if (has_residual) {
    std::tie(h, stream) = add_rms_norm(x, residual, input_norm, eps);
  } else {
    h = rms_norm(x, input_norm, eps);
    stream = x;
  }
  auto [q, k, v] = rotated_qkv(qkv_proj(h, lora), cos, signed_sin, shape);
  scatter_rows(k_buffer, out_cache_loc, k);
  scatter_rows(v_buffer, out_cache_loc, v);
  const at::Tensor attended =
      paged_decode_attention(q, k_buffer, v_buffer, kv_slots, seq_lens, scale);
  const at::Tensor o = o_proj(attended.reshape({shape.tokens, -1}), lora);
  auto [h2, stream2] = add_rms_norm(o, stream, post_norm, eps);
  return {down_proj(silu_mul(gate_up_proj(h2, lora)), lora), stream2};
}

// Layer l's four projections from lists of four a layer (and five LoRA operands a
// projection, where lora_weights is not empty). A GGUF projection's scales are int64
// (parts, 2): each part's ggml type and its index in gguf_parts.
void layer_projections(const std::vector<int64_t>& kernels,
                       const std::vector<at::Tensor>& weights,
                       const std::vector<at::Tensor>& scales,
                       const std::vector<at::Tensor>& lora_weights,
                       const std::vector<at::Tensor>& gguf_parts, size_t l,
                       Projection (&out)[4]) {
  for (size_t i = 0; i < 4; ++i) {
    out[i] = Projection{kernels[4 * l + i], weights[4 * l + i], scales[4 * l + i], {}, {}, {}};
    if (out[i].kernel == kGguf) {
      const at::Tensor& table = out[i].scales;
      TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 2 &&
                      table.size(0) > 0 && table.is_contiguous(),
                  "a GGUF projection's scales must be int64 (parts, 2): type and index");
      const int64_t* entry = table.data_ptr<int64_t>();
      for (int64_t p = 0; p < table.size(0); ++p) {
        const int64_t type = entry[2 * p], index = entry[2 * p + 1];
        TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(gguf_parts.size()),
                    "a GGUF part's index is outside gguf_parts");
        out[i].types.push_back(type);
        out[i].parts.push_back(gguf_parts[index]);
      }
    }
    if (!lora_weights.empty()) {
      const at::Tensor* w = &lora_weights[5 * (4 * l + i)];
      out[i].lora = LoraWeights{w[0], w[1], w[2], w[3], w[4]};
    }
  }
}

// The pass's LoRA groups from lora_pass (rows, starts, slots), or none where it is empty.
LoraPass lora_pass_of(const std::vector<at::Tensor>& lora_pass) {
  TORCH_CHECK(lora_pass.empty() || lora_pass.size() == 3,
              "lora_pass must be empty or (rows, starts, slots)");
  return lora_pass.empty() ? LoraPass{} : LoraPass{lora_pass[0], lora_pass[1], lora_pass[2]};
}

}  // namespace radixlm_decode_layer

// decode_layer: one decode step of a layer, T new tokens (one a request).
//   x (T, hidden) the layer's input; residual (T, hidden) the residual stream before it
//   (has_residual false: the first layer, whose input is the stream); input_norm and
//   post_norm (hidden,) RMSNorm weights with eps; kernels, weights and scales: the four
//   projections qkv (stacked q | k | v), o, gate_up (gate | up) and down, each as a
//   Projection (its kernel, its weight in that kernel's layout, its int8 scales or an empty
//   tensor); cos and signed_sin (T, 1, D) RoPE of the tokens' positions;
//   k_buffer, v_buffer (N, H_kv, D) the layer's KV pool, written at out_cache_loc (T,) and
//   read through kv_slots (T, S) and seq_lens (T,) as paged_decode_attention reads them.
//   lora_pass: empty, or the pass's LoRA groups (rows, starts, slots: lora_add's), and then
//   lora_weights: five lora_add operands (a, b_t, scales, ranks, bounds) for each of the four
//   projections, an empty a where the projection has no adapters. gguf_parts: the GGUF
//   projections' blocks (quantized_matmul_parts' parts), which their scales index.
//   Returns (the layer's output, the residual stream after its attention), both (T, hidden).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const at::Tensor& residual, bool has_residual,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    const std::vector<int64_t>& kernels, const std::vector<at::Tensor>& weights,
    const std::vector<at::Tensor>& scales, const at::Tensor& cos, const at::Tensor& signed_sin,
    at::Tensor k_buffer, at::Tensor v_buffer, const at::Tensor& out_cache_loc,
    const at::Tensor& kv_slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    double scale, const std::vector<at::Tensor>& lora_pass,
    const std::vector<at::Tensor>& lora_weights, const std::vector<at::Tensor>& gguf_parts) {
  TORCH_CHECK(kernels.size() == 4 && weights.size() == 4 && scales.size() == 4,
              "four projections expected: qkv, o, gate_up, down");
  TORCH_CHECK(lora_weights.size() == (lora_pass.empty() ? 0 : 20),
              "lora_weights: five operands for each of the four projections with lora_pass");
  radixlm_decode_layer::Projection projections[4];
  radixlm_decode_layer::layer_projections(kernels, weights, scales, lora_weights, gguf_parts,
                                          0, projections);
  return radixlm_decode_layer::layer_step(x, residual, has_residual, input_norm, post_norm,
                                          eps, projections, cos, signed_sin, k_buffer,
                                          v_buffer, out_cache_loc, kv_slots, seq_lens, heads,
                                          kv_heads, scale,
                                          radixlm_decode_layer::lora_pass_of(lora_pass));
}

// decode_layers: the decode step of L consecutive layers, each as decode_layer's, the first
// without a residual and each later one on its predecessor's (output, residual stream).
// norms (2 L): each layer's input and post-attention RMSNorm weights, all with eps;
// kernels, weights and scales (4 L each): each layer's four projections as decode_layer
// takes them; kv_buffers (2 L): each layer's k_buffer and v_buffer; the rest shared by the
// layers, as decode_layer takes it; lora_pass as decode_layer's, and lora_weights then 20 a
// layer. Returns the last layer's (output, residual stream).
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, const std::vector<at::Tensor>& norms, double eps,
    const std::vector<int64_t>& kernels, const std::vector<at::Tensor>& weights,
    const std::vector<at::Tensor>& scales, const at::Tensor& cos, const at::Tensor& signed_sin,
    std::vector<at::Tensor> kv_buffers, const at::Tensor& out_cache_loc,
    const at::Tensor& kv_slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    double scale, const std::vector<at::Tensor>& lora_pass,
    const std::vector<at::Tensor>& lora_weights, const std::vector<at::Tensor>& gguf_parts) {
  const size_t layers = norms.size() / 2;
  TORCH_CHECK(layers > 0 && norms.size() == 2 * layers && kernels.size() == 4 * layers &&
                  weights.size() == 4 * layers && scales.size() == 4 * layers &&
                  kv_buffers.size() == 2 * layers,
              "per layer: two norms, four projections' kernels, weights and scales, and "
              "k and v buffers");
  TORCH_CHECK(lora_weights.size() == (lora_pass.empty() ? 0 : 20 * layers),
              "lora_weights: five operands for each projection of each layer with lora_pass");
  const radixlm_decode_layer::LoraPass lora = radixlm_decode_layer::lora_pass_of(lora_pass);
  at::Tensor h = x, stream = x;
  for (size_t l = 0; l < layers; ++l) {
    radixlm_decode_layer::Projection projections[4];
    radixlm_decode_layer::layer_projections(kernels, weights, scales, lora_weights,
                                            gguf_parts, l, projections);
    std::tie(h, stream) = radixlm_decode_layer::layer_step(
        h, stream, l > 0, norms[2 * l], norms[2 * l + 1], eps, projections, cos, signed_sin,
        kv_buffers[2 * l], kv_buffers[2 * l + 1], out_cache_loc, kv_slots, seq_lens, heads,
        kv_heads, scale, lora);
  }
  return {h, stream};
}
