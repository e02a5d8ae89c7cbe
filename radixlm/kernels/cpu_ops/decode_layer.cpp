// A pre-norm decoder layer's decode step (Llama's block: RMSNorm, QKV, RoPE, paged attention,
// O, RMSNorm, gated SiLU MLP) in one call from Python. It calls the kernels of fused_ops.cpp,
// few_rows_matmul.cpp, blocked_matmul.cpp and pair_matmul.cpp (or torch's linear) in the
// order and on the operands the layer's modules give them, so its outputs equal theirs to
// the bit; what it leaves out is the Python between them (module calls, views, the
// attention backend's dispatch: a quarter of a batch-1 step of the default model,
// benchmarks/RESULTS.md). decode_layers runs a model's consecutive layers so in one call,
// leaving out the Python between the layers too. Their declarations are kernels.h's.

#include "common.h"
#include "kernels.h"

// fused_ops.ProjectionKernel's values, which the build passes (fused_ops._shared_constants).
#if !defined(RADIXLM_PROJECTION_PAIRS) || !defined(RADIXLM_PROJECTION_INT8_BLOCKED)
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
};

// A projection's weight (and int8 scales, else an empty tensor) and the kernel that
// multiplies it, as the layer's Linear module would for this step's rows.
struct Projection {
  int64_t kernel;
  at::Tensor weight, scales;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kernel) {
      case kPairs: return pair_matmul(x, weight);
      case kInt8: return int8_matmul(x, weight, scales);
      case kDense: return dense_matmul(x, weight);
      case kTorchLinear: return at::linear(x, weight);
      case kInt8Pairs: return int8_pair_matmul(x, weight, scales);
      case kBlocked: return blocked_matmul(x, weight);
      case kInt8Blocked: return blocked_int8_matmul(x, weight, scales);
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
    double scale) {
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
  auto [q, k, v] = rotated_qkv(qkv_proj(h), cos, signed_sin, shape);
  scatter_rows(k_buffer, out_cache_loc, k);
  scatter_rows(v_buffer, out_cache_loc, v);
  const at::Tensor attended =
      paged_decode_attention(q, k_buffer, v_buffer, kv_slots, seq_lens, scale);
  const at::Tensor o = o_proj(attended.reshape({shape.tokens, -1}));
  auto [h2, stream2] = add_rms_norm(o, stream, post_norm, eps);
  return {down_proj(silu_mul(gate_up_proj(h2))), stream2};
}

// Layer l's four projections from lists of four a layer.
void layer_projections(const std::vector<int64_t>& kernels,
                       const std::vector<at::Tensor>& weights,
                       const std::vector<at::Tensor>& scales, size_t l,
                       Projection (&out)[4]) {
  for (size_t i = 0; i < 4; ++i) {
    out[i] = Projection{kernels[4 * l + i], weights[4 * l + i], scales[4 * l + i]};
  }
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
//   Returns (the layer's output, the residual stream after its attention), both (T, hidden).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const at::Tensor& residual, bool has_residual,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    const std::vector<int64_t>& kernels, const std::vector<at::Tensor>& weights,
    const std::vector<at::Tensor>& scales, const at::Tensor& cos, const at::Tensor& signed_sin,
    at::Tensor k_buffer, at::Tensor v_buffer, const at::Tensor& out_cache_loc,
    const at::Tensor& kv_slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    double scale) {
  TORCH_CHECK(kernels.size() == 4 && weights.size() == 4 && scales.size() == 4,
              "four projections expected: qkv, o, gate_up, down");
  radixlm_decode_layer::Projection projections[4];
  radixlm_decode_layer::layer_projections(kernels, weights, scales, 0, projections);
  return radixlm_decode_layer::layer_step(x, residual, has_residual, input_norm, post_norm,
                                          eps, projections, cos, signed_sin, k_buffer,
                                          v_buffer, out_cache_loc, kv_slots, seq_lens, heads,
                                          kv_heads, scale);
}

// decode_layers: the decode step of L consecutive layers, each as decode_layer's, the first
// without a residual and each later one on its predecessor's (output, residual stream).
// norms (2 L): each layer's input and post-attention RMSNorm weights, all with eps;
// kernels, weights and scales (4 L each): each layer's four projections as decode_layer
// takes them; kv_buffers (2 L): each layer's k_buffer and v_buffer; the rest shared by the
// layers, as decode_layer takes it. Returns the last layer's (output, residual stream).
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, const std::vector<at::Tensor>& norms, double eps,
    const std::vector<int64_t>& kernels, const std::vector<at::Tensor>& weights,
    const std::vector<at::Tensor>& scales, const at::Tensor& cos, const at::Tensor& signed_sin,
    std::vector<at::Tensor> kv_buffers, const at::Tensor& out_cache_loc,
    const at::Tensor& kv_slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    double scale) {
  const size_t layers = norms.size() / 2;
  TORCH_CHECK(layers > 0 && norms.size() == 2 * layers && kernels.size() == 4 * layers &&
                  weights.size() == 4 * layers && scales.size() == 4 * layers &&
                  kv_buffers.size() == 2 * layers,
              "per layer: two norms, four projections' kernels, weights and scales, and "
              "k and v buffers");
  at::Tensor h = x, stream = x;
  for (size_t l = 0; l < layers; ++l) {
    radixlm_decode_layer::Projection projections[4];
    radixlm_decode_layer::layer_projections(kernels, weights, scales, l, projections);
    std::tie(h, stream) = radixlm_decode_layer::layer_step(
        h, stream, l > 0, norms[2 * l], norms[2 * l + 1], eps, projections, cos, signed_sin,
        kv_buffers[2 * l], kv_buffers[2 * l + 1], out_cache_loc, kv_slots, seq_lens, heads,
        kv_heads, scale);
  }
  return {h, stream};
}
