// The decode step of a model's "sandwich" decoder layers (Gemma 2 and 3: every sublayer's
// input and output normed) in one call from Python, as decode_layer.cpp runs Llama's block.
// Per layer, in the order and on the operands the layer's modules give the kernels:
//
//   h = norm_in(x + residual)                 (the first layer: norm_in(x), the stream x)
//   q, k, v = qkv(h); q, k = rotary(norm_q(q), norm_k(k))   (no q/k norms: rotary(q, k))
//   K/V stored at the layer's write slots; a = attention(q) over the layer's table
//   h = norm_post_attn(o(a)); h2, stream = norm_pre_ff(h + stream)
//   out = norm_post_ff(down(gelu(gate(h2)) * up(h2)))
//
// Every norm takes its float32 scale (Gemma's 1 + w, GemmaRMSNorm.scale). A layer's RoPE
// table, the slots its new K/V go to, the table its attention reads keys through and its
// logit softcap are its own: Gemma 3's local layers have their own RoPE base, and a sliding
// layer's keys are the window's, held under the pool's slot map (hybrid_pool.py), which the
// caller has already applied to the write slots and the table. So the outputs and the
// stored KV equal the modules' to the bit (tests/models/layers/test_cpu_sandwich_decode.py);
// what this leaves out is the Python around the kernels. Declared in kernels.h.

#include "common.h"
#include "decode_projection.h"
#include "kernels.h"

#include <string>

namespace radixlm_sandwich_decode {

using radixlm_decode_layer::LoraPass;
using radixlm_decode_layer::Projection;

// The operands of one layer's step that are the layer's own.
struct SandwichLayer {
  const at::Tensor* norms;  // six: input, post-attention, pre- and post-feedforward, q, k
  Projection projections[4];  // qkv (q | k | v), o, gate_up (gate | up), down
  const at::Tensor *cos, *signed_sin;  // (T, 1, D)
  at::Tensor *k_buffer, *v_buffer;  // (N, H_kv, D)
  const at::Tensor *write_slots, *kv_slots, *key_lens;  // (T,), (T, S), (T,)
  double softcap;  // 0: none
};

// What every layer shares.
struct SandwichShape {
  int64_t heads, kv_heads;
  double eps, scale;
  bool qk_norm;
  std::string gelu_approximate;  // "tanh" or "none", as F.gelu's approximate
};

// One layer's decode step: (its output, the residual stream after its attention).
std::tuple<at::Tensor, at::Tensor> sandwich_step(const at::Tensor& x, const at::Tensor& residual,
                                                 bool has_residual, const SandwichLayer& layer,
                                                 const SandwichShape& shape,
                                                 const LoraPass& lora) {
  TORCH_CHECK(x.dim() == 2 && layer.k_buffer->dim() == 3, "x must be (T, hidden), k_buffer 3-D");
  const auto& [qkv_proj, o_proj, gate_up_proj, down_proj] = layer.projections;
  const at::Tensor* norm = layer.norms;
  const int64_t tokens = x.size(0), heads = shape.heads, kv_heads = shape.kv_heads;
  at::Tensor h, stream;
  if (has_residual) {
    std::tie(h, stream) = add_rms_norm(x, residual, norm[0], shape.eps);
  } else {
    h = rms_norm(x, norm[0], shape.eps);
    stream = x;
  }
  const at::Tensor qkv =
      qkv_proj(h, lora).view({tokens, heads + 2 * kv_heads, layer.k_buffer->size(2)});
  at::Tensor qk = qkv.slice(1, 0, heads + kv_heads);
  if (shape.qk_norm) {
    qk = at::cat({rms_norm(qkv.slice(1, 0, heads), norm[4], shape.eps),
                  rms_norm(qkv.slice(1, heads, heads + kv_heads), norm[5], shape.eps)},
                 1);
  }
  qk = rotary(qk, *layer.cos, *layer.signed_sin);  // (T, H + H_kv, D)
  const at::Tensor q = qk.slice(1, 0, heads), k = qk.slice(1, heads);
  scatter_rows(*layer.k_buffer, *layer.write_slots, k);
  scatter_rows(*layer.v_buffer, *layer.write_slots, qkv.slice(1, heads + kv_heads));
  const at::Tensor attended = paged_decode_attention(q, *layer.k_buffer, *layer.v_buffer,
                                                     *layer.kv_slots, *layer.key_lens,
                                                     shape.scale, layer.softcap);
  const at::Tensor o = rms_norm(o_proj(attended.reshape({tokens, -1}), lora), norm[1], shape.eps);
  auto [h2, stream2] = add_rms_norm(o, stream, norm[2], shape.eps);
  const at::Tensor gate_up = gate_up_proj(h2, lora);
  const int64_t inter = gate_up.size(1) / 2;
  const at::Tensor gated =
      at::gelu(gate_up.slice(1, 0, inter), shape.gelu_approximate) * gate_up.slice(1, inter);
  return {rms_norm(down_proj(gated, lora), norm[3], shape.eps), stream2};
}

}  // namespace radixlm_sandwich_decode

// sandwich_decode_layers: the decode step of L consecutive sandwich layers (the file's
// comment), the first without a residual and each later one on its predecessor's (output,
// residual stream). T new tokens, one a request.
//   x (T, hidden) the first layer's input; norms (6 L): each layer's float32 norm scales,
//   input, post-attention, pre-feedforward, post-feedforward, q and k (the last two unread
//   without qk_norm), all with eps; kernels, weights and scales (4 L each): each layer's
//   projections qkv, o, gate_up and down as decode_layer takes them; ropes (2 L): each
//   layer's cos and signed_sin (T, 1, D); kv_buffers (2 L): each layer's K and V buffers;
//   tables (3 L): each layer's write slots (T,) for the new K/V, and the kv_slots (T, S) and
//   key_lens (T,) its attention reads keys through (paged_decode_attention's slots and
//   seq_lens); softcaps (L): each layer's logit softcap, 0 for none. heads, kv_heads and
//   scale: the attention's, every layer's; gelu_approximate: "tanh" or "none". lora_pass,
//   lora_weights (20 a layer) and gguf_parts as decode_layers takes them.
//   Returns the last layer's (output, residual stream), both (T, hidden).
std::tuple<at::Tensor, at::Tensor> sandwich_decode_layers(
    const at::Tensor& x, const std::vector<at::Tensor>& norms, double eps,
    const std::vector<int64_t>& kernels, const std::vector<at::Tensor>& weights,
    const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& ropes,
    std::vector<at::Tensor> kv_buffers, const std::vector<at::Tensor>& tables,
    const std::vector<double>& softcaps, int64_t heads, int64_t kv_heads, double scale,
    bool qk_norm, const std::string& gelu_approximate, const std::vector<at::Tensor>& lora_pass,
    const std::vector<at::Tensor>& lora_weights, const std::vector<at::Tensor>& gguf_parts) {
  const size_t layers = softcaps.size();
  TORCH_CHECK(layers > 0 && norms.size() == 6 * layers && kernels.size() == 4 * layers &&
                  weights.size() == 4 * layers && scales.size() == 4 * layers &&
                  ropes.size() == 2 * layers && kv_buffers.size() == 2 * layers &&
                  tables.size() == 3 * layers,
              "per layer: six norms, four projections' kernels, weights and scales, a rope "
              "table's cos and sin, k and v buffers, three attention tables and a softcap");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
              "heads must be a positive multiple of kv_heads");
  TORCH_CHECK(gelu_approximate == "tanh" || gelu_approximate == "none",
              "gelu_approximate must be 'tanh' or 'none'");
  TORCH_CHECK(lora_weights.size() == (lora_pass.empty() ? 0 : 20 * layers),
              "lora_weights: five operands for each projection of each layer with lora_pass");
  const radixlm_decode_layer::LoraPass lora = radixlm_decode_layer::lora_pass_of(lora_pass);
  const radixlm_sandwich_decode::SandwichShape shape{heads, kv_heads, eps, scale, qk_norm,
                                                     gelu_approximate};
  at::Tensor h = x, stream = x;
  for (size_t l = 0; l < layers; ++l) {
    radixlm_sandwich_decode::SandwichLayer layer{
        &norms[6 * l], {}, &ropes[2 * l], &ropes[2 * l + 1], &kv_buffers[2 * l],
        &kv_buffers[2 * l + 1], &tables[3 * l], &tables[3 * l + 1], &tables[3 * l + 2],
        softcaps[l]};
    radixlm_decode_layer::layer_projections(kernels, weights, scales, lora_weights,
                                            gguf_parts, l, layer.projections);
    std::tie(h, stream) =
        radixlm_sandwich_decode::sandwich_step(h, stream, l > 0, layer, shape, lora);
  }
  return {h, stream};
}
