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
#include "decode_projection.h"
#include "kernels.h"

namespace radixlm_decode_layer {

struct LayerShape {
  int64_t tokens, heads, kv_heads, head_dim;
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
