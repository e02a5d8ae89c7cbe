// A pre-norm decoder layer's decode step (Llama's block: RMSNorm, QKV, RoPE, paged attention,
// O, RMSNorm, gated SiLU MLP) in one call from Python, for weights laid out by column pairs
// (pair_matmul.cpp). It calls the kernels of fused_ops.cpp and pair_matmul.cpp in the order
// and on the operands the layer's modules give them, so its outputs equal theirs to the bit;
// what it leaves out is the Python between them (module calls, views, the attention
// backend's dispatch: about 100 us a layer, a quarter of a batch-1 step of the default
// model). Compiled as one translation unit with those files (see fused_ops.py), after them.

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

}  // namespace radixlm_decode_layer

// decode_layer: one decode step of a layer, T new tokens (one a request).
//   x (T, hidden) the layer's input; residual (T, hidden) the residual stream before it
//   (has_residual false: the first layer, whose input is the stream); input_norm and
//   post_norm (hidden,) RMSNorm weights with eps; qkv_pairs, o_pairs, gate_up_pairs,
//   down_pairs: the projections by column pairs (pair_matmul's layout; QKV stacked q | k | v,
//   gate_up gate | up); cos and signed_sin (T, 1, D) RoPE of the tokens' positions;
//   k_buffer, v_buffer (N, H_kv, D) the layer's KV pool, written at out_cache_loc (T,) and
//   read through kv_slots (T, S) and seq_lens (T,) as paged_decode_attention reads them.
//   Returns (the layer's output, the residual stream after its attention), both (T, hidden).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const at::Tensor& residual, bool has_residual,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    const at::Tensor& qkv_pairs, const at::Tensor& o_pairs, const at::Tensor& gate_up_pairs,
    const at::Tensor& down_pairs, const at::Tensor& cos, const at::Tensor& signed_sin,
    at::Tensor k_buffer, at::Tensor v_buffer, const at::Tensor& out_cache_loc,
    const at::Tensor& kv_slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    double scale) {
  TORCH_CHECK(x.dim() == 2 && k_buffer.dim() == 3, "x must be (T, hidden), k_buffer 3-D");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
              "heads must be a positive multiple of kv_heads");
  const radixlm_decode_layer::LayerShape shape{x.size(0), heads, kv_heads, k_buffer.size(2)};
  at::Tensor h, stream;
  if (has_residual) {
    std::tie(h, stream) = add_rms_norm(x, residual, input_norm, eps);
  } else {
    h = rms_norm(x, input_norm, eps);
    stream = x;
  }
  auto [q, k, v] = radixlm_decode_layer::rotated_qkv(pair_matmul(h, qkv_pairs), cos, signed_sin,
                                                     shape);
  scatter_rows(k_buffer, out_cache_loc, k);
  scatter_rows(v_buffer, out_cache_loc, v);
  const at::Tensor attended =
      paged_decode_attention(q, k_buffer, v_buffer, kv_slots, seq_lens, scale);
  const at::Tensor o = pair_matmul(attended.reshape({shape.tokens, -1}), o_pairs);
  auto [h2, stream2] = add_rms_norm(o, stream, post_norm, eps);
  return {pair_matmul(silu_mul(pair_matmul(h2, gate_up_pairs)), down_pairs), stream2};
}
