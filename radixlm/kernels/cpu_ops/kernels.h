// The kernels' entry points, one definition each in the source named beside it: what
// bindings.cpp exposes to Python (fused_ops.FUNCTIONS) and decode_layer.cpp calls. Their
// contracts are written at their definitions.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

// fused_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin);
at::Tensor silu_mul(const at::Tensor& gate_up);
void scatter_rows(at::Tensor& buffer, const at::Tensor& slots, const at::Tensor& rows);

// decode_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                                  const at::Tensor& v_buffer, const at::Tensor& slots,
                                  const at::Tensor& seq_lens, double scale,
                                  double softcap = 0.0);

// few_rows_matmul.cpp
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales);
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& weight);

// blocked_matmul.cpp
at::Tensor blocked_matmul(const at::Tensor& x, const at::Tensor& blocks);
at::Tensor blocked_int8_matmul(const at::Tensor& x, const at::Tensor& blocks,
                               const at::Tensor& scales);

// prefill_attention.cpp
bool prefill_attention_available();
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                                   const at::Tensor& v_buffer, const at::Tensor& slots,
                                   const at::Tensor& seq_lens, const at::Tensor& extend_lens,
                                   double scale);

// pair_matmul.cpp
bool pair_matmul_available();
at::Tensor pair_matmul(const at::Tensor& x, const at::Tensor& pairs);
at::Tensor pair_matmul_silu(const at::Tensor& x, const at::Tensor& pairs);
at::Tensor int8_pair_matmul(const at::Tensor& x, const at::Tensor& pairs,
                            const at::Tensor& scales);
at::Tensor int8_pair_matmul_silu(const at::Tensor& x, const at::Tensor& pairs,
                                 const at::Tensor& scales);

// decode_layer.cpp
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const at::Tensor& residual, bool has_residual,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    const std::vector<int64_t>& kernels, const std::vector<at::Tensor>& weights,
    const std::vector<at::Tensor>& scales, const at::Tensor& cos, const at::Tensor& signed_sin,
    at::Tensor k_buffer, at::Tensor v_buffer, const at::Tensor& out_cache_loc,
    const at::Tensor& kv_slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    double scale, const std::vector<at::Tensor>& lora_pass,
    const std::vector<at::Tensor>& lora_weights, const std::vector<at::Tensor>& gguf_parts);
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, const std::vector<at::Tensor>& norms, double eps,
    const std::vector<int64_t>& kernels, const std::vector<at::Tensor>& weights,
    const std::vector<at::Tensor>& scales, const at::Tensor& cos, const at::Tensor& signed_sin,
    std::vector<at::Tensor> kv_buffers, const at::Tensor& out_cache_loc,
    const at::Tensor& kv_slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    double scale, const std::vector<at::Tensor>& lora_pass,
    const std::vector<at::Tensor>& lora_weights, const std::vector<at::Tensor>& gguf_parts);

// sandwich_decode_layers.cpp
std::tuple<at::Tensor, at::Tensor> sandwich_decode_layers(
    const at::Tensor& x, const std::vector<at::Tensor>& norms, double eps,
    const std::vector<int64_t>& kernels, const std::vector<at::Tensor>& weights,
    const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& ropes,
    std::vector<at::Tensor> kv_buffers, const std::vector<at::Tensor>& tables,
    const std::vector<double>& softcaps, int64_t heads, int64_t kv_heads, double scale,
    bool qk_norm, const std::string& gelu_approximate, const std::vector<at::Tensor>& lora_pass,
    const std::vector<at::Tensor>& lora_weights, const std::vector<at::Tensor>& gguf_parts);

// lora_matmul.cpp
void lora_add(const at::Tensor& x, at::Tensor y, const at::Tensor& rows, const at::Tensor& starts,
              const at::Tensor& slots, const at::Tensor& a, const at::Tensor& b_t,
              const at::Tensor& scales, const at::Tensor& ranks, const at::Tensor& bounds);

// argmax.cpp
at::Tensor argmax_rows(const at::Tensor& x);

// quantized_matmul.cpp
at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t type);
at::Tensor quantized_matmul_parts(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                                  const std::vector<int64_t>& types);
void dequantize_blocks(const at::Tensor& blocks, int64_t type, at::Tensor& out);

// quantized_matmul_bf16.cpp: quantized_matmul's few bfloat16 rows; _dots returns whether it
// served (x contiguous; parts: a weight's blocks stacked along N, each part of rows[i] rows of
// types[i]; out (M, N) bfloat16, rows ld apart), which it does where every part's type does.
bool quantized_bf16_dots_serve(const at::Tensor& x, int64_t type);
bool quantized_matmul_bf16_dots(const at::Tensor& x, const std::vector<const uint8_t*>& parts,
                                const std::vector<int64_t>& rows,
                                const std::vector<int64_t>& types, at::BFloat16* out,
                                int64_t ld);
