// The projections of a fused decode step (decode_layer.cpp, sandwich_decode_layers.cpp):
// each one's weight and the kernel that multiplies it, as the layer's Linear module would
// for the step's rows, then its LoRA adapters' terms. Shared by the fused steps, so that a
// projection is multiplied the same way in each.

#pragma once

#include <cstdint>
#include <vector>

#include "common.h"
#include "kernels.h"


// fused_ops.ProjectionKernel's values, which the build passes (fused_ops._shared_constants).
#if !defined(RADIXLM_PROJECTION_PAIRS) || !defined(RADIXLM_PROJECTION_GGUF)
#error "build through fused_ops.py, which defines RADIXLM_PROJECTION_* from ProjectionKernel"
#endif

namespace radixlm_decode_layer {

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

// Layer l's four projections from lists of four a layer (and five LoRA operands a
// projection, where lora_weights is not empty). A GGUF projection's scales are int64
// (parts, 2): each part's ggml type and its index in gguf_parts.
inline void layer_projections(const std::vector<int64_t>& kernels,
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
inline LoraPass lora_pass_of(const std::vector<at::Tensor>& lora_pass) {
  TORCH_CHECK(lora_pass.empty() || lora_pass.size() == 3,
              "lora_pass must be empty or (rows, starts, slots)");
  return lora_pass.empty() ? LoraPass{} : LoraPass{lora_pass[0], lora_pass[1], lora_pass[2]};
}

}  // namespace radixlm_decode_layer
