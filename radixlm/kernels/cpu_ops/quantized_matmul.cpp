// Products with GGUF block-quantized weights (see fused_ops.py; the layouts are llama.cpp's,
// decoded in torch by kernels/quantized/block_formats.py).
//
// quantized_matmul(x, blocks, type): out = x @ W.T for x (M, K) float32 or bfloat16 and W
// (N, K) stored as `blocks`, uint8 (N, row bytes), each row K / values blocks of the ggml
// type `type` (gguf.GGMLQuantizationType's number). quantized_matmul_parts(x, parts, types):
// the same for W stacked from parts of possibly different types along N (a checkpoint's q, k
// and v), each part's product written into its columns of one output. The blocks of a few
// weight rows are decoded in registers and multiplied there with up to 4 rows of x at a time,
// again for each further 4 rows (from L1). Sums in float32, each output rounded once to x's
// type. Threads split the output rows.
//
// Passes of a few bfloat16 rows go to quantized_matmul_bf16.cpp's dot products where the
// build has AVX-512 BF16 (quantized_bf16_dots_serve(x, type) says which).
//
// dequantize_blocks(blocks, type, out): W decoded into out (N, K), float32 or bfloat16 (the
// reused buffer a long pass multiplies with torch's GEMM).
//
// A decoded float32 weight equals block_formats.dequantize_rows's (the same products in the
// same order); the products' sums are ordered otherwise than a GEMM's, so they agree to
// float32 rounding.

#include "common.h"
#include "kernels.h"
#include "gguf_blocks.h"
#include "matmul_lanes.h"

namespace radixlm_quant {

using radixlm_matmul::kParallelWork;
using radixlm_matmul::load_activations;
using radixlm_matmul::multiply_add;

// Values of a row dequantize_blocks decodes at a time (into a bfloat16 buffer: through a
// float32 scratch of this size).
constexpr int64_t kChunk = 512;
static_assert(kChunk % 256 == 0 && kChunk % kWidth == 0, "a chunk holds whole blocks");

// Values [first, first + count) of a row (both multiples of F's values) into out; asks for
// the row's next chunk as it goes (a few rows are read side by side, more streams than the
// CPU's own prefetcher follows well).
template <typename F>
inline void decode_span(const uint8_t* row, int64_t first, int64_t count, float* out) {
  const uint8_t* b = row + first / F::kValues * F::kBytes;
  const int64_t blocks = count / F::kValues;
  const uint8_t* ahead = b + blocks * F::kBytes;
  for (int64_t j = 0; j < blocks * F::kBytes; j += 64) __builtin_prefetch(ahead + j, 0, 3);
  for (int64_t i = 0; i < blocks; ++i) decode<F>(b + i * F::kBytes, out + i * F::kValues);
}

// Rows [0, MB) of x against weight rows [0, R), decoded in registers block by block into
// out[m * ld + r]: for a few rows of x (each further group of rows would decode them again).
// The weights kPrefetchBytes past each block are asked for as it is read: a tile's rows are
// contiguous, so that is the same columns of the rows some tiles on.
using radixlm_matmul::kPrefetchBytes;

template <typename F, int R, int MB, typename X>
inline void register_tile(const X* x, int64_t K, const uint8_t* w, int64_t row_bytes, X* out,
                          int64_t ld) {
  Lanes acc[MB][R] = {};
  const int64_t blocks = K / F::kValues;
  for (int64_t i = 0; i < blocks; ++i) {
    const X* xb = x + i * F::kValues;
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = w + r * row_bytes + i * F::kBytes;
      for (int64_t j = 0; j < F::kBytes; j += 64) __builtin_prefetch(block + kPrefetchBytes + j, 0, 3);
      F::lanes(block, [&](int first, Lanes weights) {
        for (int m = 0; m < MB; ++m) {
          acc[m][r] = multiply_add(load_activations(xb + m * K + first), weights, acc[m][r]);
        }
      });
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < R; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < kWidth; ++i) sum += acc[m][r][i];
      out[m * ld + r] = static_cast<X>(sum);
    }
  }
}

// Rows [0, M) of x against weight rows [0, R): x's rows 4 at a time (the tile's blocks, a
// few KiB, stay in L1 while each group decodes them again).
template <typename F, int R, typename X>
inline void register_rows(const X* x, int64_t M, int64_t K, const uint8_t* w,
                          int64_t row_bytes, X* out, int64_t ld) {
  if constexpr (R > 4) {  // (the tiles of one row of x)
    for (int64_t m = 0; m < M; ++m) {
      register_tile<F, R, 1>(x + m * K, K, w, row_bytes, out + m * ld, ld);
    }
    return;
  }
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) register_tile<F, R, 4>(x + m * K, K, w, row_bytes, out + m * ld, ld);
  switch (M - m) {
    case 3: return register_tile<F, R, 3>(x + m * K, K, w, row_bytes, out + m * ld, ld);
    case 2: return register_tile<F, R, 2>(x + m * K, K, w, row_bytes, out + m * ld, ld);
    case 1: return register_tile<F, R, 1>(x + m * K, K, w, row_bytes, out + m * ld, ld);
    default: return;
  }
}

// out (M, N; rows ld apart) = x (M, K) @ W.T in tiles of R weight rows (the rest one by
// one), split between the threads.
template <typename F, int R, typename X>
void register_matmul(const X* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, X* out,
                     int64_t ld) {
  const int64_t row_bytes = K / F::kValues * F::kBytes;
  const int64_t tiles = N / R;
  const int64_t grain = std::max<int64_t>(1, kParallelWork / std::max<int64_t>(R * K * M, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      register_rows<F, R>(x, M, K, w + t * R * row_bytes, row_bytes, out + t * R, ld);
    }
  });
  for (int64_t n = tiles * R; n < N; ++n) {
    register_rows<F, 1>(x, M, K, w + n * row_bytes, row_bytes, out + n, ld);
  }
}

// One row of x: 8 weight rows a tile (8 streams of weights); more: 4 weight rows by 4 of x
// on AVX-512's 32 registers, 3 by 4 on AVX2's 16.
template <typename F, typename X>
void matmul(const X* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, X* out, int64_t ld) {
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int kWeightsPerTile = 4;
#else
  constexpr int kWeightsPerTile = 3;
#endif
  if (M == 1) {
    register_matmul<F, 8>(x, M, K, w, N, out, ld);
  } else {
    register_matmul<F, kWeightsPerTile>(x, M, K, w, N, out, ld);
  }
}

// The values a row of `blocks` holds in ggml type `type` (checking the arguments).
int64_t row_values(const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous uint8 (N, row bytes) CPU tensor");
  int64_t values = 0;
  dispatch_format(type, [&](auto format) {
    using F = decltype(format);
    TORCH_CHECK(blocks.size(1) % F::kBytes == 0, "a row of blocks must be a multiple of ",
                F::kBytes, " bytes, got ", blocks.size(1));
    values = blocks.size(1) / F::kBytes * F::kValues;
  });
  return values;
}

}  // namespace radixlm_quant

at::Tensor quantized_matmul_parts(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                                  const std::vector<int64_t>& types) {
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(),
              "one type for each of one or more parts expected");
  const int64_t K = radixlm_quant::row_values(parts[0], types[0]);
  int64_t N = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    TORCH_CHECK(radixlm_quant::row_values(parts[i], types[i]) == K,
                "every part must hold rows of ", K, " values");
    N += parts[i].size(0);
  }
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU (M, K) tensor for K = ", K);
  const at::Tensor a = x.contiguous();
  const int64_t M = a.size(0);
  at::Tensor out = at::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out;
  std::vector<const uint8_t*> blocks;
  std::vector<int64_t> rows;
  for (const at::Tensor& part : parts) {
    blocks.push_back(part.data_ptr<uint8_t>());
    rows.push_back(part.size(0));
  }
  if (a.scalar_type() == at::kBFloat16 &&
      quantized_matmul_bf16_dots(a, blocks, rows, types, out.data_ptr<at::BFloat16>(), N)) {
    return out;  // every part on the dot products, in one parallel region
  }
  int64_t first = 0;  // the part's first output column
  for (size_t i = 0; i < parts.size(); ++i) {
    const uint8_t* w = blocks[i];
    const int64_t type = types[i];
    AT_DISPATCH_SWITCH(a.scalar_type(), "quantized_matmul", AT_DISPATCH_CASE(at::kFloat, [&] {
      radixlm_quant::dispatch_format(type, [&](auto format) {
        radixlm_quant::matmul<decltype(format)>(a.data_ptr<scalar_t>(), M, K, w, rows[i],
                                                 out.data_ptr<scalar_t>() + first, N);
      });
    }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
      scalar_t* o = out.data_ptr<scalar_t>() + first;
      if (quantized_matmul_bf16_dots(a, {w}, {rows[i]}, {type}, o, N)) return;
      radixlm_quant::dispatch_format(type, [&](auto format) {
        radixlm_quant::matmul<decltype(format)>(a.data_ptr<scalar_t>(), M, K, w, rows[i], o,
                                                 N);
      });
    }));
    first += rows[i];
  }
  return out;
}

at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  return quantized_matmul_parts(x, {blocks}, {type});
}

void dequantize_blocks(const at::Tensor& blocks, int64_t type, at::Tensor& out) {
  const int64_t K = radixlm_quant::row_values(blocks, type);
  const int64_t N = blocks.size(0);
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == N && out.size(1) == K &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be a contiguous float32 or bfloat16 (", N, ", ", K, ") CPU tensor");
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  const bool wide = out.scalar_type() == at::kFloat;
  void* data = out.data_ptr();
  radixlm_quant::dispatch_format(type, [&](auto format) {
    using F = decltype(format);
    const int64_t grain = std::max<int64_t>(1, radixlm_matmul::kParallelWork / (8 * K));
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(wide ? 0 : radixlm_quant::kChunk);
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t k = 0; k < K; k += radixlm_quant::kChunk) {
          const int64_t count = std::min(radixlm_quant::kChunk, K - k);
          if (wide) {
            float* row = static_cast<float*>(data) + n * K;
            radixlm_quant::decode_span<F>(w + n * row_bytes, k, count, row + k);
          } else {
            radixlm_quant::decode_span<F>(w + n * row_bytes, k, count, scratch.data());
            at::BFloat16* row = static_cast<at::BFloat16*>(data) + n * K + k;
            at::vec::convert(scratch.data(), row, count);
          }
        }
      }
    });
  });
}
